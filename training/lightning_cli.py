"""NormlabCLI: LightningCLI wired to LitLM + TokenDataModule, with normlab's run directory conventions.

Config groups (all settable in YAML via `-c` and as dotted flags):
  model.*       LitLM: `preset` plus any ModelConfig field (`--model.placement post`)
  optim.*       OptimConfig: the optimizer (`--optim.name muon --optim.options.momentum 0.9`, training/optim/), its
                parameter groups and LR schedule (`--optim.lr 3e-4`)
  data.*        TokenDataModule (`--data.path`, `--data.seq_len`, `--data.batch_size`)
  trainer.*     Lightning Trainer (`--trainer.max_steps`, `--trainer.devices`, `--trainer.strategy zero2 | fsdp2`)
  checkpoint.*  StepCheckpoint (`--checkpoint.every_n_steps`, `--checkpoint.keep_last_n`)
  guard.*       NonFiniteGuard (`--guard.policy abort|skip`, `--guard.max_consecutive_skips`, spike dumps:
                `--guard.dump_spike_z`, `--guard.max_dumps`)
  throughput.*  Throughput (`--throughput.peak_tflops`)
  console.*     ConsoleLog: the train loss every N updates and each validation's loss as log lines
                (`--console.every_n_steps 50`; 0: validation lines only)
  eval.*        DownstreamEval: harness tasks in the loop (`--eval.tasks arc_easy --eval.every_n_steps 1000`)
  cluster.*     ClusterConfig: the collective timeout, Slurm's warning signal and requeueing (`--cluster.timeout_s
                600 --cluster.signal USR1`; training/cluster/)
  name, runs_dir, ckpt_path, branch_from, init_from, seed_everything, loggers (beside TensorBoard:
  training/loggers.py)

`--branch_from <run>/checkpoints/step-X` starts a new run (`--name`) from another run's checkpoint with its own
schedule: a cooldown branch (training/checkpointing/branch.py). `--init_from PATH` starts a new run from the weights
of a Hugging Face model, a normlab checkpoint or export, optionally with other norms (checkpointing/init_from.py).

Defaults: configs/default.yaml (the default job), then `-c` files in order, then dotted flags.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from data.datamodule import TokenDataModule
from data.prepare import DEFAULT_OUTPUT
from training import cli_checks, compat
from training.callbacks import NonFiniteGuard, RNGState, StepCheckpoint, Throughput, TrainingHealth
from training.callbacks.console_log import ConsoleLog
from training.callbacks.downstream import DownstreamEval
from training.callbacks.order import arrange
from training.callbacks.progress import step_counting
from training.callbacks.qk_clip import QKClip
from training.callbacks.summary import log_closing_lines, log_data_entropy, log_world_line, with_norm_summary
from training.checkpointing import branch, init_from, resume
from training.checkpointing.plan import RunPlan, plan
from training.checkpointing.safe import SafeCheckpointIO, safe_torch_load
from training.checkpointing.save import RunRecord, checkpoint_format
from training.cluster.config import ClusterConfig, with_timeout
from training.cluster.rank import is_first_rank
from training.cluster.stop import StopOnSignal
from training.cluster.timeout import CollectiveTimeout
from training.console import StartupLines
from training.distributed import is_deepspeed, is_fsdp2
from training.errors import UserError, is_user_error
from training.fsdp2 import FSDP2  # registers fsdp2
from training.lit_module import lit_lm
from training.loggers import LOGGERS, RecordLoggerRuns, run_loggers, start_wandb
from training.optim import OptimConfig, renamed_option
from training.precision import default_precision
from training.run import layout
from training.run.lock import RunLock, acquire
from training.run.manifest import Manifest
from training.strategy import DeepSpeed, resolve_strategy  # registers zeroN
from training.subcommands import LIGHTNING_SUBCOMMANDS

log = logging.getLogger(__name__)

# The default job: the defaults of `normlab fit | validate | test` are read from this file (the trainer settings,
# seed, data and model sizes), so the file is exactly what `normlab fit` with no arguments runs.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def run_dir(runs_dir: str, name: str) -> str:
    return str(Path(runs_dir) / name)


# A run name's longest path component: the run directory's name must leave room under the file systems' 255-byte
# limit (NAME_MAX), and the tools that show it (TensorBoard, trackers) cut long names anyway.
MAX_NAME_PART = 100


def check_name(name: str, runs_dir: str | Path = ".") -> None:
    """`--name` is a path inside `--runs_dir`: not absolute, no `..`, not empty, no component longer than
    MAX_NAME_PART, and — a link inside `--runs_dir` followed — still inside it, so no run writes elsewhere."""
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise UserError(f"--name {name!r}: a run's name is a path inside --runs_dir (e.g. `base`, `lr/s0`), not "
                        "absolute, without `..` and not empty; choose where runs go with --runs_dir")
    long = next((part for part in path.parts if len(part.encode()) > MAX_NAME_PART), None)
    if long is not None:
        raise UserError(f"--name {name[:40]!r}…: the component {long[:20]!r}… is {len(long.encode())} bytes long; "
                        f"keep each part of a run's name to at most {MAX_NAME_PART} (e.g. `lr3e-3/s0`)")
    root = Path(runs_dir).resolve()
    if not Path(runs_dir, name).resolve().is_relative_to(root):
        link = next(p for p in (Path(runs_dir, *path.parts[:i + 1]) for i in range(len(path.parts)))
                    if p.is_symlink())
        raise UserError(f"--name {name!r}: {link} is a link to {link.resolve()}, outside --runs_dir {root}; a run "
                        "writes only inside --runs_dir: remove the link, or give its target as --runs_dir")


class NormlabCLI(LightningCLI):
    """`normlab fit | validate | test`; `args` as on the command line (None: sys.argv)."""

    def __init__(self, args: list[str] | None = None) -> None:
        self.plan: RunPlan | None = None  # set before the classes are built (before_instantiate_classes)
        self._init_source: init_from.Source | None = None  # --init_from's source, prepared there too
        self.lock: RunLock | None = None  # the run directory's, held by the job's first rank while it runs
        self.startup = StartupLines.hold()  # printed once the start's checks passed (`_started`)
        try:
            self._run_cli(args)
        except Exception as err:
            if not is_user_error(err):
                self.startup.release()  # a crash: every line before its traceback
            raise
        finally:
            self.startup.drop()  # a refused start: its one error line, nothing before it
            if self.lock is not None:
                self.lock.release()

    def _run_cli(self, args: list[str] | None) -> None:
        super().__init__(
            lit_lm,
            TokenDataModule,
            save_config_callback=SaveConfigCallback,
            save_config_kwargs={"overwrite": True},  # runs/<name>/config.yaml: rewritten on resume
            auto_configure_optimizers=False,  # LitLM.configure_optimizers builds groups + schedule
            # exit_on_error=False: a parse error is raised (argparse.ArgumentError) and `normlab` prints it as one
            # line (training/errors.py) instead of jsonargparse's usage text.
            parser_kwargs={"prog": "normlab", "description": "Train and evaluate normlab language models.",
                           "exit_on_error": False,
                           **{sub: {"default_config_files": [str(DEFAULT_CONFIG)]} for sub in LIGHTNING_SUBCOMMANDS}},
            args=args,
        )

    def _subcommand_defaults(self) -> Any:
        """The running subcommand's defaults (configs/default.yaml and the classes' own): --init_from takes a model
        field the user left at its default from the source instead."""
        compat.require("lightning.pytorch.cli:LightningCLI._parser")
        return self._parser(self.subcommand).get_defaults()

    def _options(self, subcommand: str) -> list[str]:
        """Every flag of `subcommand` (`--group.key`): what a mistyped one is matched against."""
        compat.require("lightning.pytorch.cli:LightningCLI._parser")
        return [f"--{key}" for key in self._parser(subcommand).get_defaults().keys() if not key.startswith("__")]

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:  # an old name of a renamed option, or a typo: say what it is called
            argv = list(sys.argv[1:] if args is None else args)
            command = next((a for a in argv if a in LIGHTNING_SUBCOMMANDS), None)
            hint = renamed_option(str(err)) or (command and cli_checks.unknown_option(
                str(err), self._options(command), argv, command))
            if not hint:
                raise
            raise UserError(hint) from err
        # LightningCLI next reads a `--ckpt_path` file's hyper-parameters (weights-only, but a refused file would be
        # a traceback): refuse such a file first, in one line (its pickle is read, its tensors are not).
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            safe_torch_load(ckpt_path, mmap=True)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--name", type=str, default="default",
                            help="Run name: events, config and checkpoints go to <runs_dir>/<name>/")
        parser.add_argument("--runs_dir", type=str, default="runs", help="Directory holding all runs")
        parser.add_argument("--loggers", type=list[Literal[LOGGERS]], default=[],
                            help=f"More loggers beside TensorBoard (the default, always on): any of "
                                 f"{', '.join(LOGGERS)} (training/loggers.py)")
        parser.add_argument("--branch_from", type=Optional[str], default=None,  # noqa: UP045 (jsonargparse reads it)
                            help="Start this (new) run from another run's checkpoint directory with this run's own "
                                 "LR schedule: weights, optimizer state, data position and step carried over "
                                 "(a cooldown branch); with --ckpt_path last, resume the branch once it has "
                                 "checkpoints")
        parser.add_argument("--init_from", type=Optional[str], default=None,  # noqa: UP045 (jsonargparse reads it)
                            help="Start this (new) run from the weights of a Hugging Face model directory, a normlab "
                                 "checkpoint or export; model fields not given take the source's values, those "
                                 "given are norm surgery (docs/published-models.md)")
        # The run directory is the trainer's default_root_dir, derived here and nowhere else.
        parser.link_arguments(("runs_dir", "name"), "trainer.default_root_dir", compute_fn=run_dir)
        parser.add_class_arguments(OptimConfig, "optim")
        parser.link_arguments("optim", "model.optim", apply_on="instantiate")
        # The data decides the model's defaults for its vocabulary and context (`model.vocab_size` /
        # `model.max_seq_len` still override them): read from the built datamodule, before the model is built.
        parser.link_arguments("data.vocab_size", "model.data_vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.data_seq_len", apply_on="instantiate")
        # Built by `instantiate_trainer` with the run's state (what it resumes, what its manifests record).
        parser.add_class_arguments(StepCheckpoint, "checkpoint", skip={"resume_from", "record"}, instantiate=False,
                                   fail_untyped=False, sub_configs=True)
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(TrainingHealth, "metrics")
        parser.add_lightning_class_args(NonFiniteGuard, "guard")
        parser.add_lightning_class_args(ConsoleLog, "console")  # the losses as log lines, for logs without a bar
        parser.add_lightning_class_args(DownstreamEval, "eval")  # harness tasks in the loop
        parser.add_class_arguments(ClusterConfig, "cluster")

    def before_instantiate_classes(self) -> None:
        # Which checkpoint to load, whether this fit starts a branch, what to record: decided once, here
        # (training/checkpointing/plan.py); the hooks below only apply the plan.
        config = self.config[self.subcommand]
        cli_checks.check_trainer(self.subcommand, config.trainer, config.optim, warn=is_first_rank())
        check_name(config.name, config.runs_dir)
        root = config.trainer.default_root_dir
        if is_first_rank():  # one writer per run directory (training/run/lock.py), before anything reads it
            self.lock = acquire(root, f"normlab {self.subcommand}")
        self.plan = plan(self.subcommand, config.ckpt_path, config.branch_from, root)
        # (The first rank only: the others may start after it wrote its own config.yaml.)
        if self.subcommand == "fit" and config.ckpt_path is None and is_first_rank():
            resume.check_no_logged_run(root)
        # The recorded config (config.yaml, and per checkpoint) is what reruns this run: a resume records the
        # checkpoint it resolved, a branch its --branch_from with the --ckpt_path given (not its parent's path).
        config.ckpt_path = self.plan.recorded_ckpt_path
        self._init_source = None if config.init_from is None else \
            init_from.prepare(self.subcommand, config, self._subcommand_defaults())
        if config.trainer.precision is None:
            config.trainer.precision = default_precision(config.trainer.accelerator)
        config.trainer.strategy = resolve_strategy(config.trainer.strategy, config.trainer.devices,
                                                   config.trainer.num_nodes)

    def instantiate_classes(self) -> None:
        # A value refused by a constructor (ModelConfig, OptimConfig, the datamodule, a callback, the Trainer) is
        # bad input: report it as such (one line, see training/errors.py), not as a crash.
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            if is_user_error(err):
                raise
            raise UserError(f"{err} (fix it on the command line or in the -c config file; `normlab "
                            f"{self.subcommand} --help` lists the options)") from err
        self.config_init[self.subcommand].ckpt_path = self.plan.load_path  # what `fit | validate | test` loads

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand].trainer
        cluster_config = self.config_init[self.subcommand].cluster
        kwargs["strategy"] = with_timeout(config.get("strategy"), cluster_config.timeout)
        extra = self.config_init[self.subcommand].loggers
        if extra and config.get("logger") not in (None, True):
            raise UserError(f"--loggers {' '.join(extra)} adds to the default TensorBoard logger, but "
                            "--trainer.logger replaces it: list every logger in --trainer.logger, or drop it")
        if config.get("logger") in (None, True):  # the default; False disables, a class replaces it
            kwargs["logger"] = run_loggers(config.default_root_dir, self.plan.purge_step, extra)
        trainer = super().instantiate_trainer(**kwargs)
        if extra:
            trainer.callbacks.append(RecordLoggerRuns())
        if not any(isinstance(c, ProgressBar) for c in config.get("callbacks") or []):  # none configured:
            trainer.callbacks[:] = [step_counting(c) for c in trainer.callbacks]  # Lightning's default bar
        trainer.callbacks[:] = with_norm_summary(trainer.callbacks, config.get("callbacks") or [])
        # The run's own callbacks, each built complete with what the plan decided, then every callback in the order
        # training/callbacks/order.py states.
        init = self._init_from()
        run = [RNGState(), StopOnSignal(cluster_config), self._step_checkpoint(trainer, init),
               CollectiveTimeout(cluster_config.timeout)]
        run += [branch.BranchSchedule(self.plan.parent.step)] if self.plan.parent is not None else []
        tau = getattr(self.config_init[self.subcommand].get("optim"), "qk_clip", None)
        run += [QKClip(tau)] if self.subcommand == "fit" and tau is not None else []  # optim.qk_clip
        trainer.callbacks[:] = arrange(trainer.callbacks + run + ([init] if init is not None else []))
        return trainer

    def _init_from(self) -> init_from.InitFrom | None:
        """A fresh fit's `--init_from` source, checked against the data (`LitLM.configure_model` finds it among the
        trainer's callbacks); None for a resume or branch, whose weights come from the checkpoint."""
        if self._init_source is None or self.plan.parent is not None or self.plan.load_path:
            return None
        init_from.check_tokenizer(self._init_source, self.datamodule.tokenizer_path,
                                  self.datamodule.meta["tokenizer_sha256"])
        return init_from.InitFrom(self._init_source)

    def _step_checkpoint(self, trainer: Trainer, init: init_from.InitFrom | None) -> StepCheckpoint:
        """The `checkpoint` group's StepCheckpoint with the checkpoint this run loads and what its manifests record:
        the resolved config (what the config saver writes to config.yaml, nulls too: a complete record; none
        when nothing is saved, as under fast_dev_run), the lineage, and the --init_from source (a resumed run's:
        the one its checkpoint recorded)."""
        saver = next((c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)), None)
        resolved = saver.parser.dump(saver.config, skip_unset=False) if saver is not None else None
        source = init.source.record() if init is not None else None
        if self.subcommand == "fit" and self.plan.parent is None and self.plan.load_path:
            ckpt_dir = layout.ckpt_dir_of(self.plan.load_path)
            if (ckpt_dir / layout.MANIFEST).is_file():
                source = Manifest.read(ckpt_dir).init_from
        options = self.config_init[self.subcommand].checkpoint.as_dict()
        return StepCheckpoint(**options, resume_from=self.plan.load_path,
                              record=RunRecord(resolved, self.plan.lineage, source))

    def _check_inputs(self) -> None:
        """Refuse a checkpoint of the wrong format and a data path with no prepared data now, before Lightning
        writes anything into the run directory (a failed start leaves no stray run behind)."""
        if self.plan.load_path:
            resume.check_format(self.plan.load_path, checkpoint_format(self.trainer.strategy))
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # (a user's own IO plugin is kept)
            # model.ckpt read weights-only, and written beside its destination (not staged in $TMPDIR)
            self.trainer.strategy.checkpoint_io = SafeCheckpointIO()
        if is_deepspeed(self.trainer.strategy) and not isinstance(self.trainer.strategy, DeepSpeed):
            raise UserError(f"--trainer.strategy {type(self.trainer.strategy).__name__}: normlab's checkpoints need "
                            "its own DeepSpeed strategy: use zero1, zero2 or zero3, or training.strategy.DeepSpeed "
                            "with --trainer.strategy.config FILE.json")
        if is_fsdp2(self.trainer.strategy) and not isinstance(self.trainer.strategy, FSDP2):
            raise UserError(f"--trainer.strategy {type(self.trainer.strategy).__name__}: normlab shards the model and "
                            "checkpoints it with its own FSDP2 strategy: use fsdp2, or training.fsdp2.FSDP2 with "
                            "--trainer.strategy.reshard_after_forward / .precision_policy")
        if is_deepspeed(self.trainer.strategy):
            # DeepSpeed's sample counters read the micro-batch size (it does not change the math). Lightning would
            # take it from the loader's batch_sampler, which normlab's loaders (whole batches) do not have; the
            # config is formatted at the strategy's setup, after this hook.
            self.trainer.strategy.config.setdefault("train_micro_batch_size_per_gpu", self.datamodule.batch_size)
        if Path(self.datamodule.path).resolve() != Path(DEFAULT_OUTPUT).resolve():  # (that one is built on use)
            # A DataError naming the path (no prepared data: the `normlab prepare` command; a short or missing
            # split: the damage) — before the logger writes the run directory.
            self.datamodule.check_directories()

    def _check_checkpoint(self) -> None:
        """`validate | test`: the checkpoint is checked as a resume's is (fit: `StepCheckpoint.setup`) — every file
        against its manifest (sizes, sha256), the model config and tokenizer, no pickled code — before any of it
        is read."""
        self._check_inputs()
        ckpt_dir = layout.ckpt_dir_of(self.plan.load_path) if self.plan.load_path else None
        if ckpt_dir is not None and (ckpt_dir / layout.MANIFEST).is_file():
            resume.check_settings(ckpt_dir, self.model.config.to_dict(), self.datamodule.tokenizer_path,
                                  action=self.subcommand)
            resume.refuse_code(ckpt_dir)
        start_wandb(self.trainer.loggers)
        self.startup.release()  # every check passed: the start-up report (seed, accelerators) is the run's

    before_validate = before_test = _check_checkpoint

    def _check_branch(self, parent: branch.Parent) -> None:
        """The resume checks against a branch's parent: one error line, before anything is written."""
        manifest = resume.check_settings(parent.ckpt_dir, self.model.config.to_dict(), self.datamodule.tokenizer_path,
                                         action="branch from")
        if 0 < self.trainer.max_steps <= parent.step:  # before any file of the parent is unpickled
            raise UserError(f"--trainer.max_steps {self.trainer.max_steps}: the branch starts at the parent's step "
                            f"{parent.step}; give a larger max_steps (the step to end at)")
        resume.check_loadable(parent.ckpt_dir, manifest, self.trainer)

    def before_fit(self) -> None:
        self._check_inputs()
        if self.plan.load_path and isinstance(self.trainer.strategy, DeepSpeed):  # before the engine is built
            self.trainer.strategy.resume_from(self.plan.load_path)  # (another world size: the universal format)
        if self.plan.parent is not None:
            self._check_branch(self.plan.parent)
        elif self.plan.load_path and (layout.ckpt_dir_of(self.plan.load_path) / layout.MANIFEST).is_file():
            # a resume continues the schedule its checkpoint recorded (optim/continuation.py; a branch has its own)
            ckpt_dir = layout.ckpt_dir_of(self.plan.load_path)
            self.model.resumed_schedule, self.model.resumed_from = Manifest.read(ckpt_dir).schedule, str(ckpt_dir)
        for callback in self.trainer.callbacks:
            if isinstance(callback, DownstreamEval):
                callback.load_tasks()  # an unknown task: one line, before the logger writes the run directory
        if is_first_rank():
            log_world_line(self.trainer, self.datamodule)  # several processes: the global batch they make
        start_wandb(self.trainer.loggers)  # last: every check above passed
        if is_first_rank():
            log_data_entropy(self.trainer, self.datamodule)  # the run's plateau, for a sweep's outcome labels
        self.startup.release()  # the start-up report (seed, accelerators) is the run's now

    def after_fit(self) -> None:
        log_closing_lines(self.trainer, Path(self.trainer.default_root_dir) / layout.CONFIG_FILE)
        for callback in self.trainer.callbacks:
            if isinstance(callback, StopOnSignal):
                callback.requeue_if_warned(self.trainer)  # last: a requeue ends the job at once
