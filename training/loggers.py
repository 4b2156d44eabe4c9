"""The logging seam: which loggers a run writes to, and the one way normlab code hands them metrics.

TensorBoard is the default and always first: its events live directly in the run directory (`compare`, the test
helpers and the offline `evaluate` results read them there), and it alone takes the dashboards the health
metrics draw (custom-scalar charts, the depth-profile image, gain histograms). `--loggers "[csv, wandb, mlflow]"`
(a list, as one value) adds Lightning's own loggers beside it, each writing under the run directory:

- `csv`: `CSVLogger`, `<run>/csv/version_N/metrics.csv`; a resumed run starts a new `version_N` (Lightning's
  CSV writer cannot append to an earlier file).
- `wandb`: `WandbLogger`, `<run>/wandb/` (`WANDB_MODE=offline`, `WANDB_PROJECT` as usual); a resumed run continues
  the same W&B run: its id is kept in `<run>/loggers.json`.
- `mlflow`: `MLFlowLogger`, at `MLFLOW_TRACKING_URI` (a server or database: MLflow's recommendation), else the
  file store `<run>/mlruns` (experiment `MLFLOW_EXPERIMENT_NAME`, default `normlab`); a resumed run continues
  the same MLflow run (id in `<run>/loggers.json`).
Only TensorBoard drops what a crashed run logged after its last checkpoint (`purge_step`); the others keep those
points, so a resumed curve there can show a step twice.

A run of a sweep (its directory is listed in a `sweep.json` above it: training/run/membership.py) reads as one
experiment in each tracker:
- TensorBoard: its cell's parameters and seed as an HParams session (the `hparams` plugin's experiment and session
  summaries, with every value each axis takes as its domain), the sweep's metric and `train/loss` as its metric
  columns — whose values are the run's own last scalars — so `tensorboard --logdir runs/<sweep>` shows the sweep
  as a table and in parallel coordinates;
- W&B: `group` the sweep's name, run name `<cell>/s<seed>`, the axes as tags and config;
- MLflow: one experiment per sweep (named after it, in one file store `runs/<sweep>/mlruns` unless
  `MLFLOW_TRACKING_URI` says where), run name `<cell>/s<seed>`, tagged with `sweep`, `cell`, `seed` and each axis.

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
from lightning.pytorch.utilities import rank_zero_only

from data.atomic import write_text_atomic
from training.compat import require
from training.errors import UserError
from training.run.dir import RunDir
from training.run.layout import LOGGERS_FILE
from training.run.lock import locked
from training.run.membership import SweepRun, format_value

LOGGERS = ("csv", "wandb", "mlflow")  # `--loggers` choices, beside TensorBoard


def run_logger(run_dir: str | Path, purge_step: int | None, sweep: SweepRun | None = None) -> TensorBoardLogger:
    """TensorBoard events directly in the run directory (a fixed version, so a resumed run appends to the same
    run). `purge_step`: TensorBoard discards events at or after this step written before the restart — the
    points a crashed run logged after its last checkpoint — so resumed curves have no stale duplicates. A run of
    `sweep` also writes its HParams session."""
    path = Path(run_dir)
    kwargs = {"save_dir": str(path.parent), "name": path.name, "version": "", "default_hp_metric": False,
              "purge_step": purge_step}
    return SweepTensorBoardLogger(sweep, **kwargs) if sweep is not None else TensorBoardLogger(**kwargs)


class SweepTensorBoardLogger(TensorBoardLogger):
    """TensorBoard for a run of a sweep: when Lightning logs the run's hyperparameters (at every start), the
    HParams plugin's experiment (the axes with their domains, the metric columns) and this session (the cell's
    values and the seed); at a successful end, the session's end. The metric columns' values are the run's own
    scalars (the dashboard shows each tag's last value): nothing is logged twice."""

    def __init__(self, sweep: SweepRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sweep = sweep
        self._session_open = False  # the HParams session start is written (its end follows on success)

    def _summaries(self) -> tuple[Any, Any, Any]:
        from torch.utils.tensorboard.summary import hparams

        values = {**self.sweep.params, "seed": self.sweep.seed}
        domains = {**self.sweep.domains}
        for key, value in values.items():  # TensorBoard takes bool, number or string, one type per axis
            if not all(isinstance(v, (bool, int, float, str)) and type(v) is type(value) for v in domains[key]):
                values[key], domains[key] = format_value(value), [format_value(v) for v in domains[key]]
        metrics = dict.fromkeys([self.sweep.metric, "train/loss"], 0.0)  # (only the tags are written)
        return hparams(values, metrics, hparam_domain_discrete=domains)

    @rank_zero_only
    def log_hyperparams(self, params: Any, metrics: Any = None, step: int | None = None) -> None:
        super().log_hyperparams(params, metrics, step)
        experiment, session_start, _ = self._summaries()
        require("torch.utils.tensorboard.writer:SummaryWriter._get_file_writer")
        writer = self.experiment._get_file_writer()  # as TensorBoardLogger.log_hyperparams writes its own
        writer.add_summary(experiment)
        writer.add_summary(session_start)
        self._session_open = True

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "success" and self._session_open:
            self.experiment._get_file_writer().add_summary(self._summaries()[2])
        super().finalize(status)


def run_loggers(run_dir: str | Path, purge_step: int | None, extra: list[str]) -> list[Logger]:
    """TensorBoard, then the `extra` loggers (`LOGGERS` names) of the run at `run_dir`, continuing the logger runs
    that `<run>/loggers.json` recorded (a resume, a restart of the same `--name`)."""
    unknown = [name for name in extra if name not in LOGGERS]
    if unknown:
        raise UserError(f"--loggers {' '.join(extra)}: unknown logger {unknown[0]!r}; choose from "
                        f"{', '.join(LOGGERS)} (TensorBoard is always on)")
    path = Path(run_dir)
    run = RunDir(path)
    runs, sweep = run.logger_runs, run.sweep
    loggers: list[Logger] = [run_logger(path, purge_step, sweep)]
    for name in dict.fromkeys(extra):  # (each once, in the order given)
        if name == "csv":
            loggers.append(CSVLogger(save_dir=str(path), name="csv"))
        elif name == "wandb":
            # Our own id, known before W&B starts, so every rank and every restart names the same run.
            run_id = runs.get("wandb", {}).get("id") or secrets.token_hex(4)
            grouping = {} if sweep is None else {
                "name": sweep.title, "group": sweep.sweep,
                "tags": [f"{k}={format_value(v)}" for k, v in sweep.params.items()],
                "config": {"sweep": sweep.sweep, "cell": sweep.cell, "seed": sweep.seed, **sweep.params}}
            loggers.append(WandbLogger(**{"name": path.name, **grouping}, save_dir=str(path), id=run_id,
                                       resume="allow"))
        else:
            loggers.append(mlflow_logger(path, runs.get("mlflow", {}).get("run_id"), sweep))
    return loggers


def mlflow_logger(run_dir: Path, run_id: str | None, sweep: SweepRun | None) -> MLFlowLogger:
    """The run's MLflow logger: at `MLFLOW_TRACKING_URI`, else a file store — the sweep's (`<sweep>/mlruns`, one
    experiment named after the sweep) or the run's own (`<run>/mlruns`, experiment `MLFLOW_EXPERIMENT_NAME`,
    default `normlab`)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        # A file store needs no server or database driver (mlflow-skinny has none); MLflow 3 keeps it in
        # maintenance mode and asks for this opt-in.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (sweep.sweep_dir if sweep is not None else run_dir) / "mlruns"
    if sweep is None:
        return MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "normlab"), run_name=run_dir.name,
                            save_dir=str(store), run_id=run_id, tracking_uri=uri)
    from mlflow.tracking import MlflowClient

    # The sweep's runs start side by side: one creates the experiment, the others find it (MLflow refuses a
    # second experiment of the same name).
    with locked(sweep.sweep_dir / ".mlflow.lock"):
        client = MlflowClient(uri or f"file:{store}")  # (the URI MLFlowLogger makes of save_dir)
        if client.get_experiment_by_name(sweep.sweep) is None:
            client.create_experiment(sweep.sweep)
    tags = {"sweep": sweep.sweep, "cell": sweep.cell, "seed": str(sweep.seed),
            **{k: format_value(v) for k, v in sweep.params.items()}}
    return MLFlowLogger(experiment_name=sweep.sweep, run_name=sweep.title, save_dir=str(store), run_id=run_id,
                        tags=tags, tracking_uri=uri)


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
        if runs and runs != RunDir(run_dir).logger_runs:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / LOGGERS_FILE, json.dumps(runs, indent=2) + "\n")


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


def logs_this_update(trainer: Any, global_step: int) -> bool:
    """Whether Lightning's logger writes the metrics of the update that ends the current micro-batch (its rule:
    every `log_every_n_steps` updates, and when the fit is stopping), as seen from inside that update."""
    every = trainer.log_every_n_steps
    return every > 0 and ((global_step + 1) % every == 0 or trainer.should_stop)
