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
atomically under a file lock by the local runner and by every Slurm task on each change, with the spec's judging
fields (`JUDGING`: the metric and its reduction, the baseline, the margins, the outcomes' rules), which cannot be
edited once a run has trained. It is written before any
run starts, so a run's own `fit` finds its place in the sweep there (`RunDir.sweep`, training/run/membership.py:
its trackers name and group it by it, training/loggers.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from training.errors import UserError
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
            entry["metric"] = spec.reduce(RunDir(run_dir).scalars.get(spec.metric, []))[0] if status in (
                "finished", "diverged") else RunDir(run_dir).last(spec.metric)
        entries.append(entry)
    return {"name": spec.name, "spec_path": str(spec.path.absolute()), **judging(spec), "axes": spec.axes,
            "seeds": list(spec.seeds), "data_order": spec.data_order, "cwd": str(Path.cwd()),
            "baseline_from": "spec", "runs": entries}


# What the report judges, fixed in the spec before the runs: recorded in sweep.json, and an edit after a run has
# trained is refused (`check_judging`), so no verdict is judged against a margin or rule chosen after the data.
JUDGING = {"metric": "val/loss", "reduce": "final", "mode": "min", "baseline": None, "margin": None, "lr_key": None,
           "question": "cells", "compare": None, "outcomes": {}}


def judging(spec: Spec) -> dict[str, Any]:
    """The spec's judging fields as sweep.json records them (JSON values)."""
    return json.loads(json.dumps({
        "metric": spec.metric, "reduce": spec.reduce.to_json(), "mode": spec.mode, "baseline": spec.baseline,
        "margin": spec.margin, "lr_key": spec.lr_key, "question": spec.question,
        "compare": list(spec.compare) if spec.compare else None, "outcomes": spec.outcomes}))


def check_judging(spec: Spec, recorded: dict[str, Any] | None) -> None:
    """Refuse (one line) a spec whose judging fields differ from those recorded in sweep.json once a run has
    trained under them."""
    runs = (recorded or {}).get("runs") or []
    if not any(r.get("step") or r.get("status") in ("finished", "diverged") for r in runs if isinstance(r, dict)):
        return
    now = judging(spec)
    for key, default in JUDGING.items():
        before = recorded.get(key, default)
        if before != now[key]:
            raise UserError(f"sweep spec '{spec.path}': {key} was {json.dumps(before)} when this sweep's runs "
                            f"trained ({spec.sweep_dir / SWEEP_STATE_FILE}) and is now {json.dumps(now[key])}: what "
                            "the report judges is fixed before the runs. Restore it, or give the edited spec a new "
                            "name (a new sweep)")


def write_state(spec: Spec, runs: list[Run], with_metric: bool = False) -> dict[str, Any]:
    """Rebuild sweep.json from the run directories and write it atomically (serialized across processes), once
    the spec's judging fields are checked against those it records (`check_judging`)."""
    state = summary(spec, runs, with_metric)
    path = spec.sweep_dir / SWEEP_STATE_FILE
    with locked(spec.sweep_dir / ".state.lock"):
        try:
            recorded = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            recorded = None  # unreadable: rebuilt from the run directories below
        check_judging(spec, recorded if isinstance(recorded, dict) else None)
        write_json(path, state)
    return state
