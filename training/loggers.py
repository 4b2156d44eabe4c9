"""The logging seam: which loggers a run writes to, and the one way normlab code hands them metrics.

TensorBoard is the default and always first: its events live directly in the run directory (`compare`, the test
helpers and the offline `evaluate` results read them there), and it alone takes the dashboards the health
metrics draw (custom-scalar charts, the depth-profile image, gain histograms). `--loggers csv wandb mlflow`
adds Lightning's own loggers beside it, each writing under the run directory:

- `csv`: `CSVLogger`, `<run>/csv/version_N/metrics.csv`; a resumed run starts a new `version_N` (Lightning's
  CSV writer cannot append to an earlier file).
- `wandb`: `WandbLogger`, `<run>/wandb/` (`WANDB_MODE=offline`, `WANDB_PROJECT` as usual); a resumed run continues
  the same W&B run: its id is kept in `<run>/loggers.json`.
- `mlflow`: `MLFlowLogger`, at `MLFLOW_TRACKING_URI` (a server or database: MLflow's recommendation), else the
  file store `<run>/mlruns` (experiment `MLFLOW_EXPERIMENT_NAME`, default `normlab`); a resumed run continues
  the same MLflow run (id in `<run>/loggers.json`).
Only TensorBoard drops what a crashed run logged after its last checkpoint (`purge_step`); the others keep those
points, so a resumed curve there can show a step twice.

Every metric reaches every logger: `LitLM.log` through Lightning, the callbacks' own metrics through
`log_scalars` (never `trainer.logger`, which is only the first). Images and histograms go to `tensorboard()`.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from training.checkpointing.layout import write_text_atomic
from training.errors import UserError

LOGGERS = ("csv", "wandb", "mlflow")  # `--loggers` choices, beside TensorBoard
RUNS_FILE = "loggers.json"  # <run>/loggers.json: {"wandb": {"id": ...}, "mlflow": {"run_id": ...}}


def run_logger(run_dir: str | Path, purge_step: int | None) -> TensorBoardLogger:
    """TensorBoard events directly in the run directory (a fixed version, so a resumed run appends to the same
    run). `purge_step`: TensorBoard discards events at or after this step written before the restart — the
    points a crashed run logged after its last checkpoint — so resumed curves have no stale duplicates."""
    path = Path(run_dir)
    return TensorBoardLogger(save_dir=str(path.parent), name=path.name, version="", default_hp_metric=False,
                             purge_step=purge_step)


def run_loggers(run_dir: str | Path, purge_step: int | None, extra: list[str]) -> list[Logger]:
    """TensorBoard, then the `extra` loggers (`LOGGERS` names) of the run at `run_dir`, continuing the logger runs
    that `<run>/loggers.json` recorded (a resume, a restart of the same `--name`)."""
    unknown = [name for name in extra if name not in LOGGERS]
    if unknown:
        raise UserError(f"--loggers {' '.join(extra)}: unknown logger {unknown[0]!r}; choose from "
                        f"{', '.join(LOGGERS)} (TensorBoard is always on)")
    path = Path(run_dir)
    runs = read_runs(path)
    loggers: list[Logger] = [run_logger(path, purge_step)]
    for name in dict.fromkeys(extra):  # (each once, in the order given)
        if name == "csv":
            loggers.append(CSVLogger(save_dir=str(path), name="csv"))
        elif name == "wandb":
            # Our own id, known before W&B starts, so every rank and every restart names the same run.
            run_id = runs.get("wandb", {}).get("id") or secrets.token_hex(4)
            loggers.append(WandbLogger(name=path.name, save_dir=str(path), id=run_id, resume="allow"))
        else:
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                # The file store in the run directory needs no server or database driver (mlflow-skinny has
                # none); MLflow 3 keeps it in maintenance mode and asks for this opt-in.
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            loggers.append(MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "normlab"),
                                        run_name=path.name, save_dir=str(path / "mlruns"),
                                        run_id=runs.get("mlflow", {}).get("run_id")))
    return loggers


def start_wandb(loggers: list[Logger]) -> None:
    """Start the W&B run now, once the command's input is checked and before the fit writes anything (Lightning
    would start it at the first log, after the run directory is written): no API key is one error line."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            from wandb.errors import UsageError

            try:
                _ = logger.experiment  # rank 0 starts the run; the other ranks get Lightning's stand-in
            except UsageError as err:
                raise UserError(f"--loggers wandb: {err} — or set WANDB_API_KEY, or WANDB_MODE=offline to log to "
                                "<run>/wandb/ only") from None


def read_runs(run_dir: Path) -> dict[str, Any]:
    """The logger runs recorded for `run_dir` ({} when none)."""
    path = run_dir / RUNS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


class RecordLoggerRuns(Callback):
    """Records the W&B and MLflow run ids in `<run>/loggers.json` (rank 0, at setup), for the next start."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trainer.is_global_zero or stage != "fit":
            return
        runs = {}
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                runs["wandb"] = {"id": logger.version}
            elif isinstance(logger, MLFlowLogger):
                runs["mlflow"] = {"run_id": logger.run_id, "experiment_id": logger.experiment_id}
        run_dir = Path(trainer.default_root_dir)
        if runs and runs != read_runs(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / RUNS_FILE, json.dumps(runs, indent=2) + "\n")


def log_scalars(trainer: Trainer, values: dict[str, float], step: int) -> None:
    """`values` at `step` to every logger of the run (rank 0; the callbacks' metrics, outside `LitLM.log`)."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)


def tensorboard(trainer: Trainer) -> Any | None:
    """The run's TensorBoard `SummaryWriter` (rank 0), for what only TensorBoard shows: custom-scalar layouts,
    images, histograms. None on other ranks and when the run has no TensorBoard logger."""
    if not trainer.is_global_zero:
        return None
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def write_scalars(run_dir: str | Path, values: dict[str, float], step: int) -> None:
    """`values` at `step` into the TensorBoard events of a finished run (offline `normlab evaluate`)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir)) as writer:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
