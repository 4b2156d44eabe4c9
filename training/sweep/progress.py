"""How far a sweep has got: one row per run (its state, step, time) and the sweep's ETA, read from the run
directories alone — the same for `normlab sweep --status` (any time, any process) and for the lines a local
sweep prints as its runs start, come up, reach a checkpoint and end.

A run's step is its newest complete checkpoint's (RunDir.progress): between checkpoints it does not move. Its time
is that of its last attempt (sweep-run.json: started, ended). The ETA schedules what is left on the sweep's
parallel slots: each running run ends after the time its step fraction projects (or the mean finished run's time
before its first checkpoint), then each pending run takes the mean time of the finished runs; before anything
has finished or checkpointed there is no estimate ("ETA ?").
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from training import safe_yaml
from training.run.dir import RunDir
from training.run.layout import CONFIG_FILE
from training.sweep.spec import Run, Spec
from training.sweep.state import run_status


@dataclass(frozen=True)
class RunView:
    """One run as the progress lines and `--status` show it."""

    rel: str  # <cell>/s<seed>
    status: str
    step: int
    max_steps: int | None
    started: float | None  # of its last attempt (time.time())
    ended: float | None
    up: float | None = None  # a running attempt's start-up: seconds from its start to its first TensorBoard event

    def seconds(self, now: float) -> float | None:
        """How long its last attempt ran (runs: so far)."""
        if self.started is None:
            return None
        return (self.ended if self.ended is not None and self.status != "running" else now) - self.started

    def fraction(self) -> float:
        return self.step / self.max_steps if self.max_steps else 0.0

    def projected(self, now: float) -> float | None:
        """A running attempt's whole time, extrapolated from its step (its start-up counted once)."""
        seconds, fraction = self.seconds(now), self.fraction()
        if not seconds or fraction <= 0:
            return None
        up = min(self.up or 0.0, seconds)
        return up + (seconds - up) / fraction


def view(spec: Spec, run: Run) -> RunView:
    run_dir = spec.sweep_dir / run.rel
    status, step, record = run_status(run_dir)
    max_steps = RunDir(run_dir).progress()[1] or _max_steps(run_dir)
    record = record or {}
    up = start_up(run_dir, record) if status == "running" else None
    return RunView(run.rel, status, step, max_steps, record.get("started"), record.get("ended"), up)


def start_up(run_dir: Path, record: dict[str, Any]) -> float | None:
    """Seconds from the recorded attempt's start to its first TensorBoard event file (whose name holds the time
    it was created and the process id), or None while it is starting."""
    pid, started = record.get("pid"), record.get("started")
    for events in run_dir.glob(f"events.out.tfevents.*.{pid}.*") if pid and started else ():
        stamp = events.name.split(".")[3]
        if stamp.isdigit():
            return max(int(stamp) - started, 0.0)
    return None


def _max_steps(run_dir: Path) -> int | None:
    """`trainer.max_steps` of the config a started run resolved (before its first checkpoint has one)."""
    try:
        config = safe_yaml.load((run_dir / CONFIG_FILE).read_text(), str(run_dir / CONFIG_FILE)) or {}
        return int((config.get("trainer") or {}).get("max_steps"))
    except (OSError, TypeError, ValueError, yaml.YAMLError):
        return None


def eta(views: list[RunView], slots: int, now: float) -> float | None:
    """Seconds until every run that is pending or running has ended, on `slots` at once (None: no estimate)."""
    done = [v.seconds(now) for v in views if v.status in ("finished", "diverged", "failed") and v.seconds(now)]
    running = [v for v in views if v.status == "running"]
    pending = sum(v.status == "pending" for v in views)
    projected = [t for t in (v.projected(now) for v in running) if t is not None]
    typical = sum(done) / len(done) if done else (sum(projected) / len(projected) if projected else None)
    left = []
    for v in running:
        total = v.projected(now) or typical
        if total is None:
            return None
        left.append(max(total - (v.seconds(now) or 0.0), 0.0))
    if pending and typical is None:
        return None
    free = sorted(left + [0.0] * max(slots - len(left), 0)) or [0.0]
    for _ in range(pending):
        heapq.heappush(free, heapq.heappop(free) + typical)
    return max(free) if running or pending else 0.0


def duration(seconds: float | None) -> str:
    """`42s`, `3m05s`, `1h05m` (no spaces: one column of a table)."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# The order the counts are printed in, whatever order the runs reached their states in (unknown ones last).
STATUS_ORDER = ("finished", "diverged", "failed", "running", "pending")  # run.dir.STATUSES, ended first


def counts(views: list[RunView]) -> str:
    """`2 finished, 1 running, 1 pending`: how many runs are in each state, in STATUS_ORDER."""
    return status_counts(v.status for v in views)


def status_counts(statuses: Iterable[str]) -> str:
    """`counts` of the runs in these states (one state per run)."""
    found: dict[str, int] = {}
    for status in statuses:
        found[status] = found.get(status, 0) + 1
    rank = {s: i for i, s in enumerate(STATUS_ORDER)}
    return ", ".join(f"{found[s]} {s}" for s in sorted(found, key=lambda s: (rank.get(s, len(rank)), s)))


def footer(views: list[RunView], slots: int, now: float) -> str:
    """`2/4 done (2 finished), 2 running, ETA 1 min 05 s`: where the sweep stands."""
    ended = sum(v.status in ("finished", "diverged", "failed") for v in views)
    left = [v for v in views if v.status in ("pending", "running")]
    tail = f", ETA {duration(eta(views, slots, now))}" if left else ""
    return f"{ended}/{len(views)} done ({counts(views)}){tail}"


def row(v: RunView, now: float) -> list[str]:
    step = f"{v.step}/{v.max_steps}" if v.max_steps else str(v.step)
    return [v.rel, v.status, step, duration(v.seconds(now)) if v.started is not None else "-"]


def table(spec: Spec, runs: list[Run], metrics: dict[str, float | None], slots: int | None = None) -> str:
    """`--status`: every run's state, step, time and metric, then where the sweep stands."""
    now = time.time()
    views = [view(spec, run) for run in runs]
    rows = [["run", "status", "step", "time", spec.metric]]
    for v in views:
        metric = metrics.get(v.rel)
        rows.append([*row(v, now), "-" if metric is None else f"{metric:.4f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    running = sum(v.status == "running" for v in views)
    lines.append(footer(views, slots or max(running, 1), now))
    return "\n".join(lines) + "\n"


def line(v: RunView, event: str, views: list[RunView], slots: int, now: float) -> str:
    """One progress line: the run, what happened, and where the sweep stands."""
    step = f"step {v.step}/{v.max_steps}" if v.max_steps else f"step {v.step}"
    return f"{v.rel}  {event}  {step}, {duration(v.seconds(now))}  | sweep {footer(views, slots, now)}"

