"""Claim 7's speed half, measured where it can be resolved: the norm ops timed like for like, and the norms'
share of a training step read from `torch.profiler`.

Whole-step timing cannot show a norm's cost at this size (the norms are a fraction of a percent of the FLOPs,
and step times on a shared machine drift by tens of percent), and comparing a fused kernel of one norm with a
composite of the other compares kernels, not algorithms. So each judged pair is the same kind of code: the two
eager composites (what the formulas cost when written out in PyTorch), and two fused single-pass C++ kernels —
normlab's CPU RMSNorm (`model.kernels`, what training runs) and ATen's native `F.layer_norm`. `F.rms_norm` is
timed too, against `F.layer_norm`, for context only: in torch 2.13 it is not fused on CPU (it decomposes into
pow / mean / rsqrt / mul), so that ratio is a statement about ATen's CPU kernels, not about the algorithms.
Each round times both candidates and gives one ratio; which candidate goes first in a round is a seeded
shuffle, balanced within the run, so neither order nor a drift in load favours one. A run is the whole
measurement (fresh inputs or models, a warm-up round, then the rounds), repeated `Scale.timing_runs` times: the rounds
of one run share its machine state (caches, frequency, neighbours' load), so their spread understates how much a
repeated measurement moves; the judged sample is the per-run medians (`run_medians`), whose interval is the
between-run one (`between_run_estimate`).
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from model import Transformer, kernels
from model.kernels import reference
from model.norms import Norm
from training.stats import Estimate, estimate
from training.study.grid import Arch, Scale

EPS = 1e-5
# Autograd nodes of the norm backward passes: the fused C++ RMSNorm on CPU (its C++ autograd function,
# model/kernels/cpu_rms.cpp), the Triton kernels' (model.kernels.ops._Eager) and ATen's native LayerNorm.
NORM_BACKWARD_NODES = ("RMSNormFunction", "_EagerBackward", "NativeLayerNormBackward", "RmsNormBackward")


def composite_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) · w + b written out in eager PyTorch (the twin of reference.rms_norm)."""
    mean = x.mean(-1, keepdim=True)
    h = x - mean
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w + b


def _native_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w, b, EPS)


PAIRS: dict[str, tuple[Callable, Callable]] = {
    "composite": (lambda x, w, b: reference.rms_norm(x, w, EPS), composite_layer_norm),
    "fused": (lambda x, w, b: kernels.rms_norm(x, w, EPS), _native_layer_norm),
    "aten": (lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS), _native_layer_norm),
}


def fused_rms_available() -> bool:
    """Whether `kernels.rms_norm` runs normlab's fused C++ kernel here (it needs a C++ compiler; without one it
    falls back to the composite and the "fused" pair would compare a composite with a fused kernel)."""
    return kernels.cpu_rms.library() is not None


def _time(fn: Callable, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    t = time.perf_counter()
    for _ in range(repeats):
        fn(x, w, b).sum().backward()
    return (time.perf_counter() - t) / repeats


def round_orders(rounds: int, seed: int) -> list[bool]:
    """Per round, whether the first candidate is timed first: half the rounds each way (one more for the first
    when `rounds` is odd), in a seeded random order, so a drift in load within the run cannot line up with
    the order."""
    orders = [r < (rounds + 1) // 2 for r in range(rounds)]
    random.Random(seed).shuffle(orders)
    return orders


def _ratio(a_first: bool, a: Callable[[], float], b: Callable[[], float]) -> float:
    """Time a and b (seconds) in the given order; their ratio."""
    times = {fn: fn() for fn in ((a, b) if a_first else (b, a))}
    return times[a] / times[b]


def run_medians(runs: Sequence[Sequence[float]]) -> list[float]:
    """Per timing run, the median of its rounds' ratios: the sample a timing claim is judged on."""
    return [statistics.median(r) for r in runs]


def between_run_estimate(runs: Sequence[Sequence[float]]) -> Estimate:
    """The estimate of the log ratio over timing runs (`runs`: each run's per-round ratios), taken over the
    per-run medians: its interval carries the run-to-run variation that the rounds of a single run miss."""
    return estimate([math.log(m) for m in run_medians(runs)])


def op_ratios(shape: tuple[int, ...], rounds: int, runs: int, repeats: int = 5,
              seed: int = 0) -> dict[str, list[float]]:
    """Per pair, the median forward+backward time ratio RMSNorm / LayerNorm of each of `runs` timing runs (fp32,
    input of `shape`; each run a warm-up round and `rounds` rounds in `round_orders`)."""
    pairs = {name: pair for name, pair in PAIRS.items() if name != "fused" or fused_rms_available()}
    per_run: dict[str, list[list[float]]] = {name: [] for name in pairs}
    for run in range(runs):
        torch.manual_seed(run)
        x = torch.randn(shape, requires_grad=True)
        w, b = torch.ones(shape[-1], requires_grad=True), torch.zeros(shape[-1], requires_grad=True)
        orders = [True, *round_orders(rounds, seed * 1000 + run)]  # round 0 warms up
        ratios: dict[str, list[float]] = {name: [] for name in pairs}
        for r, a_first in enumerate(orders):  # round 0 warms up
            for name, (rms, ln) in pairs.items():
                ratio = _ratio(a_first, partial(_time, rms, x, w, b, repeats), partial(_time, ln, x, w, b, repeats))
                if r:
                    ratios[name].append(ratio)
        for name in pairs:
            per_run[name].append(ratios[name])
    return {name: run_medians(rs) for name, rs in per_run.items()}


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: torch 2.13's profiler (Kineto) writes two `USDT: ...
    profiler_start / profiler_stop` lines per profile from C++ straight to it, noise in the study's console that
    no environment variable turns off. Python's own `sys.stderr` is flushed first and restored after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _NormProfile:
    """A freshly built model of `arch` (seed 0) with its optimizer, whose norm calls carry a profiler range (module
    hooks); `step()` profiles one training step on `tokens`."""

    def __init__(self, arch: Arch, scale: Scale, vocab_size: int, tokens: torch.Tensor) -> None:
        torch.manual_seed(0)
        self.arch = arch
        self.model = Transformer(arch.config(scale, vocab_size))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = tokens
        ranges: list = []

        def enter(module, args):
            ranges.append(torch.autograd.profiler.record_function("study::norm_forward"))
            ranges[-1].__enter__()

        def leave(module, args, out):
            ranges.pop().__exit__(None, None, None)

        norms = [m for m in self.model.modules() if isinstance(m, Norm)]
        self.handles = [h for m in norms for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]

    def train_step(self) -> None:
        _train_step(self.model, self.opt, self.tokens)

    def step(self) -> tuple[float, float]:
        """One profiled training step: the norms' share of its CPU time and their time in seconds (forward norm
        calls plus their backward autograd nodes, over the step's range)."""
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with _native_stderr_silenced(), torch.profiler.profile(activities=cpu) as prof:
            with torch.autograd.profiler.record_function("study::step"):
                self.train_step()
        events = prof.events()
        total = sum(e.cpu_time_total for e in events if e.name == "study::step")
        fwd = sum(e.cpu_time_total for e in events if e.name == "study::norm_forward")
        bwd = sum(e.cpu_time_total for e in events
                  if e.name.startswith("autograd::engine::evaluate_function")
                  and any(n in e.name for n in NORM_BACKWARD_NODES))
        return (fwd + bwd) / total, (fwd + bwd) / 1e6

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def norm_time_ratios(arch: Arch, scale: Scale, vocab_size: int, tokens: torch.Tensor, rounds: int, runs: int,
                     seed: int = 0) -> tuple[list[float], dict[str, list[float]]]:
    """Claim 21's in-step measurement, timed like the others: per timing run (`runs` of them, each with freshly
    built RMSNorm and LayerNorm models of `arch`, a warm-up round and `rounds` rounds in `round_orders`, one
    profiled training step of each model per round), the median over its rounds of the norms' time per step,
    RMSNorm model / LayerNorm model. Also the norms' share of every judged profiled step, per norm."""
    medians: list[float] = []
    shares: dict[str, list[float]] = {"rmsnorm": [], "layernorm": []}
    for run in range(runs):
        profiles = {norm: _NormProfile(replace(arch, norm=norm), scale, vocab_size, tokens) for norm in shares}
        try:
            for p in profiles.values():
                p.train_step()  # outside any profile: the first step allocates the optimizer's state
            ratios = []
            for r, rms_first in enumerate([True, *round_orders(rounds, seed * 1000 + run)]):  # round 0 warms up
                got = {norm: profiles[norm].step()
                       for norm in (("rmsnorm", "layernorm") if rms_first else ("layernorm", "rmsnorm"))}
                if r:
                    ratios.append(got["rmsnorm"][1] / got["layernorm"][1])
                    for norm, (share, _) in got.items():
                        shares[norm].append(share)
            medians.append(statistics.median(ratios))
        finally:
            for p in profiles.values():
                p.close()
    return medians, shares


def step_time_ratios(arch_a: Arch, arch_b: Arch, scale: Scale, vocab_size: int, tokens: torch.Tensor, rounds: int,
                     runs: int, steps: int = 2, seed: int = 0) -> list[float]:
    """Per timing run (`runs` of them, each with freshly built models, a warm-up round and `rounds` rounds in
    `round_orders`), the median over its rounds of the time of `steps` training steps of `arch_a` over the same
    for `arch_b` (same seed, same batch)."""
    medians = []
    for run in range(runs):
        models = []
        for arch in (arch_a, arch_b):
            torch.manual_seed(0)
            model = Transformer(arch.config(scale, vocab_size))
            models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4)))
        orders = [True, *round_orders(rounds, seed * 1000 + run)]  # round 0 warms up
        ratios = [_ratio(first, partial(_train_time, *models[0], tokens, steps),
                         partial(_train_time, *models[1], tokens, steps)) for first in orders]
        medians.append(statistics.median(ratios[1:]))  # round 0 warms up
    return medians


def _train_step(model: Transformer, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    """One timed training step on `tokens` [B, T+1]: loss, backward, optimizer step (no clipping, no schedule)."""
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_time(model: Transformer, opt: torch.optim.Optimizer, tokens: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` training steps of `model` on `tokens`."""
    t = time.perf_counter()
    for _ in range(steps):
        _train_step(model, opt, tokens)
    return time.perf_counter() - t
