"""`normlab coordcheck`: does an activation's size stay put as the model gets wider? (μP's coordinate check)

For each configuration (placement × norm × parametrization) and each width, train a fresh model a few AdamW steps
at one fixed LR on a fixed batch of random tokens, then measure, on that batch, the per-layer RMS of the residual
stream (block output), of the attention and MLP outputs (what each adds to the stream; under post-norm f(x) itself)
and of the logits — through model/probes.py's hooks. Each quantity's slope of log RMS against log width is fitted
by least squares: under a working μP every slope is ≈ 0 (coordinates stay Θ(1)); under the standard
parametrization the logits grow with width (slope ≈ 1 under Adam: each step moves every one of the `width`
coordinates a readout row sums). This is the check that caught gpt-neox's silently broken μP (#956); Yang et al.
2022 (Tensor Programs V) §D.1 describe it. Writes `coordcheck.png` (one row per configuration, one log-log panel
per quantity, one line per layer), `coordcheck.md` (the table of slopes) and `coordcheck.json` (every value).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from data.atomic import write_text_atomic
from model import ModelConfig, Transformer
from model.probes import record, token_rms
from training import health_tags as T
from training.errors import UserError
from training.optim import OptimConfig, build_optimizer
from training.plotting import pyplot, save_figure

log = logging.getLogger(__name__)
QUANTITIES = ("stream", "attn", "mlp", "logits")
_PROBE = {"stream": (T.RESID_RMS_OUT, None), "attn": (T.UPDATE_RMS, "attn"), "mlp": (T.UPDATE_RMS, "mlp")}


@dataclass(frozen=True, kw_only=True)
class CheckSpec:
    """What one coordinate check runs: widths grow at a fixed number of heads (so μP's 1/D attention matters)."""

    widths: tuple[int, ...] = (64, 128, 256, 512)
    base_width: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 64
    batch_size: int = 8
    steps: int = 5
    lr: float = 1e-2
    seed: int = 0


def measure(cfg: ModelConfig, spec: CheckSpec) -> dict[str, float]:
    """{"stream/L0": rms, ..., "logits": rms} of `cfg` after `spec.steps` AdamW steps at `spec.lr` (constant)."""
    torch.manual_seed(spec.seed)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (spec.batch_size, spec.seq_len + 1), generator=gen)
    optim = OptimConfig(lr=spec.lr, min_lr=0.0, warmup_steps=0, schedule="constant", weight_decay=0.0)
    opt, _ = build_optimizer(model, optim, total_steps=spec.steps)
    for _ in range(spec.steps):
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad(), record(model) as rec:
        logits = model(tokens[:, :-1])
    values = rec.scalars()
    out = {f"{q}/L{i}": values[T.layer(family, i, sublayer)] for q, (family, sublayer) in _PROBE.items()
           for i in range(cfg.n_layers)}
    out["logits"] = token_rms(logits).item()
    return out


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(width)."""
    xs, ys = [math.log(w) for w in widths], [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def run(spec: CheckSpec, configs: list[dict[str, str]]) -> list[dict]:
    """One result per configuration: {"config", "widths", "values": {key: [per width]}, "slopes": {key: slope}}."""
    results = []
    for fields in configs:
        per_width = []
        for width in spec.widths:
            cfg = ModelConfig.preset("llama", vocab_size=spec.vocab_size, dim=width, n_layers=spec.n_layers,
                                     n_heads=spec.n_heads, max_seq_len=spec.seq_len, mup_base_width=spec.base_width,
                                     **fields)
            per_width.append(measure(cfg, spec))
            log.info("coordcheck %s width %d: logits rms %.3g", fields, width, per_width[-1]["logits"])
        values = {k: [m[k] for m in per_width] for k in per_width[0]}
        results.append({"config": fields, "widths": list(spec.widths), "values": values,
                        "slopes": {k: slope(list(spec.widths), v) for k, v in values.items()}})
    return results


def table(results: list[dict]) -> str:
    """Markdown: one row per configuration and quantity-layer, its slope and its RMS at the smallest/largest width."""
    lines = ["| placement | norm | parametrization | quantity | slope | RMS (narrowest) | RMS (widest) |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in results:
        c = r["config"]
        for key, s in r["slopes"].items():
            v = r["values"][key]
            lines.append(f"| {c['placement']} | {c['norm']} | {c['parametrization']} | {key} | {s:+.2f} | "
                         f"{v[0]:.3g} | {v[-1]:.3g} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """One row per configuration, one log-log panel per quantity, one line per layer."""
    # one y-scale per column: standard and μP rows compare at a glance
    fig, axes = pyplot().subplots(len(results), len(QUANTITIES), figsize=(3.2 * len(QUANTITIES), 2.6 * len(results)),
                             squeeze=False, sharey="col")
    for row, r in zip(axes, results, strict=True):
        c = r["config"]
        for ax, q in zip(row, QUANTITIES, strict=True):
            for key in (k for k in r["values"] if k.split("/")[0] == q):
                ax.loglog(r["widths"], r["values"][key], "o-", label=f"{key} ({r['slopes'][key]:+.2f})")
            ax.set_title(f"{c['placement']}/{c['norm']}/{c['parametrization']}: {q}", fontsize=8)
            ax.set_xlabel("width", fontsize=7)
            ax.set_xticks(r["widths"], [str(w) for w in r["widths"]])
            ax.minorticks_off()
            ax.legend(fontsize=6)
            ax.tick_params(labelsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab coordcheck", description=__doc__.split("\n\n")[0])
    d = CheckSpec()
    ap.add_argument("--widths", type=int, nargs="+", default=list(d.widths))
    ap.add_argument("--base_width", type=int, default=d.base_width, help="model.mup_base_width")
    ap.add_argument("--placements", nargs="+", default=["pre", "post"])
    ap.add_argument("--norms", nargs="+", default=["rmsnorm"])
    ap.add_argument("--parametrizations", nargs="+", default=["standard", "mup"])
    for name in ("n_layers", "n_heads", "vocab_size", "seq_len", "batch_size", "steps", "seed"):
        ap.add_argument(f"--{name}", type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr, help="the one fixed AdamW LR of every width")
    ap.add_argument("--output", type=Path, default=Path("coordcheck"), help="directory for the plot and tables")
    args = ap.parse_args(argv)
    spec = CheckSpec(widths=tuple(args.widths), base_width=args.base_width, n_layers=args.n_layers,
                     n_heads=args.n_heads, vocab_size=args.vocab_size, seq_len=args.seq_len,
                     batch_size=args.batch_size, steps=args.steps, lr=args.lr, seed=args.seed)
    if len(spec.widths) < 2:
        raise UserError(f"--widths {args.widths}: give at least two widths to fit a slope")
    configs = [dict(placement=p, norm=n, parametrization=m)
               for p, n, m in itertools.product(args.placements, args.norms, args.parametrizations)]
    for fields, width in itertools.product(configs, spec.widths):  # all valid before the first model trains
        try:
            ModelConfig.preset("llama", dim=width, n_heads=spec.n_heads, mup_base_width=spec.base_width, **fields)
        except ValueError as err:
            raise UserError(f"width {width}, {fields}: {err}") from None
    args.output.mkdir(parents=True, exist_ok=True)
    results = run(spec, configs)
    text = table(results)
    write_text_atomic(args.output / "coordcheck.md", text)
    write_text_atomic(args.output / "coordcheck.json", json.dumps(results, indent=1) + "\n")
    plot(results, args.output / "coordcheck.png")
    sys.stdout.write(text + f"\nplot: {args.output / 'coordcheck.png'}\n")
    return 0
