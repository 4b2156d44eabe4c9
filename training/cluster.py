"""A run on a cluster: the collective timeout, the warning signal, and requeueing a Slurm job (bounded).

`normlab fit`'s `cluster.*` group (`ClusterConfig`):
- `timeout_s`: how long a collective may wait for the other ranks. A rank that stops responding (a hung process,
  a lost node) then ends the job with one line naming this rank and the collective (`collective_failure`), instead
  of holding every GPU until the time limit. Lightning and DeepSpeed default to 30 minutes; 10 here, which a save
  of a 1B model's shards to a shared filesystem stays well inside.
- `signal`: the warning signal (USR1 or USR2) — `#SBATCH --signal=USR1@300` sends it to every task 300 s before
  the time limit. The ranks finish the step they are in, save it, exit, and rank 0 requeues the job
  (`scontrol requeue $SLURM_JOB_ID`); the requeued job resumes with `--ckpt_path last`.
- `requeue`: whether a warned fit requeues its own job (the sweep's Slurm task turns it off: it requeues itself).
- `max_requeues`: a run requeued this many times in a row without getting past the same step is not requeued
  again (one line instead of a loop), as submitit's `max_num_timeout` (3).

The requeues of a run are recorded in `<run dir>/requeues.json` (job, restart, step, reason, time).
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from training.run.dir import RunDir
from training.run.layout import REQUEUES_FILE
from training.signals import WARNING_SIGNALS

log = logging.getLogger(__name__)

# In a run's log: a rank ended because another rank stopped responding (a hung process or a lost node). The
# sweep's Slurm task requeues such a run (training/sweep/slurm.py).
LOST_RANK = "another rank stopped responding"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How a run behaves on a cluster: the collective timeout, Slurm's warning signal and requeueing (see the
    module docstring)."""

    timeout_s: float = 600.0
    signal: str = "USR1"
    requeue: bool = True
    max_requeues: int = 3

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"cluster.timeout_s={self.timeout_s} must be > 0 (seconds a collective may wait)")
        if self.signal not in WARNING_SIGNALS:
            raise ValueError(f"cluster.signal={self.signal!r}: choose one of {', '.join(WARNING_SIGNALS)} (the "
                             "signal of #SBATCH --signal=<sig>@<seconds>)")
        if self.max_requeues < 0:
            raise ValueError(f"cluster.max_requeues={self.max_requeues} must be >= 0")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


def with_timeout(strategy: Any, timeout: timedelta) -> Any:
    """The trainer's `strategy` with the collective timeout: a registered name whose class takes a `timeout`
    (Lightning's DDP, DeepSpeed and FSDP strategies, normlab's zero1-3) becomes that class built with it; anything
    else (a single device, a strategy object given in the config) is returned as it is."""
    from lightning.pytorch.strategies import StrategyRegistry

    if not isinstance(strategy, str) or strategy not in StrategyRegistry:
        return strategy
    entry = StrategyRegistry[strategy]
    if "timeout" not in inspect.signature(entry["strategy"]).parameters:
        return strategy
    return entry["strategy"](**entry["init_params"], timeout=timeout)


def _rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


# What gloo says when a peer rank is gone or silent (NCCL's watchdog ends the process with its own line, naming
# the rank, the collective and the timeout).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")
_TIMED_OUT = ("Timed out", "timed out", "Timeout")


def collective_failure(err: BaseException, timeout_s: float | None = None) -> str | None:
    """The one line for an error raised because another rank stopped responding in a collective — which rank
    this is (and its node), which collective, and what to do — or None for any other error."""
    chain, seen = [], err
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e) for e in chain)
    gone, timed_out = any(m in text for m in _PEER_GONE), any(m in text for m in _TIMED_OUT)
    if not (gone or timed_out) or not any(type(e).__name__ in ("DistBackendError", "RuntimeError", "DistError")
                                          for e in chain):
        return None
    # The collective: the outermost torch.distributed call on the stack (what normlab, Lightning or DeepSpeed
    # called), or the stop-signal flags' all-reduce.
    collective = "a collective"
    for e in chain:
        for frame in traceback.extract_tb(e.__traceback__):
            if frame.filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
                collective = f"the {frame.name} collective"
                break
            if frame.filename.endswith("signals.py") and frame.name == "agreed":
                collective = "the stop-signal all_reduce"
        else:
            continue
        break
    node = os.environ.get("SLURMD_NODENAME")
    where = f"rank {_rank()}" + (f" (node {node})" if node else "")
    how = (f"waited {timeout_s:g} s (cluster.timeout_s)" if timed_out and timeout_s else
           "timed out" if timed_out else "lost its connection to a peer")
    return (f"{where}: {collective} {how}: {LOST_RANK} (a hung process or a lost node); the run ends here — "
            "resume it with --ckpt_path last (a Slurm job with --requeue comes back by itself when its node failed)")


def requeue(run_dir: Path, step: int, reason: str, max_requeues: int) -> bool:
    """Ask Slurm to requeue this job (`scontrol requeue $SLURM_JOB_ID`), to resume the run in `run_dir` from its
    checkpoint at `step` — unless it has been requeued `max_requeues` times in a row without getting past `step`.
    One log line either way; returns whether the job was requeued."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        log.warning("%s at step %d, but this is not a Slurm job: not requeued (resume with --ckpt_path last)",
                    reason, step)
        return False
    history = list(RunDir(run_dir).requeues)
    stalled = 0
    for entry in reversed(history):
        if entry["step"] < step:
            break
        stalled += 1
    if stalled >= max_requeues:
        log.error("%s: requeued %d times in a row without getting past step %d; not requeued again (the run's log "
                  "says why; cluster.max_requeues allows more)", run_dir, stalled, step)
        return False
    history.append({"job": job, "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "step": step,
                    "reason": reason, "time": time.time()})
    write_text_atomic(Path(run_dir) / REQUEUES_FILE, json.dumps(history, indent=1) + "\n")
    # Logged first: a successful requeue ends this job at once (Slurm signals its processes).
    log.info("%s at step %d: requeueing job %s (restart %d)", reason, step, job, len(history))
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.error("scontrol is not on the PATH: job %s not requeued (resume with --ckpt_path last)", job)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, " ".join(out.stderr.split()))
        return False
    return True
