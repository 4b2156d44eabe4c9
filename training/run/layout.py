"""The run directory's format: the name of every file normlab writes into a run, and which checkpoints are complete.

    runs/<name>/
      config.yaml                   the resolved config of the latest start (rewritten by every fit, validate, test)
      events.out.tfevents.*         TensorBoard events (training/loggers.py): the run's scalars
      checkpoints/step-XXXXXXXX/    one checkpoint, a directory whatever the strategy: DeepSpeed's own sharded
                                    directory (each rank writes its shards), FSDP2's DCP shards (`.metadata`,
                                    `__<rank>_0.distcp`, `meta.pt`), or Lightning's single file `model.ckpt`;
                                    beside the weights `config.yaml` (the resolved CLI config), `model_config.json`
                                    (the exact `ModelConfig`) and `manifest.json` (manifest.py), written last
      checkpoints/incomplete/       interrupted saves, moved aside at the next fit (never deleted)
      eval/<set>/step-XXXXXXXX.json `normlab evaluate` results, one file per step; eval/<set>.csv rebuilt from them
      spikes/step-XXXXXXXX/         the guard's spike dumps (training/callbacks/spikes.py)
      loggers.json                  the W&B and MLflow run ids a restart continues (training/loggers.py)
      requeues.json                 the Slurm requeues of the run (training/cluster/requeue.py)
      sweep-run.json                the last attempt of `normlab sweep` (training/sweep/launch.py): command, outcome
      fit.log                       a sweep run's log (every attempt's output, appended)
      .lock                         held by the one process writing the run (lock.py)
    runs/<sweep>/sweep.json         a sweep's runs and their state (training/sweep/state.py); a run listed there
                                    is a run of that sweep (membership.py)

A checkpoint directory is complete exactly when it has a manifest: `last` considers only complete directories.
Nothing here reads a file's contents (`RunDir`, dir.py, does, with one error behaviour) or writes one. Saving:
training/checkpointing/save.py; what a resume checks: training/checkpointing/resume.py.
"""
from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
EVENTS_GLOB = "events.out.tfevents.*"
CHECKPOINTS_DIR = "checkpoints"
INCOMPLETE_DIR = "incomplete"  # inside checkpoints/: interrupted saves, moved aside at the next fit
MODEL_CONFIG_FILE = "model_config.json"
MANIFEST = "manifest.json"
LIGHTNING_FILE = "model.ckpt"  # the checkpoint file inside the directory when not under DeepSpeed
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under (named by the `latest` file)
DCP_METADATA = ".metadata"  # a DCP directory's index of its shards (FSDP2, training/checkpointing/dcp.py)
DCP_META_FILE = "meta.pt"  # beside FSDP2's DCP shards: the rest of Lightning's checkpoint (loops, callbacks, RNG)
UNIVERSAL_TAG = "checkpoint_universal"  # DeepSpeed's universal-format cache in a step directory (universal.py)
UNIVERSAL_LATEST = "latest_universal"  # its pointer file, beside it
UNIVERSAL_MANIFEST = "universal_manifest.json"  # the cache's own manifest (written after the step's)
TMP_PREFIX = ".tmp-"  # a directory being written (a save, a spike dump), renamed when complete
EVAL_DIR = "eval"
SPIKES_DIR = "spikes"
LOGGERS_FILE = "loggers.json"  # {"wandb": {"id": ...}, "mlflow": {"run_id": ...}}
REQUEUES_FILE = "requeues.json"  # [{job, restart, step, reason, time}, ...]
RUN_RECORD = "sweep-run.json"
LOG_FILE = "fit.log"
LOCK_FILE = ".lock"
SWEEP_STATE_FILE = "sweep.json"  # in a sweep's directory, above its runs
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def step_of_name(name: str) -> int | None:
    """The step of a directory name `step-XXXXXXXX` (a checkpoint, a spike dump); None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def step_of(ckpt_dir: str | Path) -> int:
    """The step of a checkpoint directory `step-XXXXXXXX`."""
    return int(_STEP_DIR.match(Path(ckpt_dir).name).group(1))


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint directories (with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=step_of)


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Interrupted saves: temporary directories, and step directories without a manifest."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(TMP_PREFIX) or (_STEP_DIR.match(p.name) and not (p / MANIFEST).is_file())))


def ckpt_dir_of(load_path: str | Path) -> Path:
    """The step directory of what `Trainer.fit` was given (manifest.load_path's inverse)."""
    path = Path(load_path)
    return path if path.is_dir() else path.parent
