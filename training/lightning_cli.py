"""NormlabCLI: LightningCLI wired to LitLM + TokenDataModule, with normlab's run directory conventions.

Config groups (all settable in YAML via `-c` and as dotted flags):
  model.*       LitLM: `preset` plus any ModelConfig field (`--model.placement post`)
  optim.*       OptimConfig: AdamW + LR schedule (`--optim.lr 3e-4`)
  data.*        TokenDataModule (`--data.path`, `--data.seq_len`, `--data.batch_size`)
  trainer.*     Lightning Trainer (`--trainer.max_steps`, `--trainer.devices`, `--trainer.strategy zero2`)
  checkpoint.*  StepCheckpoint (`--checkpoint.every_n_steps`, `--checkpoint.keep_last_n`)
  guard.*       NonFiniteGuard (`--guard.policy abort|skip`, `--guard.max_consecutive_skips`, spike dumps:
                `--guard.dump_spike_z`, `--guard.max_dumps`)
  throughput.*  Throughput (`--throughput.peak_tflops`)
  name, runs_dir, ckpt_path, branch_from, seed_everything

`--branch_from <run>/checkpoints/step-X` starts a new run (`--name`) from another run's checkpoint with its own
schedule: a cooldown branch (training/checkpointing/branch.py).

Defaults: configs/default.yaml (the default job), then `-c` files in order, then dotted flags.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from data.datamodule import TokenDataModule
from data.prepare import DEFAULT_OUTPUT
from training import compat
from training.callbacks import NonFiniteGuard, RNGState, StepCheckpoint, Throughput, TrainingHealth
from training.callbacks.progress import step_counting
from training.checkpointing import branch, layout, resume
from training.checkpointing.manifest import Manifest
from training.checkpointing.safe import SafeCheckpointIO, no_code_from_checkpoints
from training.cli import LIGHTNING_SUBCOMMANDS
from training.errors import UserError, is_user_error
from training.lit_module import lit_lm
from training.optim import OptimConfig
from training.strategy import default_precision, is_deepspeed  # also registers --trainer.strategy zeroN

# The default job: the defaults of `normlab fit | validate | test` are read from this file (the trainer settings,
# seed, data and model sizes), so the file is exactly what `normlab fit` with no arguments runs.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def run_dir(runs_dir: str, name: str) -> str:
    return str(Path(runs_dir) / name)


def run_logger(run_dir: str | Path, purge_step: int | None) -> TensorBoardLogger:
    """TensorBoard events directly in the run directory (a fixed version, so a resumed run appends to the same
    run). `purge_step`: TensorBoard discards events at or after this step written before the restart — the
    points a crashed run logged after its last checkpoint — so resumed curves have no stale duplicates."""
    path = Path(run_dir)
    return TensorBoardLogger(save_dir=str(path.parent), name=path.name, version="", default_hp_metric=False,
                             purge_step=purge_step)


class NormlabCLI(LightningCLI):
    """`normlab fit | validate | test`; `args` as on the command line (None: sys.argv)."""

    def __init__(self, args: list[str] | None = None) -> None:
        self._purge_step: int | None = None
        self._parent: branch.Parent | None = None  # --branch_from, when this fit starts a branch
        self._requested_ckpt_path: str | None = None
        super().__init__(
            lit_lm,
            TokenDataModule,
            save_config_kwargs={"overwrite": True},  # runs/<name>/config.yaml: rewritten on resume
            auto_configure_optimizers=False,  # LitLM.configure_optimizers builds groups + schedule
            # exit_on_error=False: a parse error is raised (argparse.ArgumentError) and `normlab` prints it as one
            # line (training/errors.py) instead of jsonargparse's usage text.
            parser_kwargs={"prog": "normlab", "description": "Train and evaluate normlab language models.",
                           "exit_on_error": False,
                           **{sub: {"default_config_files": [str(DEFAULT_CONFIG)]} for sub in LIGHTNING_SUBCOMMANDS}},
            args=args,
        )

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads a `--ckpt_path` file's hyper-parameters while parsing (weights-only, but a refused
        # file would be a traceback): the guard turns a refusal into normlab's one-line error.
        compat.require("lightning.pytorch.cli:LightningCLI._parse_ckpt_path")
        with no_code_from_checkpoints():
            super()._parse_ckpt_path()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--name", type=str, default="default",
                            help="Run name: events, config and checkpoints go to <runs_dir>/<name>/")
        parser.add_argument("--runs_dir", type=str, default="runs", help="Directory holding all runs")
        parser.add_argument("--branch_from", type=Optional[str], default=None,  # noqa: UP045 (jsonargparse reads it)
                            help="Start this (new) run from another run's checkpoint directory with this run's own "
                                 "LR schedule: weights, optimizer state, data position and step carried over "
                                 "(a cooldown branch); with --ckpt_path last, resume the branch once it has "
                                 "checkpoints")
        # The run directory is the trainer's default_root_dir, derived here and nowhere else.
        parser.link_arguments(("runs_dir", "name"), "trainer.default_root_dir", compute_fn=run_dir)
        parser.add_class_arguments(OptimConfig, "optim")
        parser.link_arguments("optim", "model.optim", apply_on="instantiate")
        # The data decides the model's defaults for its vocabulary and context (`model.vocab_size` /
        # `model.max_seq_len` still override them): read from the built datamodule, before the model is built.
        parser.link_arguments("data.vocab_size", "model.data_vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.data_seq_len", apply_on="instantiate")
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(TrainingHealth, "metrics")
        parser.add_lightning_class_args(NonFiniteGuard, "guard")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        root = config.trainer.default_root_dir
        requested = config.ckpt_path
        self._requested_ckpt_path, self._parent = requested, None
        if config.branch_from is not None:
            self._parent = self._resolve_branch(config, root)
        if self._parent is not None:  # a new run: from the parent's checkpoint, into a fresh run directory
            resume.check_fresh_run(root)
            config.ckpt_path, self._purge_step = self._parent.load_path, 0
        else:
            config.ckpt_path, resumed_step = layout.resolve(requested, root)
            if self.subcommand == "fit":
                if requested is None:
                    resume.check_fresh_run(root)
                # TensorBoard: drop what a crashed run logged after its checkpoint (steps > the checkpoint's, see
                # LitLM._log_eval for the step convention); everything on a fresh start.
                self._purge_step = resumed_step + 1 if resumed_step is not None else 0
        if config.trainer.precision is None:
            config.trainer.precision = default_precision(config.trainer.accelerator)

    def _resolve_branch(self, config: Any, root: str) -> branch.Parent | None:
        """`--branch_from`: the parent to branch from, or None when `--ckpt_path last` finds the branch's own
        checkpoints to resume (which must have branched from the same parent)."""
        if self.subcommand != "fit":
            raise UserError(f"--branch_from applies to `normlab fit` (a new run), not `normlab {self.subcommand}`: "
                            "give the checkpoint with --ckpt_path")
        if config.ckpt_path not in (None, "last"):
            raise UserError(f"--branch_from {config.branch_from} and --ckpt_path {config.ckpt_path}: give one of them "
                            "(--branch_from starts a new run from another run's checkpoint; add --ckpt_path last to "
                            "resume that branch once it has checkpoints)")
        own = layout.complete_checkpoints(root) if config.ckpt_path == "last" else []
        if own:
            branch.check_lineage(config.branch_from, Manifest.read(own[-1]), root)
            return None
        return branch.resolve_parent(config.branch_from)

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

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = compat.cli_trainer_config(self)
        if config.get("logger") in (None, True):  # the default; False disables, a class replaces it
            kwargs["logger"] = run_logger(config["default_root_dir"], self._purge_step)
        trainer = compat.cli_instantiate_trainer(self, {**config, **kwargs}, compat.cli_callbacks(self))
        if not any(isinstance(c, ProgressBar) for c in config.get("callbacks") or []):  # none configured:
            trainer.callbacks[:] = [step_counting(c) for c in trainer.callbacks]  # Lightning's default bar
        # First of all callbacks: every other callback's on_train_batch_start must see the restored RNG stream.
        trainer.callbacks.insert(0, RNGState())
        if self._parent is not None:
            trainer.callbacks.insert(1, branch.BranchSchedule(self._parent.step))
        return trainer

    def _check_inputs(self) -> None:
        """Refuse a checkpoint of the wrong format and a data path with no prepared data now, before Lightning
        writes anything into the run directory (a failed start leaves no stray run behind)."""
        ckpt_path = self.config[self.subcommand].ckpt_path
        if ckpt_path:
            resume.check_format(ckpt_path, is_deepspeed(self.trainer.strategy))
            if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # (a user's own IO plugin is kept)
                self.trainer.strategy.checkpoint_io = SafeCheckpointIO()  # reads model.ckpt weights-only
        if Path(self.datamodule.path).resolve() != Path(DEFAULT_OUTPUT).resolve():  # (that one is built on use)
            _ = self.datamodule.meta  # a DataError naming the path and the `normlab prepare` command

    before_validate = before_test = _check_inputs

    def _check_branch(self) -> dict[str, Any]:
        """The resume checks against the parent (one error line, before anything is written), and what this
        branch's manifests record about it."""
        resume.check_fits(self._parent.ckpt_dir, self.model.config.to_dict(),
                          self.datamodule.tokenizer_path, self.trainer, action="branch from")
        if 0 < self.trainer.max_steps <= self._parent.step:
            raise UserError(f"--trainer.max_steps {self.trainer.max_steps}: the branch starts at the parent's step "
                            f"{self._parent.step}; give a larger max_steps (the step to end at)")
        return self._parent.record()

    def before_fit(self) -> None:
        self._check_inputs()
        config = self.config[self.subcommand]
        load = config.ckpt_path  # what `fit` loads: the resolved --ckpt_path, or a branch's parent
        if self._parent is not None:
            lineage = self._check_branch()
            # The recorded config (config.yaml, here and per checkpoint) is what reruns this branch: --branch_from
            # with the --ckpt_path given, not the parent's path (`fit` itself gets that from config_init).
            config.ckpt_path = self._requested_ckpt_path
        elif load and (layout.ckpt_dir_of(load) / layout.MANIFEST).is_file():  # resumed: keep its record
            lineage = Manifest.read(layout.ckpt_dir_of(load)).branched_from
        else:
            lineage = None
        text = compat.cli_parser(self).dump(config, skip_unset=False)  # nulls too: a complete record
        for callback in self.trainer.callbacks:
            if isinstance(callback, StepCheckpoint):
                callback.resolved_config = text
                callback.resume_from = load  # checked against the run before anything loads
                callback.branched_from = lineage
