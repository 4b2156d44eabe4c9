"""normlab's stop requests: SIGTERM (pre-emption, `kill`, `scancel`), Ctrl-C, and the cluster's warning signal
(SIGUSR1 by default: what Slurm's `--signal=USR1@T` sends T seconds before the time limit). Each makes the run
finish its optimizer step, save it and exit; after the warning the run also asks to be requeued
(training/cluster/stop.py), after SIGTERM or Ctrl-C it does not (a pre-empted job comes back if Slurm requeues it).

A handler only records the signal. Lightning's own handlers are never installed (`compat.own_signals`): Lightning
2.6 broadcasts from inside its SIGTERM handler, and its SLURM auto-requeue handler saves a checkpoint (a
collective) and requeues the job from inside the USR1 handler — at whatever line each rank happens to be on, so
one rank can sit in a gradient all-reduce while another waits in the checkpoint's all_gather: a deadlock until the
time limit. Here no collective ever starts in a handler: the ranks decide together at a step boundary — a sum
all-reduce of their flags (`agreed`), so a signal that reaches the ranks at different moments, or only one of
them, still stops every rank after the same step, and every rank knows whether it was the warning.

`normlab fit` installs the handlers when the command starts, before the seconds spent importing Lightning (a
warning in that window must not kill the rank: SIGUSR1's default action ends the process), and restores the
previous ones when the fit ends. A signal received while the run was starting stops it at its first step
boundary. A second Ctrl-C aborts at once (KeyboardInterrupt), without a checkpoint. Signal handlers are state of
the process, so the installed instance is too (`active`).

No host sync on the hot path: on several ranks the flags travel in a gloo group of their own, as CPU tensors,
asynchronously — the all-reduce started at one boundary is read at the next, so the GPU queue is never waited
for. The price is one step of latency: a signal that arrives while step s runs stops every rank after step s+1,
or after step s+2 when it lands on step s's boundary just after that boundary's flags left; on one rank, after
step s. Slurm's warning time (minutes) is far longer than two steps.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

# (torch is imported where the flags travel, not here: the handlers are installed before the heavy imports)

WARNING_SIGNALS = ("USR1", "USR2")  # what `cluster.signal` may name (Slurm's --signal=<sig>@<seconds>)


@dataclass(frozen=True)
class Decision:
    """What the ranks agreed at a step boundary: whether to stop after this step, and whether any rank had
    received the warning signal (then the run asks to be requeued)."""
    stop: bool
    warned: bool


class StopSignals:
    """Records SIGTERM, SIGINT and the warning signal between `install` and `restore`. Until `configure` names
    the warning, both candidates (SIGUSR1 and SIGUSR2) are recorded as one."""

    def __init__(self) -> None:
        self.warning: signal.Signals | None = None
        self.timeout = timedelta(minutes=10)  # of the flags' all-reduce (cluster.timeout_s)
        self.stopped: Decision | None = None  # the agreed decision that stopped the fit
        self.received: list[str] = []  # the names of the signals this rank received, in order
        self._first_at: float | None = None  # time.monotonic() of the first
        self.forward: Any = None  # called with the signal: the ranks this process spawned stop with it
        self._previous: dict[int, Any] = {}
        self._group: Any = None  # the gloo group the flags travel in (several ranks)
        self._flags: Any = None  # the all-reduce in flight (a CPU tensor), and its handle
        self._work: Any = None

    @property
    def warned(self) -> bool:
        candidates = [self.warning] if self.warning else [signal.Signals[f"SIG{w}"] for w in WARNING_SIGNALS]
        return any(s.name in self.received for s in candidates)

    def since_first(self) -> float | None:
        """Seconds since this rank received its first signal (None: it received none)."""
        return None if self._first_at is None else time.monotonic() - self._first_at

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for name in ("TERM", "INT", *WARNING_SIGNALS):
                signum = signal.Signals[f"SIG{name}"]
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def configure(self, warning: str, timeout: timedelta) -> None:
        """Name the warning signal (`cluster.signal`; the other candidate gets its previous handler back) and the
        flags' collective timeout (`cluster.timeout_s`)."""
        self.timeout = timeout
        if warning not in WARNING_SIGNALS:
            raise ValueError(f"cluster.signal={warning!r}: choose one of {', '.join(WARNING_SIGNALS)}")
        self.warning = signal.Signals[f"SIG{warning}"]
        for name in WARNING_SIGNALS:
            signum = signal.Signals[f"SIG{name}"]
            if signum != self.warning and signum in self._previous:
                signal.signal(signum, self._previous.pop(signum))

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        # The last all-reduce finishes in gloo's own thread (every rank started the same ones). Not waited for:
        # after an exception on one rank the others may never reach it.
        self._flags = self._work = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received:
            raise KeyboardInterrupt  # Ctrl-C after a stop request: abort now, without a checkpoint
        # Only a flag here (and os.kill): logging from a signal handler can deadlock on the handler's own lock.
        if name not in self.received:
            self.received.append(name)
            self._first_at = self._first_at or time.monotonic()
            if self.forward is not None and signum != signal.SIGINT:  # (Ctrl-C reaches the whole terminal group)
                self.forward(signum)

    def connect(self, world_size: int) -> None:
        """Make the gloo group the flags travel in — a collective: every rank calls it, once per fit."""
        import torch.distributed as dist

        if world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    def disconnect(self) -> None:
        """At a fit's normal end (every rank gets there): wait for the last boundary's all-reduce, which every
        rank started, and destroy the flags' group, so that no collective is in flight while the process exits
        (an unwaited gloo operation at interpreter exit is a hypothesis for a rare abort of a rank at exit,
        "terminate called without an active exception", seen once in a 2-rank torchrun test)."""
        import torch.distributed as dist

        if self._work is not None:
            self._work.wait()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = self._flags = self._work = None

    def agreed(self, world_size: int) -> Decision:
        """What the ranks had received by the previous call — the same answer on every rank. A collective: every
        rank must call it at the same step boundaries."""
        import torch
        import torch.distributed as dist

        if world_size == 1:  # no collective, and no device tensor to read back (a GPU sync every step)
            decision = Decision(bool(self.received), self.warned)
        else:
            decision = Decision(False, False)
            if self._work is not None:  # started at the previous boundary: long done, on the host
                self._work.wait()
                stop, warned = (bool(v > 0) for v in self._flags.tolist())  # a CPU tensor: no device sync
                decision = Decision(stop, warned)
            self._flags = torch.tensor([float(bool(self.received)), float(self.warned)])
            self._work = dist.all_reduce(self._flags, group=self._group, async_op=True)
        if decision.stop:
            self.stopped = decision
        return decision


_active: StopSignals | None = None


def install() -> StopSignals:
    """Install the stop handlers for this process (replacing any installed before); returns them."""
    global _active
    uninstall()
    _active = StopSignals().install()
    return _active


def active() -> StopSignals | None:
    """The handlers installed for this process, if any."""
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.restore()
    _active = None
