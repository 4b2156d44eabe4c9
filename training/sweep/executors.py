"""Where a sweep's runs train: the executors, a registry (as model/residual.py's placements are).

An executor is one small class with two methods: `launch` trains (or submits) the runs not finished and returns
the command's exit status, and `alive` says whether an attempt it recorded in a run's `sweep-run.json` is still
going. A new one (a Kubernetes job, another scheduler) is one class and one entry in `EXECUTORS`; `normlab sweep
--executor NAME` lists the registry's names, and its settings are the spec's `executor: {NAME: {...}}`.

The runs themselves are the same everywhere: `launch.train` starts `fit ... --ckpt_path=last` and records the
attempt, with the executor's name, so any later reader asks the right executor. That reader — the sweep's status,
below the launchers — asks `alive.alive`, whose `LIVENESS` every entry of `EXECUTORS` also fills: this module
stands on top of the package and imports its launchers as any module does.
"""
from __future__ import annotations

from typing import Any, ClassVar, Protocol

from training.sweep.alive import LIVENESS, executor_name, local_alive, slurm_alive
from training.sweep.runner import run_local
from training.sweep.slurm import submit
from training.sweep.spec import Run, Spec


class Executor(Protocol):
    name: ClassVar[str]

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        """Train or submit the runs of `runs` that are not finished; the command's exit status."""

    def alive(self, record: dict[str, Any]) -> bool:
        """Whether the attempt `record` (a run's sweep-run.json, status running) still runs."""


class Local:
    """Subprocesses on this machine, `max_parallel` at once (training/sweep/local.py)."""

    name: ClassVar[str] = "local"

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        state = run_local(spec, runs, max_parallel)
        return 0 if all(r["status"] in ("finished", "diverged") for r in state["runs"]) else 1

    def alive(self, record: dict[str, Any]) -> bool:
        return local_alive(record)


class Slurm:
    """One job array, one task per run (training/sweep/slurm.py); `wait` follows it to its end."""

    name: ClassVar[str] = "slurm"

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        return submit(spec, runs, max_parallel if max_parallel > 1 else None, wait=wait)

    def alive(self, record: dict[str, Any]) -> bool:
        return slurm_alive(record)


class Registry(dict[str, Executor]):
    """The executors by name; an entry added or removed is also added to or removed from `alive.LIVENESS`, so the
    status asks every registered executor about its own attempts."""

    def __setitem__(self, name: str, executor: Executor) -> None:
        super().__setitem__(name, executor)
        LIVENESS[name] = executor.alive

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        LIVENESS.pop(name, None)


EXECUTORS: Registry = Registry()
for _executor in (Local(), Slurm()):
    EXECUTORS[_executor.name] = _executor


def executor_of(record: dict[str, Any]) -> Executor:
    """The executor that recorded an attempt (an unknown one's: the local executor)."""
    return EXECUTORS.get(executor_name(record), EXECUTORS["local"])
