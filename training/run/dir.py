"""`RunDir`: a run directory (`runs/<name>/`) and every file normlab writes into it, read through one owner.

The files and their names: layout.py. One error behaviour for every reader: a file that is there but cannot be
read is one `RunDirError` naming it and the fix; a file that is absent reads as "not there" (None or empty) where
it is optional, and is the same one-line error where the caller needs it. Nothing here writes.

A run is **finished** when its newest complete checkpoint has reached the `trainer.max_steps` that checkpoint was
trained towards (its own config.yaml, written atomically with it: the run's top-level config.yaml is rewritten at
every start, by `validate` and `test` too), or when its last sweep attempt exited having finished. `status()` is
the one definition the sweep (`--status`, the report) and `normlab compare` share.
"""
from __future__ import annotations

import json
import math
import shlex
import socket
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from training import safe_yaml
from training.errors import CheckpointError
from training.run.layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EVAL_DIR,
    EVENTS_GLOB,
    LOGGERS_FILE,
    MANIFEST,
    MODEL_CONFIG_FILE,
    REQUEUES_FILE,
    RUN_RECORD,
    complete_checkpoints,
    step_dirname,
)
from training.run.manifest import Manifest
from training.run.membership import SweepRun, sweep_run_of

STATUSES = ("pending", "running", "finished", "diverged", "failed")
Points = list[tuple[int, float]]


class RunDirError(CheckpointError):
    """A file of a run (or checkpoint) directory that is needed and missing, or there and unreadable; the
    message names the file and the fix. (A user error to every command, and a CheckpointError to the loaders.)"""


def read_yaml(path: Path, fix: str, required: bool = False) -> dict[str, Any]:
    """A YAML mapping file ({} when absent and not `required`), or one RunDirError naming it and `fix`."""
    return _read(path, fix, required, lambda text: safe_yaml.load(text, path.name))


def read_json(path: Path, fix: str, required: bool = False, kind: type = dict) -> Any:
    """A JSON file holding a `kind` (a mapping, or a list) — empty when absent and not `required` — or one
    RunDirError naming it and `fix`."""
    return _read(path, fix, required, json.loads, kind)



def _read(path: Path, fix: str, required: bool, parse: Callable[[str], Any], kind: type = dict) -> Any:
    if not path.is_file():
        if required:
            raise RunDirError(f"'{path}' is missing; {fix}")
        return kind()
    try:
        data = parse(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:  # JSONDecodeError is a ValueError
        raise RunDirError(f"'{path}' cannot be read ({type(err).__name__}: {err}); {fix}") from err
    if data is None:
        return kind()
    if not isinstance(data, kind):
        raise RunDirError(f"'{path}' holds a {type(data).__name__}, not a {'mapping' if kind is dict else 'list'}; "
                          f"{fix}")
    return data


_CHECKPOINT_FIX = "the checkpoint was altered after it was saved: use another one"


def step_config(ckpt_dir: Path) -> dict[str, Any]:
    """The resolved config saved beside a checkpoint ({} when it has none: a file not written by `normlab fit`)."""
    return read_yaml(Path(ckpt_dir) / CONFIG_FILE, _CHECKPOINT_FIX)


def model_config(where: Path, fix: str = _CHECKPOINT_FIX) -> dict[str, Any]:
    """The exact `ModelConfig` fields saved in `where` (a checkpoint directory, or the directory of a state-dict
    file), which every loader needs."""
    return read_json(Path(where) / MODEL_CONFIG_FILE, fix, required=True)


def data_path(config: dict[str, Any]) -> Path | None:
    """The data directory of a resolved config (of a mixture, its first source: all share one tokenizer)."""
    path = (config.get("data") or {}).get("path")
    path = next(iter(path), None) if isinstance(path, dict) else path
    return Path(path) if path else None


def tokenizer_of(config: dict[str, Any]) -> Path | None:
    """The tokenizer a resolved config's data was prepared with (None when the data directory is gone)."""
    from data.layout import read_meta

    directory = data_path(config)
    meta = read_meta(directory) if directory is not None else None
    return directory / meta["tokenizer_path"] if meta and meta.get("tokenizer_path") else None


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted.key: value}."""
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: config}


class RunDir:
    """One run directory. Each file is read when first asked for and kept (a `RunDir` is a snapshot: make a new
    one to see later writes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @classmethod
    def of_checkpoint(cls, ckpt_dir: str | Path) -> RunDir | None:
        """The run a step directory (`<run>/checkpoints/step-XXXXXXXX`) belongs to; None for one outside a run."""
        ckpt_dir = Path(ckpt_dir)
        return cls(ckpt_dir.parent.parent) if ckpt_dir.parent.name == CHECKPOINTS_DIR else None

    # -- what is there ------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def has_events(self) -> bool:
        return any(self.path.glob(EVENTS_GLOB))

    def is_run(self) -> bool:
        """Whether this is a run directory (holding `checkpoints/` or a resolved config), not a checkpoint."""
        return self.path.is_dir() and not (self.path / MANIFEST).is_file() and (
            (self.path / CHECKPOINTS_DIR).is_dir() or self.config_file.is_file())

    def require_logged(self) -> RunDir:
        """This run, if it has what a reader of its numbers needs (its config and TensorBoard events)."""
        if not self.config_file.is_file() or not self.has_events:
            raise RunDirError(f"'{self.path}' is not a normlab run (no config.yaml and TensorBoard events); pass run "
                              "directories such as runs/NAME")
        return self

    # -- config and checkpoints ---------------------------------------------------------------------------------
    @cached_property
    def config(self) -> dict[str, Any]:
        """The resolved config of the latest start ({} before the first)."""
        return read_yaml(self.config_file, "it is rewritten by the next `normlab fit` of this run; or restore it "
                         "from a checkpoint's config.yaml")

    @cached_property
    def flat_config(self) -> dict[str, Any]:
        return flatten(self.config)

    @cached_property
    def resolved_config(self) -> dict[str, Any]:
        """`flat_config` with `model.<field>` as the model was built: the newest checkpoint's `model_config.json`,
        else the preset's values under the config's own (a field left None is the preset's: `pre`, not None)."""
        from model import ModelConfig

        flat = dict(self.flat_config)
        try:
            fields = model_config(self.newest) if self.newest is not None else None
        except RunDirError:
            fields = None
        if fields is None:
            given = {k[6:]: v for k, v in flat.items()
                     if k.startswith("model.") and k[6:] in ModelConfig.__dataclass_fields__ and v is not None}
            try:
                fields = ModelConfig.preset(flat.get("model.preset") or "llama", **given).to_dict()
            except (ValueError, TypeError):  # a config this model cannot build: show it as written
                return flat
        return {**flat, **{f"model.{k}": v for k, v in fields.items()}}

    def checkpoints(self) -> list[Path]:
        """The complete checkpoint directories, oldest first."""
        return complete_checkpoints(self.path)

    @cached_property
    def newest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    @cached_property
    def manifest(self) -> Manifest | None:
        """The newest complete checkpoint's manifest (None without a checkpoint)."""
        return Manifest.read(self.newest) if self.newest is not None else None

    def progress(self) -> tuple[int, int | None]:
        """(the newest complete checkpoint's step or 0, the trainer.max_steps that checkpoint trained towards)."""
        if self.manifest is None:
            return 0, None
        max_steps = (step_config(self.newest).get("trainer") or {}).get("max_steps")
        return self.manifest.step, max_steps if isinstance(max_steps, int) else None

    def tokens_per_step(self) -> float:
        """Tokens one optimizer step trains on: from the newest manifest, else from the config."""
        manifest, config = self.manifest, self.flat_config
        if manifest and manifest.tokens_seen and manifest.step:
            return manifest.tokens_seen / manifest.step
        devices = config.get("trainer.devices")
        world = (devices if isinstance(devices, int) else 1) * (config.get("trainer.num_nodes") or 1)
        return float(config.get("data.batch_size") or 0) * (config.get("data.seq_len") or 0) * world * (
            config.get("trainer.accumulate_grad_batches") or 1)

    # -- logged numbers -----------------------------------------------------------------------------------------
    @cached_property
    def scalars(self) -> dict[str, Points]:
        """Every scalar tag of the TensorBoard events as [(step, value)] in step order; a step logged twice (a
        resume after a crash) keeps its newest value. {} without events."""
        if not self.has_events:
            return {}
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(self.path), size_guidance={"scalars": 0})
        try:
            acc.Reload()
        except Exception as err:  # (TensorBoard raises its own error types for a damaged file)
            raise RunDirError(f"'{self.path}': its TensorBoard events cannot be read ({type(err).__name__}: {err}); "
                              f"move the damaged {EVENTS_GLOB} file out of the run directory") from err
        return {tag: sorted({e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}.items())
                for tag in acc.Tags()["scalars"]}

    def last(self, tag: str) -> float | None:
        """The value of `tag` at the last step it was logged (None if never)."""
        points = self.scalars.get(tag)
        return float(points[-1][1]) if points else None

    # -- sweep record and membership, logger runs, requeues, evaluation results ---------------------------------
    @cached_property
    def record(self) -> dict[str, Any] | None:
        """What `normlab sweep` recorded of the run's last attempt (None for a run it did not start)."""
        record = read_json(self.path / RUN_RECORD, "delete it: the next `normlab sweep` rewrites it")
        return record or None

    @cached_property
    def sweep(self) -> SweepRun | None:
        """The run's place in the sweep whose sweep.json (a directory above) lists it; None for a run of no sweep."""
        return sweep_run_of(self.path)

    @cached_property
    def logger_runs(self) -> dict[str, Any]:
        """The W&B and MLflow runs a restart continues ({} before any was recorded; training/loggers.py)."""
        return read_json(self.path / LOGGERS_FILE, "delete it: the next fit starts new W&B / MLflow runs and "
                         "records them")

    @cached_property
    def requeues(self) -> list[dict[str, Any]]:
        """The Slurm requeues of this run, oldest first ([] before any; training/cluster/requeue.py)."""
        return read_json(self.path / REQUEUES_FILE, "delete it: it only bounds the requeues of a run that makes no "
                         "progress (cluster.max_requeues)", kind=list)

    @property
    def eval_dir(self) -> Path:
        return self.path / EVAL_DIR

    def eval_file(self, name: str, step: int) -> Path:
        """Where `normlab evaluate` keeps the results of set (or harness) `name` at `step`."""
        return self.eval_dir / name / f"{step_dirname(step)}.json"

    def eval_csv(self, name: str) -> Path:
        return self.eval_dir / f"{name}.csv"

    def eval_results(self, name: str) -> list[dict[str, Any]]:
        """Every step file of `name`, in step order."""
        fix = (f"delete it and run `normlab evaluate --checkpoint {shlex.quote(str(self.path))}` again to rescore "
               "that step")
        return [read_json(p, fix) for p in sorted((self.eval_dir / name).glob("step-*.json"))]

    # -- finished? ----------------------------------------------------------------------------------------------
    def reached_max_steps(self) -> bool | None:
        """Whether the newest checkpoint reached the max_steps it trained towards; None when unknown (no
        checkpoint, or no positive max_steps: a run bounded by epochs)."""
        step, max_steps = self.progress()
        return None if not self.manifest or not max_steps or max_steps <= 0 else step >= max_steps

    def finished(self) -> bool:
        """See the module docstring: the newest checkpoint reached its own max_steps, or the sweep says so."""
        return bool(self.reached_max_steps()) or (self.record or {}).get("status") == "finished"

    def status(self, alive: Callable[[dict[str, Any]], bool] | None = None, nonfinite: Iterable[str] = ()) -> str:
        """One of STATUSES: `finished` (see `finished`); `diverged` / `failed` as the last sweep attempt ended, or
        `diverged` when a tag of `nonfinite` was logged non-finite (pass tags only where the scalars are read
        anyway); `running` while the recorded attempt is `alive` (unchecked without `alive`); else `pending`
        (never started, or interrupted)."""
        outcome = (self.record or {}).get("status")
        reached = bool(self.reached_max_steps())
        if outcome == "running":
            # Unchecked without `alive`, until the newest checkpoint is the last. With it: a live attempt on this
            # host is running also past its last checkpoint (while it validates and exits); one elsewhere only until
            # that checkpoint (squeue, its evidence there, may be missing).
            if alive is None:
                if not reached:
                    return "running"
            elif (not reached or self.record.get("host") == socket.gethostname()) and alive(self.record):
                return "running"
        if reached or outcome == "finished":
            return "finished"
        if outcome in ("diverged", "failed"):
            return outcome
        if any(not math.isfinite(v) for tag in nonfinite for _, v in self.scalars.get(tag, [])):
            return "diverged"
        return "pending"
