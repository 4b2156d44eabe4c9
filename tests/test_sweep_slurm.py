"""`normlab sweep --executor slurm` with one process per run on a real Slurm cluster (tests/helpers/slurm.py), no
mock: a 2-run sweep runs as one job array, and a task warned of its time limit (USR1, as `--signal=B:USR1@T` sends
it) passes the warning to its fit, which saves, requeues the job and resumes to the same final weights as the task
that ran straight through. (2-process runs through srun: tests/test_slurm_cluster.py.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.slurm import slurm_cluster  # noqa: F401  (the session fixture)
from training.run.dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.ckpt", map_location="cpu",
                      weights_only=True)
    tensors = dict(ckpt["state_dict"])
    for p, st in ckpt["optimizer_states"][0]["state"].items():
        tensors.update({f"opt.{p}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return tensors


def wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out: {what}")


@pytest.mark.slow
def test_a_job_array_sweep_survives_a_time_limit_warning_by_requeue(slurm_cluster, workdir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    shutil.copy(ROOT / "tests" / "helpers" / "tiny.yaml", workdir / "tiny.yaml")
    # Two runs that train identically (the model summary is console output only), so the one that is warned and
    # requeued must end with the other's weights and optimizer state, bit for bit.
    spec = workdir / "slurm.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "slurm", "runs_dir": str(workdir / "runs"),
        "base": {"config": [str(workdir / "tiny.yaml")],
                 "overrides": {"data.path": str(workdir / "tiny"), "trainer.max_steps": STEPS}},
        "grid": {"trainer.enable_model_summary": [False, True]}, "seeds": [0],
        "slurm": {"time": "00:30:00", "signal_seconds": 60}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "training.cli", "sweep", str(spec), "--executor", "slurm"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    job = out.stdout.split("submitted job array ")[1].split()[0]
    sweep_dir = workdir / "runs" / "slurm"
    warned, straight = sweep_dir / "enable_model_summary=false" / "s0", sweep_dir / "enable_model_summary=true" / "s0"
    wait(lambda: RunDir(warned).progress()[0] > 0, 600, "the first checkpoint of the run to warn")
    assert RunDir(warned).progress()[0] < STEPS
    signal = slurm_cluster.run("scancel", "--signal=USR1", "--batch", f"{job}_0")
    assert signal.returncode == 0, signal.stderr

    def array_done() -> bool:
        q = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%i %T")
        return q.returncode == 0 and not q.stdout.strip()

    wait(array_done, 900, f"job array {job} to end")
    log = (sweep_dir / "slurm" / f"{job}_0.out").read_text()
    record = RunDir(warned).record
    assert record["attempts"] == 2 and record["status"] == "finished", (record, log)
    assert "(restart 1)" in log and "requeueing job" in (warned / "fit.log").read_text(), log
    assert RunDir(straight).record["attempts"] == 1
    state = json.loads((sweep_dir / "sweep.json").read_text())
    assert [(r["status"], r["step"]) for r in state["runs"]] == [("finished", STEPS)] * 2
    got, want = final_tensors(warned), final_tensors(straight)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
