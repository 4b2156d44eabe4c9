"""A clean stop on SIGTERM (SLURM pre-emption, `kill`) or Ctrl-C: finish the current optimizer step, save it, exit 0.

Lightning 2.6's own SIGTERM handling is not enough for that: its handler forwards the signal to the ranks it
spawned and then *broadcasts from inside the signal handler* (a collective issued at an arbitrary point, which
can pair with another rank's gradient all-reduce), and its loops then raise `SIGTERMException` — an
interruption, with no checkpoint; on several ranks they act on rank 0's flag alone. Ctrl-C raises
KeyboardInterrupt wherever Python happens to be. So, from the start of training on, `StopSignals` replaces
both handlers by one that only records the request (and, like Lightning's, forwards SIGTERM once to the ranks
Lightning spawned); the ranks then decide together at a step boundary — a sum all-reduce of their flags
(`agreed`), so a signal that reaches the ranks at different moments still stops every rank after the same step.
A second Ctrl-C aborts at once (KeyboardInterrupt), without a checkpoint.

No host sync on the hot path: on several ranks the flags travel in a gloo group of their own, as CPU tensors,
asynchronously — the all-reduce started at one boundary is read at the next, so the GPU queue is never waited
for. The price is one step of latency: a signal that arrives while step s runs stops every rank after step s+1,
or after step s+2 when it lands on step s's boundary just after that boundary's flags left; on one rank, after
step s. SLURM's pre-emption grace (minutes) is far longer than two steps.
"""
from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Records SIGTERM/SIGINT between `install` and `restore`; `agreed` is the ranks' common decision."""

    def __init__(self) -> None:
        self.received: str | None = None  # the name of the first signal this rank received
        self._previous: dict[int, Any] = {}
        self._launcher: Any = None
        self._group: Any = None  # the gloo group the flags travel in (several ranks)
        self._flags: torch.Tensor | None = None  # the all-reduce in flight, and its handle
        self._work: Any = None

    def install(self, trainer: Trainer) -> None:
        self.received = None
        self._flags = self._work = None
        if trainer.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # a collective: every rank installs at train start
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; leave Lightning's handlers alone
        self._launcher = trainer.strategy.launcher
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        # The last all-reduce finishes in gloo's own thread (every rank started the same ones). Not waited for:
        # after an exception on one rank the others may never reach it.
        self._flags = self._work = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # Ctrl-C after a stop request: abort now, without a checkpoint
        if self.received is None:
            if signum == signal.SIGTERM and getattr(self._launcher, "kill", None) is not None:
                self._launcher.kill(signum)  # the ranks Lightning spawned stop with this one, as in Lightning
            # Only a flag here: logging from a signal handler can deadlock on the handler's own lock.
            self.received = name

    def agreed(self, trainer: Trainer) -> bool:
        """Whether any rank had received a stop signal by the previous call — the same answer on every rank. A
        collective: every rank must call it at the same step boundaries."""
        if trainer.world_size == 1:  # no collective, and no device tensor to read back (a GPU sync every step)
            return self.received is not None
        stop = False
        if self._work is not None:  # started at the previous boundary: long done, on the host
            self._work.wait()
            stop = bool(self._flags.item() > 0)  # a CPU tensor: no device sync
        self._flags = torch.tensor([float(self.received is not None)])
        self._work = dist.all_reduce(self._flags, group=self._group, async_op=True)
        return stop
