"""A run's place in a sweep: which sweep lists the run directory in its `sweep.json`, and as which cell and seed.

`normlab sweep` writes `<sweep>/sweep.json` (training/sweep/state.py) before any of its runs starts, so a run's
own `fit` finds its place there: its trackers name and group it by it (training/loggers.py). Read through
`RunDir.sweep`. A sweep.json that cannot be read makes no run of it (the sweep rewrites the file whole at its
next state change), so a damaged one never stops a fit.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.run.layout import SWEEP_STATE_FILE


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
            state = json.loads((parent / SWEEP_STATE_FILE).read_text())
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


def format_value(value: Any) -> str:
    """A value as `fit` parses it (YAML) and as a cell name and a tracker's tag show it: 0.003, post, true, null,
    [1, 2]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return repr(value) if isinstance(value, float) else str(value)
    return json.dumps(value)
