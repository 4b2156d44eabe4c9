#!/usr/bin/env python
"""Training-step throughput: normlab's Transformer vs transformers.LlamaForCausalLM, same weights and batch.

Both models run forward + backward + AdamW step, alternating in one process for several rounds; the script
prints median tokens/s, the ratio, activation memory per token (bytes of tensors saved for backward, counted
with saved-tensor hooks, so the number is the same on CPU and GPU), and the achieved fraction of the matmul
ceiling measured in the same run. Also measures activation checkpointing (memory and speed) and, optionally,
regional torch.compile.

    python scripts/bench_train.py                      # CPU fp32, the ~8M config of the performance issue
    python scripts/bench_train.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 --heads 16 \
        --seq 2048 --batch 8 --vocab 32768 --only-normlab --compile --train-seconds 120   # ~350M, MFU

On a GPU, bf16 means bf16-mixed as training uses it: fp32 weights and optimizer, autocast to bf16.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import ModelConfig, Transformer  # noqa: E402
from model.hf_compat import to_hf  # noqa: E402
from model.optimize import compile_blocks, enable_activation_checkpointing  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The device, dtype and Llama-style model/batch flags shared by the training benchmarks."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)


def training_step(args: argparse.Namespace) -> tuple[ModelConfig, Callable[[], torch.Tensor]]:
    """normlab's model from the flags (regionally compiled with --compile), fused AdamW and bf16 autocast for
    --dtype bfloat16 (bf16-mixed, as training uses it); returns the config and one training step on random
    tokens, which returns its loss."""
    dev = args.device
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = ModelConfig.preset("llama", vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq)
    model = Transformer(cfg).to(dev)
    if args.compile:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step() -> torch.Tensor:
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev)
        with amp:
            loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return cfg, step


def matmul_ceiling(device: str, dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    """FLOP/s of a square matmul — the practical ceiling for a matmul-bound step on this device."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def activation_bytes(step_forward) -> int:
    """Bytes of distinct tensors autograd saves for backward during one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_forward()
    loss.backward()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model per round")
    ap.add_argument("--compile", action="store_true", help="also time regional torch.compile")
    ap.add_argument("--only-normlab", action="store_true", help="skip the transformers baseline and variants")
    ap.add_argument("--train-seconds", type=float, default=0.0,
                    help="with --only-normlab: train this long and report tokens/s and MFU")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense peak of the device for MFU (H100/H200 bf16: 989)")
    args = ap.parse_args()
    if args.only_normlab:
        return train_for(args)

    dev, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = ModelConfig.preset("llama", vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq)
    ours = Transformer(cfg)
    hf = to_hf(ours).train()
    ours, hf = ours.to(dev, dtype), hf.to(dev, dtype)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    tokens = args.batch * args.seq

    def ours_fwd(m=ours):
        return m(x, targets=y)

    def hf_fwd():
        return F.cross_entropy(hf(x).logits.float().flatten(0, 1), y.flatten())

    fused = dev == "cuda" or dev == "cpu"
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=fused)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)  # the default a transformers user gets (foreach)

    def step(fwd, opt):
        opt.zero_grad(set_to_none=True)
        fwd().backward()
        opt.step()

    variants = {"hf": (hf_fwd, opt_hf), "normlab": (ours_fwd, opt_ours)}
    if args.compile:
        compiled = compile_blocks(Transformer(cfg).to(dev, dtype))
        variants["normlab+compile"] = (lambda: compiled(x, targets=y),
                                       torch.optim.AdamW(compiled.parameters(), lr=1e-4, fused=fused))
    ckpt = enable_activation_checkpointing(Transformer(cfg).to(dev, dtype))
    variants["normlab+act-ckpt"] = (lambda: ckpt(x, targets=y),
                                    torch.optim.AdamW(ckpt.parameters(), lr=1e-4, fused=fused))

    for fwd, opt in variants.values():  # warm-up (and compile)
        step(fwd, opt)
        step(fwd, opt)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (fwd, opt) in variants.items():
            sync(dev)
            t = time.perf_counter()
            for _ in range(args.steps):
                step(fwd, opt)
            sync(dev)
            times[name].append((time.perf_counter() - t) / args.steps)

    ceiling = matmul_ceiling(dev, dtype)
    flops_tok = cfg.flops_per_token(args.seq)
    mem = {name: activation_bytes(fwd) / tokens for name, (fwd, _) in variants.items()}
    base = statistics.median(times["hf"])
    print(f"config: dim={args.dim} layers={args.layers} seq={args.seq} batch={args.batch} vocab={args.vocab} "
          f"params={cfg.num_params() / 1e6:.1f}M device={dev} dtype={args.dtype} threads={torch.get_num_threads()}")
    print(f"matmul ceiling measured in this run: {ceiling / 1e9:.1f} GFLOP/s")
    print(f"{'variant':<18}{'s/step':>9}{'tokens/s':>11}{'vs HF':>8}{'of ceiling':>12}{'act. bytes/token':>18}")
    for name in variants:
        med = statistics.median(times[name])
        tps = tokens / med
        print(f"{name:<18}{med:>9.3f}{tps:>11.0f}{base / med:>7.2f}x{tps * flops_tok / ceiling:>11.0%}"
              f"{mem[name]:>18,.0f}")
    print(f"activation checkpointing: {mem['normlab'] / mem['normlab+act-ckpt']:.1f}x less activation memory, "
          f"{statistics.median(times['normlab+act-ckpt']) / statistics.median(times['normlab']):.2f}x step time")
    if dev == "cuda":
        print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


def train_for(args: argparse.Namespace) -> None:
    """Train normlab's model alone for --train-seconds (random tokens) and print tokens/s and MFU."""
    dev = args.device
    cfg, step = training_step(args)
    tokens = args.batch * args.seq
    print(f"training {cfg.num_params() / 1e6:.0f}M params, {tokens} tokens/step, device={dev} dtype={args.dtype} "
          f"compile={args.compile}", flush=True)

    for _ in range(3):  # warm-up and compile
        step()
    sync(dev)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.train_seconds or steps < 5:
        loss = step()
        steps += 1
        if steps % 20 == 0:
            sync(dev)
            el = time.perf_counter() - t0
            print(f"step {steps}: loss {loss.item():.3f}, {steps * tokens / el:,.0f} tokens/s", flush=True)
    sync(dev)
    elapsed = time.perf_counter() - t0
    tps = steps * tokens / elapsed
    mfu = tps * cfg.flops_per_token(args.seq) / (args.peak_tflops * 1e12)
    print(f"RESULT: {steps} steps in {elapsed:.1f}s: {tps:,.0f} tokens/s, MFU {mfu:.1%} of {args.peak_tflops:.0f} "
          f"TFLOP/s (FLOPs/token {cfg.flops_per_token(args.seq) / 1e9:.2f} G from the config)")
    if dev == "cuda":
        print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
