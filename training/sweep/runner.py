"""One sweep invocation: which runs to train, and the executor that trains them.

Idempotent: finished and diverged runs are skipped (a divergence is an outcome, and it would recur: the runs
are deterministic), runs another live process is training are left to it, and everything else — never started,
interrupted, failed — is (re)started with its own `fit --ckpt_path=last`, which resumes from its newest complete
checkpoint. A spec edit that would change a run already trained is refused before anything starts
(launch.check_unchanged), and an edit of the spec or of a `-c` file while the sweep runs stops it from starting
any further run (launch.Snapshot): one sweep trains one config. Only one sweep process works on a sweep directory
at a time (a flock on `.lock`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from training.errors import UserError
from training.run.layout import LOCK_FILE, SWEEP_STATE_FILE
from training.run.lock import locked
from training.sweep.launch import Snapshot, check_unchanged
from training.sweep.progress import status_counts, table
from training.sweep.spec import Run, Spec
from training.sweep.state import run_status, write_state

log = logging.getLogger(__name__)

SKIP = ("finished", "diverged", "running")


def to_train(spec: Spec, runs: list[Run]) -> list[Run]:
    return [r for r in runs if run_status(spec.sweep_dir / r.rel)[0] not in SKIP]


@contextmanager
def claimed(spec: Spec, runs: list[Run]) -> Iterator[list[Run]]:
    """The sweep directory held by this process (one sweep process at a time), the spec checked against what
    was trained, the state written: yields the runs still to train (local and Slurm executors alike)."""
    with locked(spec.sweep_dir / LOCK_FILE, blocking=False) as mine:
        if not mine:
            raise UserError(f"another sweep process is working on '{spec.sweep_dir}'; wait for it, or stop it")
        check_unchanged(spec, runs)
        todo = to_train(spec, runs)
        write_state(spec, runs)
        yield todo


def run_local(spec: Spec, runs: list[Run], max_parallel: int) -> dict:
    """Train the runs not done yet, locally; a UserError (after the runs already started have ended) when an edit
    of the spec or a `-c` file stopped the sweep from starting the others."""
    from training.sweep.local import LocalPool

    with claimed(spec, runs) as todo:
        log.info("sweep %s: %d runs, %d to train, %d at a time", spec.name, len(runs), len(todo), max_parallel)
        start = time.perf_counter()
        executor = LocalPool(spec, max_parallel, on_change=lambda: write_state(spec, runs),
                                 snapshot=Snapshot.take(spec, runs))
        executor.run(todo)
        state = write_state(spec, runs, with_metric=True)
        log.info("sweep %s: %s in %.0f s", spec.name, status_counts(r["status"] for r in state["runs"]),
                 time.perf_counter() - start)
        if executor.refused is not None:
            raise executor.refused
        return state


def status_table(spec: Spec, runs: list[Run]) -> str:
    """`--status`: every run's state, step, time and final metric (as far as it got), and the sweep's ETA —
    the numbers a local sweep's progress lines show."""
    state = write_state(spec, runs, with_metric=True)
    metrics = {r["run_dir"]: r["metric"] for r in state["runs"]}
    return table(spec, runs, metrics) + f"{Path(spec.sweep_dir) / SWEEP_STATE_FILE}\n"


def dry_run(spec: Spec, runs: list[Run], max_parallel: int = 1, executor: str = "local") -> str:
    """`--dry_run`: each run, its state and its exact command, and the time the runs left would take
    (estimate.py: what it is measured from); nothing is started or written."""
    import shlex

    from training.sweep.estimate import estimate_lines

    lines = [f"sweep {spec.name}: {len(runs)} runs ({len(spec.cells())} cells x {len(spec.seeds)} seeds) in "
             f"{spec.sweep_dir}"]
    todo = []
    for run in runs:
        status = run_status(spec.sweep_dir / run.rel)[0]
        todo += [run] if status not in ("finished", "diverged") else []
        lines.append(f"{run.rel}  [{status}]\n  {shlex.join(run.command)}")
    return "\n".join([*lines, *estimate_lines(spec, runs, todo, max_parallel, executor)]) + "\n"
