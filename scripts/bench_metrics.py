#!/usr/bin/env python
"""Cost of the training-health metrics: mean training-step time with metrics off and on, from one run.

"On" means what `normlab fit` does at the default interval: every `--every` steps (and step 0) the forward runs
with the probes' forward hooks attached (`model.probes.record`: residual RMS and update ratios, softmax
statistics and sink mass on sampled query rows, the stream's max/RMS and kurtosis), the per-layer gradient norms
and the norm gains are read after backward, and the depth-profile figure is rendered (matplotlib, Agg) as
`TrainingHealth` does for TensorBoard's Images tab; the stability telemetry (training/callbacks/stability.py: the
exact per-layer max logit in the probed forward, ‖update‖/‖param‖ per block and group around the optimizer step)
runs with them. Other steps run exactly as with metrics off. The script times a plain step, a metrics step
without the stability telemetry and one with it back to back, and amortizes the differences over `--every`
steps — so one run gives the whole overhead and the stability telemetry's share of it, on the same machine
load; it also reports the figure's rendering time alone.

    python scripts/bench_metrics.py                 # the default job's model (dim 256, 4 layers, seq 256, batch 8)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model import ModelConfig, Transformer  # noqa: E402
from model.probes import grad_norms, norm_gains, record  # noqa: E402
from training.callbacks import depth_profile  # noqa: E402
from training.callbacks.stability import StabilityProbe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--every", type=int, default=50, help="metrics interval (the default of --metrics.every_n_steps)")
    ap.add_argument("--pairs", type=int, default=15, help="(plain step, metrics step) pairs to time")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    profile0: dict[str, float] = {}
    render_times: list[float] = []

    stability = StabilityProbe()

    def step(probe: bool, stable: bool = True) -> None:
        if probe:
            if stable:
                stability.start(model)
            with record(model) as rec:
                loss = model(x[:, :-1], targets=x[:, 1:])
            exact = stability.logits() if stable else {}
            loss.backward()
            values = {**rec.scalars(), **grad_norms(model), **norm_gains(model),
                      **{k: v.item() for k, v in exact.items()}}
            profile = depth_profile.profile_values(values)
            assert profile
            t = time.perf_counter()
            image = depth_profile.render(profile, 50, profile0 or profile)
            render_times.append(time.perf_counter() - t)
            assert image.size
            profile0.update(profile0 or profile)
        else:
            model(x[:, :-1], targets=x[:, 1:]).backward()
        if probe and stable:
            stability.before_step(model, deepspeed=False)
        opt.step()
        if probe and stable:
            assert stability.after_step(model, deepspeed=False)
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step(False)
    step(True)
    # Triples of (plain step, metrics step without and with the stability telemetry), back to back: their
    # differences are what one metrics step adds, and keeping them together cancels most of the load from other
    # processes on a shared machine.
    plain, extra, without = [], [], []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        step(False)
        t1 = time.perf_counter()
        step(True, stable=False)
        t2 = time.perf_counter()
        step(True)
        t3 = time.perf_counter()
        plain.append(t1 - t0)
        without.append((t2 - t1) - (t1 - t0))
        extra.append((t3 - t2) - (t1 - t0))
    base, added = statistics.median(plain), statistics.median(extra)
    overhead = added / (args.every * base)  # one metrics step per `every` steps
    stable = statistics.median(e - w for e, w in zip(extra, without, strict=True))
    print(f"model: dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"{torch.get_num_threads()} threads; {args.pairs} pairs; load average {os.getloadavg()[0]:.1f}")
    print(f"median plain step {base * 1e3:.1f} ms; a metrics step adds {added * 1e3:.1f} ms "
          f"({added / base:+.1%} of one step)")
    print(f"of which the depth-profile figure: median {statistics.median(render_times) * 1e3:.1f} ms to render")
    print(f"of which the stability telemetry (exact max logits, update/param ratios): median {stable * 1e3:.1f} ms, "
          f"{stable / (args.every * base):+.2%} at one metrics step every {args.every}")
    print(f"overhead at one metrics step every {args.every}: {overhead:+.2%} (target <= 2%)")


if __name__ == "__main__":
    main()
