"""The sweep's state: rebuilt from the run directories, written to `<sweep>/sweep.json`.

Nothing here is trusted that a `kill -9` could leave stale. A run's facts live in its own directory, read through
`training.run.dir.RunDir`:
- its complete checkpoints (atomic, training/run/layout.py): the step it reached, and, from the
  checkpoint's resolved `config.yaml`, the `trainer.max_steps` it trains to;
- `sweep-run.json`, written atomically by whoever trains it (training/sweep/launch.py): the exact command, the
  hashes of its `-c` files, and the outcome of its last attempt (running with a pid and host, finished,
  diverged, failed).
Its status is `RunDir.status` (the definition `normlab compare` uses too), with liveness asked of the executor that
recorded the attempt (alive.py): `running`
while the recorded process lives (on this host also past its last checkpoint, while it validates and exits),
`pending` when it died (never started, or interrupted: the next sweep resumes it from its newest checkpoint).

`sweep.json` (the interface with the report, training/sweep/report.py) is a summary of these facts, rewritten
atomically under a file lock by the local runner and by every Slurm task on each change. It is written before any
run starts, so a run's own `fit` finds its place in the sweep there (`RunDir.sweep`, training/run/membership.py:
its trackers name and group it by it, training/loggers.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from training.run.dir import RunDir
from training.run.layout import SWEEP_STATE_FILE
from training.run.lock import locked
from training.sweep.alive import alive
from training.sweep.spec import Run, Spec


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


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
        write_json(spec.sweep_dir / SWEEP_STATE_FILE, state)
    return state
