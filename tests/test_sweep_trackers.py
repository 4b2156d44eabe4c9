"""A sweep reads as one experiment in the trackers users already use (training/loggers.py): a real 2 cells ×
2 seeds sweep with `loggers: [wandb, mlflow]`, each read back by the tracker's own code —
- TensorBoard: its HParams plugin's handlers (what the dashboard's table and parallel-coordinates view show)
  over the sweep directory: one session per run with its axes' values and seed, the metric columns equal to the
  final metric the sweep reports;
- W&B: the offline run files (`group` = the sweep's name, run name `<cell>/s<seed>`);
- MLflow: the client on the sweep's one store (one experiment, runs tagged by cell).
W&B runs offline and MLflow on its file store, both real."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.multiproc import REPO
from tests.test_loggers import wandb_records

pytestmark = pytest.mark.slow

NAME = "trackers"
GRID = {"model.placement": ["pre", "post"], "optim.lr": [0.003]}


@pytest.fixture(scope="module")
def sweep(workdir: Path) -> dict:
    """The finished sweep: its directory and its sweep.json (which holds each run's final metric)."""
    shutil.copy(REPO / "tests" / "helpers" / "tiny.yaml", workdir / "tiny.yaml")
    spec = {"name": NAME, "runs_dir": str(workdir / "runs"),
            "base": {"config": [str(workdir / "tiny.yaml")],
                     "overrides": {"data.path": str(workdir / "tiny"), "trainer.max_steps": 2,
                                   "trainer.val_check_interval": 4, "checkpoint.every_n_steps": 2,
                                   "loggers": ["wandb", "mlflow"]}},
            "grid": GRID, "seeds": [0, 1]}
    (workdir / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-m", "training.cli", "sweep", str(workdir / "spec.yaml"),
                           "--max_parallel", "2"], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_dir = workdir / "runs" / NAME
    state = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["status"] for r in state["runs"]] == ["finished"] * 4 and all(r["metric"] for r in state["runs"])
    return {"dir": sweep_dir, "runs": {f"{r['cell']}/s{r['seed']}": r for r in state["runs"]}}


def hparams_dashboard(logdir: Path):
    """(experiment, session groups) as TensorBoard's HParams plugin computes them for its dashboard."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    tb = base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer,
                               data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(logdir)))
    hparams, request = backend_context.Context(tb), context.RequestContext()
    experiment = get_experiment.Handler(request, hparams, "", api_pb2.GetExperimentRequest()).run()
    statuses = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING]
    groups = list_session_groups.Handler(request, hparams, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=statuses)).run()
    return experiment, groups.session_groups


def test_tensorboard_hparams_shows_the_sweep_as_a_table(sweep):
    experiment, groups = hparams_dashboard(sweep["dir"])
    infos = {h.name: h for h in experiment.hparam_infos}
    assert sorted(infos) == sorted([*GRID, "seed"])
    assert [v.string_value for v in infos["model.placement"].domain_discrete.values] == ["pre", "post"]
    assert [m.name.tag for m in experiment.metric_infos] == ["val/loss", "train/loss"]
    assert sorted(g.name for g in groups) == sorted(sweep["runs"])  # one row per run, named <cell>/s<seed>
    for group in groups:
        run = sweep["runs"][group.name]
        assert group.hparams["model.placement"].string_value == run["params"]["model.placement"]
        assert group.hparams["optim.lr"].number_value == run["params"]["optim.lr"]
        assert group.hparams["seed"].number_value == run["seed"]
        metrics = {m.name.tag: m.value for m in group.metric_values}
        assert metrics["val/loss"] == pytest.approx(run["metric"], rel=1e-6)  # the final metric the report judges
        assert group.sessions[0].status == 1  # STATUS_SUCCESS: the run's end was written


def test_wandb_runs_share_the_sweeps_group_and_are_named_by_cell(sweep):
    for title, run in sweep["runs"].items():
        (run_file,) = (sweep["dir"] / run["run_dir"] / "wandb").glob("offline-run-*/run-*.wandb")
        (record,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
        assert record.run_group == NAME and record.display_name == title
        assert sorted(record.tags) == sorted(f"{k}={v}" for k, v in run["params"].items())
        config = {item.key: json.loads(item.value_json) for item in record.config.update}
        assert config["cell"] == run["cell"] and config["seed"] == run["seed"]


def test_mlflow_sweep_is_one_experiment_with_runs_tagged_by_cell(sweep, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (as normlab sets it for its file store)
    assert not list(sweep["dir"].glob("*/s*/mlruns"))  # no store per run
    client = MlflowClient(tracking_uri=f"file:{sweep['dir'] / 'mlruns'}")
    experiment = client.get_experiment_by_name(NAME)
    found = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in found) == sorted(sweep["runs"])
    for found_run in found:
        run = sweep["runs"][found_run.info.run_name]
        tags = found_run.data.tags
        assert (tags["sweep"], tags["cell"], tags["seed"]) == (NAME, run["cell"], str(run["seed"]))
        assert found_run.data.metrics["val/loss"] == pytest.approx(run["metric"], rel=1e-6)
    by_cell = client.search_runs([experiment.experiment_id], filter_string="tags.cell = 'placement=post,lr=0.003'")
    assert sorted(r.data.tags["seed"] for r in by_cell) == ["0", "1"]
