"""The sweep's state: rebuilt from the run directories, written to `<sweep>/sweep.json`.

Nothing here is trusted that a `kill -9` could leave stale. A run's facts live in its own directory, read through
`training.rundir.RunDir`:
- its complete checkpoints (atomic, training/checkpointing/layout.py): the step it reached, and, from the
  checkpoint's resolved `config.yaml`, the `trainer.max_steps` it trains to;
- `sweep-run.json`, written atomically by whoever trains it (training/sweep/launch.py): the exact command, the
  hashes of its `-c` files, and the outcome of its last attempt (running with a pid and host, finished,
  diverged, failed).
Its status is `RunDir.status` (the definition `normlab compare` uses too), with liveness checked here: `running`
while the recorded process lives (on this host also past its last checkpoint, while it validates and exits),
`pending` when it died (never started, or interrupted: the next sweep resumes it from its newest checkpoint).

`sweep.json` (the interface with the report, training/sweep/report.py) is a summary of these facts, rewritten
atomically under a file lock by the local runner and by every Slurm task on each change. It is written before any
run starts, so a run's own `fit` finds its place in the sweep there (`sweep_run_of`: its trackers name and group
it by it, training/loggers.py).
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpointing.layout import write_text_atomic
from training.rundir import RunDir
from training.sweep.executors import executor_of
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
    """Whether the recorded attempt still runs, as the executor that recorded it sees it (executors.py)."""
    return executor_of(record).alive(record)


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
            "question": spec.question, "compare": list(spec.compare) if spec.compare else None,
            "seeds": list(spec.seeds), "data_order": spec.data_order, "cwd": str(Path.cwd()), "runs": entries}


def write_state(spec: Spec, runs: list[Run], with_metric: bool = False) -> dict[str, Any]:
    """Rebuild sweep.json from the run directories and write it atomically (serialized across processes)."""
    state = summary(spec, runs, with_metric)
    with locked(spec.sweep_dir / ".state.lock"):
        write_json(spec.sweep_dir / STATE_FILE, state)
    return state


@dataclass(frozen=True)
class SweepRun:
    """A run directory's place in its sweep: what the trackers show of it."""

    sweep: str  # the sweep's name
    sweep_dir: Path
    cell: str
    seed: int
    params: dict[str, Any]  # the cell's values of the axes (dotted keys)
    domains: dict[str, list[Any]]  # every value each axis takes in the sweep, and "seed"'s
    metric: str  # what the report judges

    @property
    def title(self) -> str:
        """`<cell>/s<seed>`, as the run's directory under the sweep's."""
        return f"{self.cell}/s{self.seed}"


def sweep_run_of(run_dir: Path) -> SweepRun | None:
    """The sweep `run_dir` is a run of (its `sweep.json` is in a directory above and lists it), or None."""
    run_dir = Path(run_dir).absolute()
    for parent in run_dir.parents:
        try:  # (a sweep.json that cannot be read makes no run of it: the sweep rewrites it whole)
            state = json.loads((parent / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(state, dict):
            continue
        rel = run_dir.relative_to(parent).as_posix()
        runs = state.get("runs") or []
        entry = next((r for r in runs if r.get("run_dir") == rel), None)
        if entry is None:
            return None
        domains = {axis: _distinct([r["params"][axis] for r in runs if axis in r.get("params", {})])
                   for axis in state.get("axes") or []}
        return SweepRun(sweep=state["name"], sweep_dir=parent, cell=entry["cell"], seed=entry["seed"],
                        params=entry["params"], domains={**domains, "seed": list(state.get("seeds") or [])},
                        metric=state.get("metric") or "val/loss")
    return None


def _distinct(values: list[Any]) -> list[Any]:
    """`values` without repeats, in order (values may be lists: compared, not hashed)."""
    out: list[Any] = []
    for value in values:
        if value not in out:
            out.append(value)
    return out
