"""`normlab fit`'s `cluster.*` group (`ClusterConfig`), and the collective timeout on the trainer's strategy.

- `timeout_s`: how long a collective may wait for the other ranks (1 s to 7 days). A rank that stops responding
  (a hung process, a lost node) then ends the job with one line naming this rank and the collective (failure.py),
  instead of holding every GPU until the time limit. Lightning and DeepSpeed default to 30 minutes; 10 here, which
  a save of a 1B model's shards to a shared filesystem stays well inside.
- `signal`: the warning signal (USR1 or USR2) — `#SBATCH --signal=USR1@300` sends it to every task 300 s before
  the time limit. The ranks finish the step they are in, save it, exit, and rank 0 requeues the job
  (`scontrol requeue $SLURM_JOB_ID`, requeue.py); the requeued job resumes with `--ckpt_path last`.
- `requeue`: whether a warned fit requeues its own job (the sweep's Slurm task turns it off: it requeues itself).
- `max_requeues`: a run requeued this many times in a row without getting past the same step is not requeued
  again (one line instead of a loop), as submitit's `max_num_timeout` (3).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from training.cluster.signals import WARNING_SIGNALS

# Bounds of `timeout_s`. Below a second, the ranks' own rendezvous cannot finish and fails with a traceback; far
# above a week, the timedelta the process groups take overflows. A real job's limit lies well inside.
TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How a run behaves on a cluster: the collective timeout, Slurm's warning signal and requeueing (see the
    module docstring)."""

    timeout_s: float = 600.0
    signal: str = "USR1"
    requeue: bool = True
    max_requeues: int = 3

    def __post_init__(self) -> None:
        low, high = TIMEOUT_RANGE_S
        if not low <= self.timeout_s <= high:  # (NaN too)
            raise ValueError(f"cluster.timeout_s={self.timeout_s:g} must be between {low:g} and {high:g} seconds (7 "
                             "days): how long a collective may wait for the other ranks")
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
