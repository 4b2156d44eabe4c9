"""Whether a run's recorded attempt still runs, as the executor that recorded it sees it: the half of an executor
the sweep's status (`--status`, the skip rule, the report, `normlab compare`) needs, apart from launching.

Every attempt's `sweep-run.json` names its executor (training/sweep/launch.py); `alive(record)` asks that
executor's liveness in `LIVENESS`. An entry of the executor registry (executors.py's `EXECUTORS`) registers its
`alive` here as well, so the status code below the launchers reaches every executor without importing them.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def local_alive(record: dict[str, Any]) -> bool:
    """A local attempt: its process on this host. One recorded on another host (a shared filesystem) cannot be
    looked at from here: trusted."""
    return record.get("host") != socket.gethostname() or process_alive(record)


def slurm_alive(record: dict[str, Any]) -> bool:
    """A Slurm task's attempt: on this host the process itself says; elsewhere, whether Slurm still lists the job
    (requeued included)."""
    if record.get("host") == socket.gethostname():
        return process_alive(record)
    return slurm_job_alive(record.get("slurm_job"))


LIVENESS: dict[str, Callable[[dict[str, Any]], bool]] = {"local": local_alive, "slurm": slurm_alive}


def executor_name(record: dict[str, Any]) -> str:
    """The executor that recorded an attempt (records written before the name was: a Slurm job id says which)."""
    return record.get("executor") or ("slurm" if record.get("slurm_job") else "local")


def alive(record: dict[str, Any]) -> bool:
    """Whether the recorded attempt still runs, as its executor sees it (an unknown executor's: as a local one)."""
    return LIVENESS.get(executor_name(record), local_alive)(record)
