#!/usr/bin/env python
"""Cost of the training-health metrics: mean training-step time with metrics off and on, from one run.

"On" means what `normlab fit` does at the default interval: every `--every` steps (and step 0) the forward runs
with the probes' forward hooks attached (`model.probes.record`: residual RMS and update ratios, softmax
statistics and sink mass on sampled query rows, the stream's max/RMS and kurtosis), the per-layer gradient norms
and the norm gains are read after backward, and the depth-profile figure is rendered (matplotlib, Agg) as
`TrainingHealth` does for TensorBoard's Images tab; other steps run exactly as with metrics off. The script
times plain and metrics steps in back-to-back pairs and amortizes the difference over `--every` steps; it also
reports the figure's rendering time alone.

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

    def step(probe: bool) -> None:
        if probe:
            with record(model) as rec:
                loss = model(x[:, :-1], targets=x[:, 1:])
            loss.backward()
            values = {**rec.scalars(), **grad_norms(model), **norm_gains(model)}
            profile = depth_profile.profile_values(values)
            assert profile
            t = time.perf_counter()
            image = depth_profile.render(profile, 50, profile0 or profile)
            render_times.append(time.perf_counter() - t)
            assert image.size
            profile0.update(profile0 or profile)
        else:
            model(x[:, :-1], targets=x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step(False)
    step(True)
    # Pairs of (plain step, metrics step), back to back: their difference is what one metrics step adds, and
    # pairing cancels most of the load from other processes on a shared machine.
    plain, extra = [], []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        step(False)
        t1 = time.perf_counter()
        step(True)
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        extra.append((t2 - t1) - (t1 - t0))
    base, added = statistics.median(plain), statistics.median(extra)
    overhead = added / (args.every * base)  # one metrics step per `every` steps
    print(f"model: dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"{torch.get_num_threads()} threads; {args.pairs} pairs; load average {os.getloadavg()[0]:.1f}")
    print(f"median plain step {base * 1e3:.1f} ms; a metrics step adds {added * 1e3:.1f} ms "
          f"({added / base:+.1%} of one step)")
    print(f"of which the depth-profile figure: median {statistics.median(render_times) * 1e3:.1f} ms to render")
    print(f"overhead at one metrics step every {args.every}: {overhead:+.2%} (target <= 2%)")


if __name__ == "__main__":
    main()
