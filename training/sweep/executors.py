"""Where a sweep's runs train: the executors, a registry (as model/residual.py's placements are).

An executor is one small class with two methods: `launch` trains (or submits) the runs not finished and returns
the command's exit status, and `alive` says whether an attempt it recorded in a run's `sweep-run.json` is still
going — which the sweep's status (`--status`, the skip rule, the report) asks through `executor_of`. A new one
(a Kubernetes job, another scheduler) is one class and one entry in `EXECUTORS`; `normlab sweep --executor NAME`
lists the registry's names.

The runs themselves are the same everywhere: `launch.train` starts `fit ... --ckpt_path=last` and records the
attempt, with the executor's name, so any later reader asks the right executor.

This module sits below the launchers: they read the runs' status (state.py), which asks `executor_of`. So an
executor names its launcher as a module and a function, imported when a sweep launches, as a package's entry
points are — no import of this module ever loads a launcher, and no launcher import comes back here.
"""
from __future__ import annotations

import importlib
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from training.sweep.spec import Run, Spec


class Executor(Protocol):
    name: ClassVar[str]

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        """Train or submit the runs of `runs` that are not finished; the command's exit status."""

    def alive(self, record: dict[str, Any]) -> bool:
        """Whether the attempt `record` (a run's sweep-run.json, status running) still runs."""


def process_alive(record: dict[str, Any]) -> bool:
    """Whether the recorded process still runs on this host. A zombie (a killed run whose parent died too, left
    unreaped) or a reused pid running something else is not."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if not Path("/proc/self").exists():  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    command = [a.encode() for a in record.get("command", [])[1:]]
    return state not in ("Z", "X") and all(a in cmdline for a in command)


def slurm_job_alive(job: str | None) -> bool:
    """Whether Slurm still lists the job (pending, running, requeued); without a job id or squeue, trust it."""
    if not job or shutil.which("squeue") is None:
        return True
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return out.returncode != 0 or bool(out.stdout.strip())  # an error (controller down) is no evidence of death


def launcher(target: str) -> Callable[..., Any]:
    """The function `target` ("package.module:function") names, imported now."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


class Local:
    """Subprocesses on this machine, `max_parallel` at once (training/sweep/local.py)."""

    name: ClassVar[str] = "local"

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        state = launcher("training.sweep.runner:run_local")(spec, runs, max_parallel)
        return 0 if all(r["status"] in ("finished", "diverged") for r in state["runs"]) else 1

    def alive(self, record: dict[str, Any]) -> bool:
        # A run recorded on another host (a shared filesystem) cannot be looked at from here: trusted.
        return record.get("host") != socket.gethostname() or process_alive(record)


class Slurm:
    """One job array, one task per run (training/sweep/slurm.py); `wait` follows it to its end."""

    name: ClassVar[str] = "slurm"

    def launch(self, spec: Spec, runs: list[Run], max_parallel: int, wait: bool) -> int:
        submit = launcher("training.sweep.slurm:submit")
        return submit(spec, runs, max_parallel if max_parallel > 1 else None, wait=wait)

    def alive(self, record: dict[str, Any]) -> bool:
        # On this host the process itself says; elsewhere, whether Slurm still lists the job (requeued included).
        if record.get("host") == socket.gethostname():
            return process_alive(record)
        return slurm_job_alive(record.get("slurm_job"))


EXECUTORS: dict[str, Executor] = {executor.name: executor for executor in (Local(), Slurm())}


def executor_of(record: dict[str, Any]) -> Executor:
    """The executor that recorded an attempt (records written before the name was: a Slurm job id says which)."""
    name = record.get("executor") or ("slurm" if record.get("slurm_job") else "local")
    return EXECUTORS.get(name, EXECUTORS["local"])
