"""Test-only callbacks, attached to real runs through a YAML config (`trainer.callbacks`)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Callback


class StopAtStep(Callback):
    """Ends the process after optimizer step `step`, like a job killed between checkpoints: nothing is saved.
    (An exception, not `trainer.should_stop`: a fit that ends normally saves its final step.)"""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        if trainer.global_step >= self.step:
            raise SystemExit(0)


class RequestStop(Callback):
    """Asks the trainer to stop after optimizer step `step` (`trainer.should_stop`), as early stopping does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class WaitForSignal(Callback):
    """On rank `rank`, before the first micro-batch of update `step` + 1, writes the process id to `marker` and
    waits (up to `timeout` s) until the file `marker`.sent exists — the test signals the process, then creates
    it — so the signal lands at a known point mid-run (see tests.helpers.faults.signal_when_waiting)."""

    def __init__(self, step: int, marker: str, rank: int = 0, timeout: float = 120.0) -> None:
        self.step, self.marker, self.rank, self.timeout = step, Path(marker), rank, timeout

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (trainer.global_rank != self.rank or trainer.global_step != self.step
                or batch_idx % trainer.accumulate_grad_batches):
            return
        sent = self.marker.with_name(self.marker.name + ".sent")
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.replace(self.marker)  # the test reads a whole process id
        deadline = time.monotonic() + self.timeout
        while not sent.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class RNGProbe(Callback):
    """Logs one draw from each generator (python, numpy, torch) at every step, summed over ranks, so a
    resumed run whose RNG state was not restored — on any rank — logs different values."""

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        draw = random.random() + float(np.random.rand()) + float(torch.rand(()))
        pl_module.log("probe/rng", draw, reduce_fx="sum", sync_dist=True)


class MicroBatchLosses(Callback):
    """Records, before each micro-batch's forward, its loss under the current weights — what `train/loss` of the
    update must average (the weights change only after the update's last micro-batch) — and writes the list
    to the JSON file `path` when training ends."""

    def __init__(self, path: str) -> None:
        self.path, self.losses = path, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with torch.no_grad():
            self.losses.append(pl_module.loss(batch).item())

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.path).write_text(json.dumps(self.losses))


class SignalJobDuring(Callback):
    """Has Slurm signal every task of this job (`scancel --signal=SIG $SLURM_JOB_ID`, as `#SBATCH --signal=USR1@T`
    or a pre-emption does; with `batch`, only the batch step, as `--signal=B:USR1@T` does) while rank `rank` is inside
    one phase of a step — `forward` (the first MLP's forward), `backward` (its backward), `optimizer` (just before the
    optimizer step) or `save` (inside a checkpoint save, between its collectives) — then stays in that phase for
    `hold` s, so the signal reaches every rank while this one is there (another rank usually waits in a collective
    for it). `phases[r]` is the phase of the job's restart r (SLURM_RESTART_COUNT), `signals[r]` its signal (USR1
    when not given); the first step >= `after` steps into the attempt; restarts beyond the list run untouched.
    With `only_in`, only a run whose directory path contains it is signalled (one callbacks file for a sweep).
    Nothing here changes the math."""

    def __init__(self, phases: list[str], signals: list[str] | None = None, rank: int = 0, after: int = 1,
                 hold: float = 1.0, batch: bool = False, only_in: str | None = None) -> None:
        self.rank, self.after, self.hold, self.batch, self.only_in = rank, after, hold, batch, only_in
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        self.phase = phases[restart] if restart < len(phases) else None
        self.signal = (signals or [])[restart] if restart < len(signals or []) else "USR1"
        self.start: int | None = None
        self.done = False

    def on_train_start(self, trainer, pl_module) -> None:
        if self.only_in is not None and self.only_in not in str(trainer.default_root_dir):
            return
        self.start = trainer.global_step
        mlp = pl_module.model.layers[0].mlp  # (built by now, also under ZeRO-3)
        mlp.register_forward_pre_hook(lambda *_: self._maybe(trainer, "forward"))

        def in_backward(_module, _inputs, out) -> None:  # when the gradient of the MLP's output is computed
            if out.requires_grad:
                out.register_hook(lambda _grad: self._maybe(trainer, "backward"))
        mlp.register_forward_hook(in_backward)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._maybe(trainer, "optimizer")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._maybe(trainer, "save")

    def _maybe(self, trainer, phase: str) -> None:
        if (self.done or phase != self.phase or trainer.global_rank != self.rank or self.start is None
                or trainer.global_step < self.start + self.after or not trainer.training):
            return
        self.done = True
        scancel = ["scancel", f"--signal={self.signal}", *(["--batch"] if self.batch else []),
                   os.environ["SLURM_JOB_ID"]]
        subprocess.run(scancel, check=True)
        time.sleep(self.hold)


class LoseNode(Callback):
    """In the job's first attempt, at optimizer step `step`, the rank on Slurm node `node` kills -9 every process of
    this job on its node (itself included), as a node that dies would leave them: nothing saved, no line written.
    With `only_in`, only in a run whose directory path contains it."""

    def __init__(self, step: int, node: str, only_in: str | None = None) -> None:
        self.step, self.node, self.only_in = step, node, only_in

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        if (trainer.global_step != self.step or os.environ.get("SLURMD_NODENAME") != self.node
                or os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
                or (self.only_in is not None and self.only_in not in str(trainer.default_root_dir))):
            return
        job = os.environ["SLURM_JOB_ID"].encode()
        mine = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                env = dict(e.split(b"=", 1) for e in environ.read_bytes().split(b"\0") if b"=" in e)
            except OSError:
                continue
            if env.get(b"SLURM_JOB_ID") == job and env.get(b"SLURMD_NODENAME") == self.node.encode():
                mine.append(int(environ.parent.name))
        for pid in sorted(mine, key=lambda p: p == os.getpid()):  # this process last
            os.kill(pid, signal.SIGKILL)


class HangRank(Callback):
    """In the job's first attempt, rank `rank` stops itself (SIGSTOP) before optimizer step `step`: a hung
    process, which the other ranks wait for in their next collective."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        if (trainer.global_step == self.step and trainer.global_rank == self.rank
                and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGSTOP)


class SlowSteps(Callback):
    """Sleeps `seconds` after every optimizer step (a test's time to act mid-run; the math is unchanged)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        time.sleep(self.seconds)


class SignalSelf(Callback):
    """Sends `signal` (a name: TERM, USR1) to this process after optimizer step `step`, as `kill` or Slurm would."""

    def __init__(self, step: int, signal: str = "TERM") -> None:
        self.step, self.signal = step, signal

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.signal}"))
