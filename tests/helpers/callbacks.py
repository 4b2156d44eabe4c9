"""Test-only callbacks, attached to real runs through a YAML config (`trainer.callbacks`)."""
from __future__ import annotations

import json
import os
import random
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
