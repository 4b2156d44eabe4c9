"""`--loggers "[csv, wandb, mlflow]"` (training/loggers.py) in a real tiny fit and its resume: every normlab metric —
LitLM's (`train/loss`), the health callback's (`resid/rms/L0`), the guard's and throughput's — reaches every
logger, TensorBoard stays the run's default with its dashboards, and a resume continues the same W&B and MLflow
runs. W&B runs offline (`WANDB_MODE=offline`), MLflow on its file store: both real, nothing mocked."""
from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import scalars

pytestmark = pytest.mark.slow

# On every logger: LitLM.log, TrainingHealth (step 0 and every step here), Throughput, NonFiniteGuard.
METRICS = ("train/loss", "resid/rms/L0", "throughput/peak_tflops", "guard/loss_z")


def fit(workdir: Path, max_steps: int, *extra: str) -> None:
    run_normlab(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.path", str(workdir / "tiny"),
                 "--runs_dir", str(workdir / "runs"), "--name", "logged", "--loggers", "[csv, wandb, mlflow]",
                 "--trainer.max_steps", str(max_steps), "--checkpoint.every_n_steps", "2",
                 "--metrics.every_n_steps", "1", *extra], cwd=workdir, WANDB_MODE="offline", WANDB_SILENT="true")


@pytest.fixture(scope="module")
def run(workdir: Path) -> Path:
    fit(workdir, 2)
    run_dir = workdir / "runs" / "logged"
    first = json.loads((run_dir / "loggers.json").read_text())
    fit(workdir, 4, "--ckpt_path", "last", "--optim.continuation", "hold")  # trains on past its 2 steps
    assert json.loads((run_dir / "loggers.json").read_text()) == first  # the resume kept both runs
    return run_dir


def test_tensorboard_stays_the_default_with_its_dashboards(run: Path) -> None:
    for tag in METRICS:
        assert scalars(run, tag), tag
    assert sorted(scalars(run, "train/loss")) == [1, 2, 3, 4]  # the resume appended to the same events


def test_csv_gets_every_metric(run: Path) -> None:
    versions = sorted((run / "csv").glob("version_*/metrics.csv"))
    assert len(versions) == 2  # one per start: Lightning's CSV writer cannot append
    for path, steps in zip(versions, ([1, 2], [3, 4]), strict=True):
        rows = list(csv.DictReader(path.open()))
        for tag in METRICS:
            assert any(row.get(tag) for row in rows), (tag, path)
        assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == steps


def test_mlflow_gets_every_metric_in_one_run(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (as normlab sets it for its file store)
    run_id = json.loads((run / "loggers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    for tag in METRICS:
        assert client.get_metric_history(run_id, tag), tag
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4]
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1  # resumed, not a second run


def wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run file (`run-<id>.wandb`: a LevelDB-style log of protobuf records, 32 KiB
    blocks of [crc32, length, type] chunks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = run_file.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The `history` rows of an offline W&B run file, as {key: JSON value}."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            for record in wandb_records(run_file) if record.WhichOneof("record_type") == "history"]


def test_wandb_gets_every_metric_and_the_resume_continues_its_run(run: Path) -> None:
    run_id = json.loads((run / "loggers.json").read_text())["wandb"]["id"]
    starts = sorted((run / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(d.name.endswith(f"-{run_id}") for d in starts)  # both starts: one W&B id
    for start, steps in zip(starts, ({1, 2}, {3, 4}), strict=True):
        rows = wandb_history(start / f"run-{run_id}.wandb")
        for tag in METRICS:
            assert any(tag in row for row in rows), (tag, start)
        assert {int(row["trainer/global_step"]) for row in rows if "train/loss" in row} == steps
