"""Benchmark the norm kernels.

    python scripts/bench_norms.py cpu [--threads 1] [--rounds 20] [--widths 64 128 256 512 1024] [--clock cpu]
    python scripts/bench_norms.py cpu-candidates [--threads 1] [--rounds 30]
    python scripts/bench_norms.py gpu [--rows 32768] [--hidden 1024 2048 4096 8192]

cpu: normlab's RMSNorm (what `kernels: auto` runs on CPU) against ATen's `F.layer_norm`, forward+backward, fp32,
as ratios measured side by side (RMSNorm / LayerNorm; < 1: RMSNorm cheaper). Alone: the op on an input
(batch 8, seq 256, width) for each width — width 256 is the default fit's shape (configs/default.yaml) — and
(8, 64, 64), the study's trained shape; plain and with the residual add the pre-norm placement fuses into it
(LayerNorm: x + r, then `F.layer_norm`). In the model: the norms' time per training step of a 2-layer Llama-style
model (4 layers at the default fit's shape) with RMSNorm against the same model with LayerNorm, read from
`torch.profiler` as the study's claim 21 reads it (the norm modules' forward ranges plus their backward nodes),
at seq 64 for each width and at the default fit's shape. The two candidates alternate within each round, so load
hits both alike; each round gives one ratio, and the table shows the median and the range over rounds. Target:
every ratio ≤ 1.

cpu-candidates: RMSNorm and LayerNorm, forward and forward+backward, fp32 and bf16, shape (8, 512, 768). Our CPU
path (`backend="auto"`) against the eager composite, `F.rms_norm`, the `torch.compile`d composite and the native
`F.layer_norm`. All candidates run interleaved, round after round, in one process: this machine is shared and its
timings drift, so only ratios from one run mean anything (the order is shuffled every round).

gpu: effective bandwidth = minimal bytes / time (forward 2·s bytes per element, backward 3·s, fused add 4·s;
s = element size) in bf16 with the L2 flushed before every launch (`triton.testing.do_bench`), as a
percentage of a device-to-device copy measured in the same run; then times against torch eager,
`torch.compile` and Liger-Kernel (if importable). Targets: forward and fused-add forward >= 90% of the copy,
backward >= 75%, and >= 1.0x torch.compile.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from model import ModelConfig, Transformer  # noqa: E402
from model.kernels import layer_norm, reference, rms_norm  # noqa: E402
from model.norms import Norm  # noqa: E402
from training.study.timing import NORM_BACKWARD_NODES  # noqa: E402  (what the study counts as a norm's backward)

EPS = 1e-6


# ----------------------------------------------------------------------------------------------- CPU
def _composite_layer_norm(x, w, b):
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + EPS)
    return (h * w + b).to(x.dtype)


def _ratios(a: Callable[[], object], b: Callable[[], object], rounds: int, repeats: int = 1,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Per round, the time of `repeats` calls of a over the same for b, in an order that alternates from round
    to round so that load drift hits both alike (after one warm-up round)."""
    out = []
    for r in range(rounds + 1):
        order = (a, b) if r % 2 else (b, a)
        times = {fn: _timed(lambda fn=fn: [fn() for _ in range(repeats)], clock) for fn in order}
        out.append(times[a] / times[b])
    return out[1:]


def _alone(shape: tuple[int, ...], fused_add: bool) -> tuple[Callable, Callable]:
    """Forward+backward of our RMSNorm and of `F.layer_norm` on one input, as the model calls them: with
    `fused_add` the norm of x + r, both the sum and the norm taking part in the backward."""
    gen = torch.Generator().manual_seed(0)
    x, r, dy, dh = (torch.randn(shape, generator=gen) for _ in range(4))
    x.requires_grad_(), r.requires_grad_()
    w = torch.ones(shape[-1], requires_grad=True)

    def rms():
        out = rms_norm(x, w, EPS, residual=r) if fused_add else (rms_norm(x, w, EPS),)
        torch.autograd.backward(list(out), [dy, dh][:len(out)])

    def ln():
        h = x + r if fused_add else x
        out = (F.layer_norm(h, shape[-1:], w, None, EPS), h)[:1 + fused_add]
        torch.autograd.backward(list(out), [dy, dh][:len(out)])

    return rms, ln


def _model_norm_seconds(cfg: ModelConfig, tokens: torch.Tensor) -> Callable[[], float]:
    """A function that runs one training step of a model with `cfg` under `torch.profiler` and returns the
    norms' time in it: the norm modules' forward ranges plus their backward nodes (as the study's claim 21)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ranges: list = []

    def enter(module, args):
        ranges.append(torch.autograd.profiler.record_function("bench::norm_forward"))
        ranges[-1].__enter__()

    for m in model.modules():
        if isinstance(m, Norm):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(lambda module, args, out: ranges.pop().__exit__(None, None, None))

    def step() -> float:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(e.cpu_time_total for e in prof.events() if e.name == "bench::norm_forward" or (
            e.name.startswith("autograd::engine::evaluate_function")
            and any(node in e.name for node in NORM_BACKWARD_NODES))) / 1e6

    step()  # warm-up
    return step


def _model_ratios(width: int, seq: int, layers: int, rounds: int) -> list[float]:
    def config(norm: str) -> ModelConfig:  # the default fit's model (llama preset, head dim 32), norm swapped
        return ModelConfig.preset("llama", vocab_size=512, dim=width, n_layers=layers, n_heads=max(1, width // 32),
                                  max_seq_len=seq, norm=norm)
    tokens = torch.randint(0, 512, (8, seq + 1), generator=torch.Generator().manual_seed(0))
    rms, ln = (_model_norm_seconds(config(norm), tokens) for norm in ("rmsnorm", "layernorm"))
    out = []
    for r in range(rounds):
        times = {fn: fn() for fn in ((rms, ln) if r % 2 else (ln, rms))}
        out.append(times[rms] / times[ln])
    return out


def bench_cpu(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"# RMSNorm / LayerNorm, forward+backward, fp32, {args.threads} thread(s), {args.rounds} rounds, "
          f"{args.clock} clock (ops alone), torch {torch.__version__}; ratio < 1: RMSNorm cheaper")
    print("\n| where | shape (batch, seq, width) | median ratio | range over rounds |\n|---|---|---|---|")

    def row(where: str, shape: tuple[int, ...], ratios: list[float]) -> None:
        print(f"| {where} | {shape} | {statistics.median(ratios):.2f} | {min(ratios):.2f}–{max(ratios):.2f} |",
              flush=True)

    shapes = [(8, 64, 64)] + [(8, 256, w) for w in args.widths]
    for fused_add in (False, True):
        for shape in shapes:
            repeats = max(1, 2_000_000 // (shape[0] * shape[1] * shape[2]))  # ≳ 5 ms per timing
            row("alone, with the residual add" if fused_add else "alone", shape,
                _ratios(*_alone(shape, fused_add), args.rounds, repeats, clock))
    model_rounds = max(3, args.rounds // 2)  # a training step per sample: fewer rounds
    for width in args.widths:
        row("in a 2-layer model", (8, 64, width), _model_ratios(width, 64, 2, model_rounds))
    row("in the default fit's model (4 layers)", (8, 256, 256), _model_ratios(256, 256, 4, model_rounds))


def _cpu_candidates() -> dict[str, dict[str, Callable]]:
    """kind → name → f(x, w, b) -> y. The first entry of each kind is ours."""
    compiled_rms = torch.compile(lambda x, w: reference.rms_norm(x, w, EPS), dynamic=False)
    compiled_ln = torch.compile(_composite_layer_norm, dynamic=False)
    return {
        "rmsnorm": {
            "ours (auto)": lambda x, w, b: rms_norm(x, w, EPS, backend="auto"),
            "eager composite": lambda x, w, b: reference.rms_norm(x, w, EPS),
            "F.rms_norm": lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS),
            "torch.compile composite": lambda x, w, b: compiled_rms(x, w),
            "F.layer_norm (native)": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS),
        },
        "layernorm": {
            "ours (auto)": lambda x, w, b: layer_norm(x, w, b, EPS, backend="auto"),
            "eager composite": _composite_layer_norm,
            "torch.compile composite": compiled_ln,
        },
    }


def _timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def bench_cpu_candidates(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    # process CPU time ignores the time other jobs hold the cores (summed over threads: use it with 1 thread)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"# CPU norms, shape {tuple(args.shape)}, {args.threads} thread(s), {args.rounds} shuffled rounds, "
          f"{args.clock} clock, torch {torch.__version__}")
    candidates = _cpu_candidates()
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(*args.shape, generator=gen).to(dtype)
        w, b = (torch.randn(args.shape[-1], generator=gen).to(dtype) for _ in range(2))
        dy = torch.randn(*args.shape, generator=gen).to(dtype)
        for kind, fns in candidates.items():
            runs: dict[tuple[str, str], Callable] = {}
            for name, f in fns.items():
                def forward(f=f):
                    with torch.no_grad():
                        f(x, w, b)

                def forward_backward(f=f):
                    xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
                    f(xg, wg, bg).backward(dy)

                runs[(name, "fwd")], runs[(name, "fwd+bwd")] = forward, forward_backward
            for fn in runs.values():  # warm-up (and compile)
                fn(), fn()
            times = {key: [] for key in runs}
            order, shuffle = list(runs), random.Random(0).shuffle
            for _ in range(args.rounds):
                shuffle(order)  # a fresh order each round: no candidate always inherits another's freed memory
                for key in order:
                    times[key].append(_timed(runs[key], clock))
            _print_cpu_table(kind, dtype, times)


def _print_cpu_table(kind: str, dtype: torch.dtype, times: dict[tuple[str, str], list[float]]) -> None:
    names = list(dict.fromkeys(name for name, _ in times))
    print(f"\n## {kind} {str(dtype).removeprefix('torch.')}: median ms (min ms); ratio = its median / ours")
    print("| candidate | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio |")
    print("|---|---|---|---|---|")
    ours = {p: statistics.median(times[(names[0], p)]) for p in ("fwd", "fwd+bwd")}
    for name in names:
        cells = []
        for p in ("fwd", "fwd+bwd"):
            med, low = statistics.median(times[(name, p)]), min(times[(name, p)])
            cells += [f"{med * 1e3:.2f} ({low * 1e3:.2f})", f"{med / ours[p]:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------------------------- GPU
def _liger():
    try:
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except Exception as error:  # not installed, or an incompatible version
        print(f"# Liger-Kernel not importable ({type(error).__name__}: {error}); skipped")
        return None
    return LigerRMSNorm, LigerLayerNorm


def _eager_add_rms(x, r, w):
    h = x + r
    return reference.rms_norm(h, w, EPS), h


def bench_gpu(args: argparse.Namespace) -> None:
    from triton.testing import do_bench  # flushes L2 (writes a 256 MB buffer) before every measured call

    from model.kernels.triton_norm import norm_bwd, norm_fwd  # the launchers themselves, without autograd

    dev, dtype, s = torch.device(args.device), torch.bfloat16, 2
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU DRY RUN (interpreter: numbers meaningless)"
    print(f"# GPU norms, {name}, bf16, rows={args.rows}, torch {torch.__version__}", flush=True)

    def ms(fn, grad_to_none=None):
        if dev.type == "cuda":
            return do_bench(fn, warmup=25, rep=args.rep_ms, grad_to_none=grad_to_none, return_mode="median")
        return statistics.median(_timed(fn) for _ in range(3)) * 1e3  # --device cpu: checks the script only

    liger = _liger()
    torch._dynamo.config.recompile_limit = 64  # one graph per hidden size (the default limit is 8)
    compiled = {  # static shapes: one graph per hidden size, as a training run would have
        "rms": torch.compile(lambda x, w: reference.rms_norm(x, w, EPS), dynamic=False),
        "add+rms": torch.compile(_eager_add_rms, dynamic=False),
        "ln": torch.compile(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS), dynamic=False),
    }
    for n in args.hidden:
        numel = args.rows * n
        x, r, dy, dh = (torch.randn(args.rows, n, device=dev, dtype=dtype) for _ in range(4))
        w = (1 + 0.1 * torch.randn(n, device=dev)).to(dtype)
        b = (0.1 * torch.randn(n, device=dev)).to(dtype)
        dst = torch.empty_like(x)
        no_mean = torch.empty(0, device=dev)
        _, _, _, rstd = norm_fwd(x, w, None, None, EPS, 0.0, True, False)
        _, h, _, rstd_h = norm_fwd(x, w, None, r, EPS, 0.0, True, False)
        _, _, mean_ln, rstd_ln = norm_fwd(x, w, b, None, EPS, 0.0, False, False)
        kernels = {  # name: (bytes per element / s, fn)
            "device-to-device copy": (2, lambda: dst.copy_(x)),
            "rmsnorm fwd": (2, lambda: norm_fwd(x, w, None, None, EPS, 0.0, True, False)),
            "rmsnorm bwd (dx, dw)": (3, lambda: norm_bwd(dy, None, x, w, None, no_mean, rstd, 0.0, True, False)),
            "add+rmsnorm fwd": (4, lambda: norm_fwd(x, w, None, r, EPS, 0.0, True, False)),
            "add+rmsnorm bwd": (4, lambda: norm_bwd(dy, dh, h, w, None, no_mean, rstd_h, 0.0, True, False)),
            "layernorm fwd": (2, lambda: norm_fwd(x, w, b, None, EPS, 0.0, False, False)),
            "layernorm bwd (dx, dw, db)": (3, lambda: norm_bwd(dy, None, x, w, b, mean_ln, rstd_ln, 0.0, False, False)),
        }
        print(f"\n## hidden {n}: effective bandwidth (minimal bytes / median time, L2 flushed)")
        print("| kernel | ms | GB/s | % of copy |")
        print("|---|---|---|---|")
        copy_bw = None
        for name, (bytes_per_elem, fn) in kernels.items():
            t = ms(fn)
            bw = bytes_per_elem * s * numel / t / 1e6
            copy_bw = copy_bw or bw
            print(f"| {name} | {t:.4f} | {bw:.0f} | {100 * bw / copy_bw:.1f}% |", flush=True)
        print(f"\n## hidden {n}: whole calls, inputs requiring grad; ratio = other / ours (> 1: ours faster)")
        print("| op | pass | ours ms | other | other ms | ratio |")
        print("|---|---|---|---|---|---|")
        _gpu_comparisons(n, x, r, w, b, dy, ms, liger, compiled)


def _gpu_comparisons(n, x, r, w, b, dy, ms, liger, compiled) -> None:
    cases = {
        "rmsnorm": (lambda x, w: rms_norm(x, w, EPS, backend="triton"), {
            "torch eager": lambda x, w: reference.rms_norm(x, w, EPS),
            "F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS),
            "torch.compile": compiled["rms"],
        }),
        "add+rmsnorm": (lambda x, w: rms_norm(x, w, EPS, residual=r, backend="triton"), {
            "torch eager": lambda x, w: _eager_add_rms(x, r, w),
            "torch.compile": lambda x, w: compiled["add+rms"](x, r, w),
        }),
        "layernorm": (lambda x, w: layer_norm(x, w, b, EPS, backend="triton"), {
            "torch eager": lambda x, w: F.layer_norm(x, x.shape[-1:], w, b, EPS),
            "torch.compile": lambda x, w: compiled["ln"](x, w, b),
        }),
    }
    if liger is not None:
        rms_module = liger[0](n, eps=EPS).to(x.device, x.dtype)
        ln_module = liger[1](n, eps=EPS).to(x.device, x.dtype)
        cases["rmsnorm"][1]["Liger-Kernel"] = lambda x, w: rms_module(x)
        cases["layernorm"][1]["Liger-Kernel"] = lambda x, w: ln_module(x)

    def loss(out):  # with the fused add, both outputs take part in the backward
        return out[0].float().sum() + out[1].float().sum() if isinstance(out, tuple) else (out * dy).float().sum()

    for op, (ours, others) in cases.items():
        timings = {}
        for name, f in {"ours": ours, **others}.items():
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            try:  # the forward as in training (inputs need grad): one compiled graph pair per size
                fwd = ms(lambda: f(xg, wg))
                both = ms(lambda: loss(f(xg, wg)).backward(), grad_to_none=[xg, wg])
            except Exception as error:  # e.g. a Liger version with another signature
                print(f"| {op} | - | - | {name} | failed: {type(error).__name__}: {str(error)[:80]} | - |")
                continue
            timings[name] = {"fwd": fwd, "fwd+bwd": both}
            if name != "ours" and "ours" in timings:
                for p, t in timings[name].items():
                    mine = timings["ours"][p]
                    print(f"| {op} | {p} | {mine:.4f} | {name} | {t:.4f} | {t / mine:.2f}x |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    cpu.add_argument("--threads", type=int, default=torch.get_num_threads())
    cpu.add_argument("--rounds", type=int, default=20)
    cpu.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                     help="ops alone: cpu = process CPU time, robust to other jobs on a shared machine (1 thread)")
    detail = sub.add_parser("cpu-candidates")
    detail.add_argument("--shape", type=int, nargs="+", default=[8, 512, 768])
    detail.add_argument("--threads", type=int, default=torch.get_num_threads())
    detail.add_argument("--rounds", type=int, default=30)
    detail.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time, robust to other jobs on a shared machine (with --threads 1)")
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--rows", type=int, default=32768)
    gpu.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    gpu.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (do_bench `rep`)")
    gpu.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                     help="cpu: a dry run of this script under TRITON_INTERPRET=1 (tiny --rows), no timings")
    args = parser.parse_args(argv)
    if args.mode == "cpu":
        bench_cpu(args)
    elif args.mode == "cpu-candidates":
        bench_cpu_candidates(args)
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_norms.py gpu: no CUDA device")
    else:
        bench_gpu(args)


if __name__ == "__main__":
    main()
