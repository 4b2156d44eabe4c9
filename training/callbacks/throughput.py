"""Tokens per second and model FLOPs utilization (MFU), logged every optimizer step.

FLOPs per token come from the model config (`ModelConfig.flops_per_token`: 6N + attention), never from
counting `numel()` of live parameters, which is 0 for partitioned parameters under ZeRO-3.

MFU = achieved model FLOP/s per device ÷ peak FLOP/s per device. The peak is `peak_tflops` when given, else
the datasheet value Lightning knows for the GPU and compute dtype, else a matmul measured once at start-up on
the training device in the compute dtype — on a CPU, which has no datasheet, and on GPUs missing from
Lightning's table (the H200 in Lightning 2.6). A measured peak is an achievable GEMM rate, below the datasheet
(an H200 measures ~790 of its 989 bf16 TFLOP/s), so MFU reads higher against it; `throughput/peak_tflops`
records which peak was used.

`throughput/max_memory_gb` (GPUs only): the peak memory the CUDA caching allocator has handed out on this rank's
device since the start of the process, in GB (1e9 bytes) — `torch.cuda.max_memory_allocated`, which is what the
model, activations and optimizer state need (the allocator's reserved pool, `nvidia-smi`'s figure, is larger).

Tokens/s counts the time of checkpoint saves (part of what training costs) but not of validation.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from training.eval.metrics import split_batch
from training.loggers import log_scalars

log = logging.getLogger(__name__)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The best FLOP/s of a square matmul on `device` in `dtype` (CPU: with this process's thread count)."""
    n = 4096 if device.type == "cuda" else 1024
    generator = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(7):
        sync()
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i >= 2:  # after warm-up (kernel selection, clocks)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def compute_dtype(precision: str) -> torch.dtype:
    if "bf16" in precision:
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


class Throughput(Callback):
    """Logs `throughput/tokens_per_sec` (all ranks together) and `throughput/mfu`, averaged over the last
    `window` optimizer steps (from the second step of a run on), excluding time spent in validation."""

    def __init__(self, window: int = 10, peak_tflops: float | None = None) -> None:
        self.window = window
        self.peak_tflops = peak_tflops
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)  # (train time, tokens) at step ends
        self._tokens = 0  # this rank's tokens since the run started
        self._val_time = 0.0  # validation time to leave out of the train clock
        self._val_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._peak = self._peak_flops(trainer)
        self._marks.clear()
        self._tokens, self._val_time = 0, 0.0
        self._last_step = trainer.global_step
        if trainer.is_global_zero:
            log.info("MFU is relative to %.3g peak FLOP/s per device", self._peak)
        log_scalars(trainer, {"throughput/peak_tflops": self._peak / 1e12}, trainer.global_step)

    def _peak_flops(self, trainer: Trainer) -> float:
        if self.peak_tflops:
            return self.peak_tflops * 1e12
        device, dtype = trainer.strategy.root_device, compute_dtype(str(trainer.precision))
        if device.type == "cuda":
            peak = get_available_flops(device, dtype)
            if peak:
                return float(peak)
        return measure_matmul_flops(device, dtype)

    def _train_clock(self) -> float:
        return time.perf_counter() - self._val_time

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # (a sanity check before training is reset in on_train_start)
            self._val_time += time.perf_counter() - self._val_start

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        tokens, _ = split_batch(batch)  # (a dict under document masking)
        self._tokens += tokens.shape[0] * (tokens.shape[1] - 1)  # inputs are tokens[:, :-1]
        if trainer.global_step == self._last_step:
            return  # still accumulating gradients: no optimizer step yet
        self._last_step = trainer.global_step
        # The first mark is the end of this run's first step: that step also pays for warm-up (allocations,
        # first collectives) and would drag the average for the whole window.
        self._marks.append((self._train_clock(), self._tokens))
        if len(self._marks) < 2:
            return
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        tokens_per_sec = trainer.world_size * (n1 - n0) / max(t1 - t0, 1e-9)
        flops_per_token = pl_module.config.flops_per_token(tokens.shape[1] - 1)
        mfu = tokens_per_sec * flops_per_token / (self._peak * trainer.world_size)
        pl_module.log("throughput/tokens_per_sec", tokens_per_sec)
        pl_module.log("throughput/mfu", mfu)
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the allocator's high-water mark (a host-side counter: no sync)
            pl_module.log("throughput/max_memory_gb", torch.cuda.max_memory_allocated(device) / 1e9)
        # Short name for the progress bar, as a host tensor: Lightning reads every progress-bar value back after
        # every batch, which for a float it would have put on the GPU is a sync.
        pl_module.log("tok/s", torch.tensor(tokens_per_sec), prog_bar=True, logger=False)
