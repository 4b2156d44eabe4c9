"""Fault injection for the reliability tests: NaN gradients and loss spikes at chosen steps, and kill -9 of a
paused run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

from tests.helpers.multiproc import cpu_env


class InjectNaNGrad(Callback):
    """Makes the gradient of the first parameter of block `layer` NaN on rank `rank` at each of `steps`
    (update numbers: the update computed while global_step == s is step s+1). The hook sits on the parameter,
    so it fires before any gradient accumulation or reduction — under ZeRO the NaN reaches every rank's
    partition through the reduction, as a real overflow would; the loss stays finite."""

    def __init__(self, steps: list[int], rank: int = 0, layer: int = 1) -> None:
        self.steps, self.rank, self.layer = set(steps), rank, layer
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first_micro = batch_idx % trainer.accumulate_grad_batches == 0
        if first_micro and trainer.global_step + 1 in self.steps and trainer.global_rank == self.rank:
            param = next(pl_module.model.layers[self.layer].parameters())
            self._handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InjectLossSpike(Callback):
    """Multiplies the training loss by `factor`, on every rank and micro-batch of each of `steps` (update numbers),
    just before its backward — a loss spike, as after a burst of bad data, but sure to stand out on a tiny model
    that is still near uniform (where even random tokens barely raise the loss). It must come before the guard
    in the callback list (the CLI appends the guard after the configured callbacks)."""

    def __init__(self, steps: list[int], factor: float = 10.0) -> None:
        self.steps, self.factor = set(steps), factor

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step + 1 in self.steps:
            loss.mul_(self.factor)  # in place: the guard and the backward see the same, spiked loss


def kill_when_paused(args: list[str], cwd: Path, fault: str, marker: Path, timeout: float = 300) -> str:
    """Run `normlab <args>` with NORMLAB_FAULT=`fault` (a pause point, see training/callbacks/step_checkpoint.py); when the
    pause begins, SIGKILL the whole process group (every rank), as a preemption or OOM kill would.
    Returns the output. Fails if the run ended before pausing."""
    proc = subprocess.Popen([sys.executable, "-m", "training.cli", *args], cwd=cwd,
                            env=cpu_env(NORMLAB_FAULT=fault, NORMLAB_FAULT_MARKER=str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before pausing at {fault}:\n{proc.stdout.read()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no pause at {fault} within {timeout} s")
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds rank 0 and the ranks it spawned
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    return out


def signal_when_waiting(args: list[str], cwd: Path, marker: Path, log: Path, signum: int = signal.SIGTERM,
                        timeout: float = 300) -> int:
    """Run `normlab <args>` (its config attaches tests.helpers.callbacks.WaitForSignal with `marker`); when the
    waiting rank has written its process id to `marker`, send it `signum` — that process only — then let it go on.
    Returns the exit status; the output goes to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "training.cli", *args], cwd=cwd, env=cpu_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert marker.exists(), f"no rank waited for the signal:\n{log.read_text()[-4000:]}"
            os.kill(int(marker.read_text()), signum)
            marker.with_name(marker.name + ".sent").touch()
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
