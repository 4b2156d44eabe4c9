"""The sweep's state: rebuilt from the run directories, written to `<sweep>/sweep.json`.

Nothing here is trusted that a `kill -9` could leave stale. A run's facts live in its own directory, read through
`training.rundir.RunDir`:
- its complete checkpoints (atomic, training/checkpointing/layout.py): the step it reached, and, from the
  checkpoint's resolved `config.yaml`, the `trainer.max_steps` it trains to;
- `sweep-run.json`, written atomically by whoever trains it (training/sweep/launch.py): the exact command, the
  hashes of its `-c` files, and the outcome of its last attempt (running with a pid and host, finished,
  diverged, failed).
Its status is `RunDir.status` (the definition `normlab compare` uses too), with liveness checked here: `running`
while the recorded process lives, `pending` when it died (never started, or interrupted: the next sweep resumes
it from its newest checkpoint).

`sweep.json` (the interface with the report, training/sweep/report.py) is a summary of these facts, rewritten
atomically under a file lock by the local runner and by every Slurm task on each change.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from training.checkpointing.layout import write_text_atomic
from training.rundir import RunDir
from training.sweep.spec import Run, Spec

STATE_FILE = "sweep.json"
LOG_FILE = "fit.log"


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


@contextmanager
def locked(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` (released by the kernel if the holder dies, even by kill -9); yields whether
    it was taken (always True when blocking)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def alive(record: dict[str, Any]) -> bool:
    """Whether the recorded attempt's process still runs (on another host: whether Slurm still lists its job). A
    zombie (a killed run whose parent died too, left unreaped) or a reused pid running something else is not."""
    if record.get("host") != socket.gethostname():
        return _slurm_job_alive(record.get("slurm_job"))
    pid = record.get("pid")
    proc = Path(f"/proc/{pid}")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if not Path("/proc/self").exists():  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    command = [a.encode() for a in record.get("command", [])[1:]]
    return state not in ("Z", "X") and all(a in cmdline for a in command)


def _slurm_job_alive(job: str | None) -> bool:
    """Whether Slurm still lists the job (pending, running, requeued); without a job id or squeue, trust it."""
    if not job or shutil.which("squeue") is None:
        return True
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return out.returncode != 0 or bool(out.stdout.strip())  # an error (controller down) is no evidence of death


def run_status(run_dir: Path) -> tuple[str, int, dict[str, Any] | None]:
    """(status, step, record) of one run, from its directory alone."""
    run = RunDir(run_dir)
    return run.status(alive=alive), run.progress()[0], run.record


def summary(spec: Spec, runs: list[Run], with_metric: bool = False) -> dict[str, Any]:
    """The sweep.json document: the spec's judging fields and every run's current state."""
    entries = []
    for run in runs:
        run_dir = spec.sweep_dir / run.rel
        status, step, _ = run_status(run_dir)
        entry = {"cell": run.cell, "params": run.params, "seed": run.seed, "run_dir": run.rel, "status": status,
                 "step": step, "command": run.command}
        if with_metric:
            entry["metric"] = RunDir(run_dir).last(spec.metric)
        entries.append(entry)
    return {"name": spec.name, "spec_path": str(spec.path.absolute()), "metric": spec.metric, "mode": spec.mode,
            "baseline": spec.baseline, "margin": spec.margin, "lr_key": spec.lr_key, "axes": spec.axes,
            "seeds": list(spec.seeds), "data_order": spec.data_order, "cwd": str(Path.cwd()), "runs": entries}


def write_state(spec: Spec, runs: list[Run], with_metric: bool = False) -> dict[str, Any]:
    """Rebuild sweep.json from the run directories and write it atomically (serialized across processes)."""
    state = summary(spec, runs, with_metric)
    with locked(spec.sweep_dir / ".state.lock"):
        write_json(spec.sweep_dir / STATE_FILE, state)
    return state
