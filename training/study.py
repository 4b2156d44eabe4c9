"""`normlab study`: train a grid of small models on the default corpus and test the seeds' claims.

Each claim is checked against numbers measured in this run and printed as PASS or FAIL with those numbers.
A claim that does not hold at this scale is reported as FAIL with the reason; thresholds are fixed in
`evaluate` below, before any run, and never tuned to the outcome.

The runs use the same pieces as `normlab fit` — `model.Transformer`, `training.optim` (AdamW groups, warm-up
and cosine schedule), `data.TokenDataModule`, `model.probes` — in a plain single-process loop: the grid is
dozens of tiny models, where Lightning's per-run start-up would cost more than the training.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from data.datamodule import TokenDataModule
from data.prepare import ensure_default_corpus
from model import ModelConfig, Transformer
from model.norms import LayerNorm, RMSNorm
from model.probes import grad_norms, record
from training.optim import OptimConfig, build_optimizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scale:
    """Model and run size shared by every run of a grid."""

    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    steps: int
    metrics_every: int
    vocab_size: int = 2048
    lr: float = 2e-3  # a good learning rate at this scale
    high_lr: float = 1e-2  # the stress setting of claims 4 and 6


SCALES = {
    "default": Scale(dim=128, n_layers=6, n_heads=4, seq_len=128, batch_size=16, steps=300, metrics_every=25),
    "quick": Scale(dim=64, n_layers=4, n_heads=4, seq_len=64, batch_size=8, steps=60, metrics_every=10),
}


@dataclass(frozen=True)
class Run:
    name: str
    placement: str = "pre"
    norm: str = "rmsnorm"
    qk_norm: str = "none"
    init: str = "normal"
    lr: str = "base"  # "base" or "high" (Scale.lr / Scale.high_lr)
    warmup: bool = True


GRID = [
    Run("pre-rms"),  # the Llama baseline: claims 1, 2, 7
    Run("pre-rms-depth", init="depth"),  # claim 3
    Run("pre-ln", norm="layernorm"),  # claim 7
    Run("post-ln", placement="post", norm="layernorm"),  # post-norm trains when warmed up at a sane LR
    Run("post-ln-high-nowarm", placement="post", norm="layernorm", lr="high", warmup=False),  # claim 4
    Run("pre-rms-high-nowarm", lr="high", warmup=False),  # claims 4 and 6
    Run("pre-rms-qk-high-nowarm", qk_norm="head", lr="high", warmup=False),  # claim 6
    Run("sandwich-rms", placement="sandwich"),  # context: the other placements at the baseline settings
    Run("output-rms-qk", placement="output", qk_norm="full"),
]
QUICK_GRID = [r for r in GRID if r.name not in ("sandwich-rms", "output-rms-qk", "post-ln")]


@dataclass
class Result:
    run: Run
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # step → probe scalars
    diverged_at: int | None = None

    @property
    def final_loss(self) -> float:
        if self.diverged_at is not None:
            return math.inf
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)

    def profile(self, stem: str, step: int, n_layers: int) -> list[float]:
        return [self.metrics[step][f"{stem}/L{l}"] for l in range(n_layers)]


def model_config(run: Run, scale: Scale, vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, dim=scale.dim, n_layers=scale.n_layers, n_heads=scale.n_heads,
                       max_seq_len=scale.seq_len, placement=run.placement, norm=run.norm, qk_norm=run.qk_norm,
                       init=run.init, bias=False)


def train_run(run: Run, scale: Scale, data: TokenDataModule, seed: int = 0) -> Result:
    """Train one configuration; probes at step 0 (the init audit), every `metrics_every` steps and at the end."""
    torch.manual_seed(seed)
    model = Transformer(model_config(run, scale, data.vocab_size))
    lr = scale.lr if run.lr == "base" else scale.high_lr
    optim = OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=scale.steps // 10 if run.warmup else 0,
                        weight_decay=0.1)
    opt, schedule = build_optimizer(model, optim, scale.steps)
    result = Result(run)
    batches = iter(data.train_dataloader())
    for step in range(scale.steps + 1):
        batch = next(batches)
        probe = step % scale.metrics_every == 0 or step == scale.steps
        t = time.perf_counter()
        if probe:
            with record(model) as rec:
                loss = model(batch[:, :-1], targets=batch[:, 1:])
        else:
            loss = model(batch[:, :-1], targets=batch[:, 1:])
        if not torch.isfinite(loss):
            result.diverged_at = step
            log.info("%s diverged at step %d", run.name, step)
            break
        if step == scale.steps:  # the last probe is a measurement only
            result.metrics[step] = rec.scalars()
            break
        loss.backward()
        if probe:
            result.metrics[step] = {**rec.scalars(), **grad_norms(model)}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if not probe:
            result.step_times.append(time.perf_counter() - t)
        result.losses.append(loss.item())
    return result


# ---- claims --------------------------------------------------------------------------------------------------
@dataclass
class Claim:
    number: int
    text: str
    passed: bool
    numbers: str
    if_fail: str = ""  # why this claim can fail at this scale; printed only when it does

    @property
    def note(self) -> str:
        return "" if self.passed else self.if_fail


def _increasing_fraction(xs: list[float]) -> float:
    return sum(b > a for a, b in zip(xs, xs[1:], strict=False)) / max(1, len(xs) - 1)


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in xs) + "]"


def evaluate(results: dict[str, Result], scale: Scale) -> list[Claim]:
    L, end = scale.n_layers, scale.steps
    claims = []
    base = results["pre-rms"]
    rms = base.profile("resid/rms", end, L) + [base.metrics[end]["resid/final_in"]]
    frac = _increasing_fraction(rms)
    claims.append(Claim(1, "Under pre-norm the residual stream's RMS grows with depth.",
                        frac >= 0.8 and rms[-1] > 2 * rms[1],
                        f"stream RMS entering each block, then the final norm, after training: {_fmt(rms)}; "
                        f"{frac:.0%} of steps up; last/L1 = {rms[-1] / rms[1]:.2f} (pass: ≥80% up and > 2)",
                        "growth compounds with depth and with training length; with "
                        f"{L} blocks and {scale.steps} steps the stream rises block by block but by less than 2x"))

    def ratios(res: Result, step: int) -> list[float]:
        return [(res.metrics[step][f"resid/update_ratio/attn/L{l}"] + res.metrics[step][f"resid/update_ratio/mlp/L{l}"])
                / 2 for l in range(L)]

    r = ratios(base, end)[1:]  # L0 reads the raw embedding, whose scale is set by init, not by depth
    half = len(r) // 2
    first, last = statistics.mean(r[:half]), statistics.mean(r[half:])
    claims.append(Claim(2, "Each block's relative contribution (update/stream) shrinks with depth under pre-norm.",
                        last < first and _increasing_fraction(r) <= 0.4,
                        f"mean update/stream ratio for blocks 1..{L - 1}: {_fmt(r)}; first half {first:.3f}, "
                        f"second half {last:.3f} (pass: second < first and ≤40% of steps up)",
                        "the later blocks' updates grew as fast as the stream in these steps"))

    depth = results["pre-rms-depth"]
    growth = {name: res.metrics[end]["resid/final_in"] / res.metrics[end]["resid/rms/L1"]
              for name, res in (("normal", base), ("depth", depth))}
    claims.append(Claim(3, "Depth-scaled initialization reduces that growth.", growth["depth"] < growth["normal"],
                        f"final-norm input RMS / block-1 input RMS after training: init normal {growth['normal']:.2f}, "
                        f"init depth {growth['depth']:.2f}; at init: normal "
                        f"{base.metrics[0]['resid/final_in'] / base.metrics[0]['resid/rms/L1']:.2f}, depth "
                        f"{depth.metrics[0]['resid/final_in'] / depth.metrics[0]['resid/rms/L1']:.2f}",
                        "the depth-scaled init starts with less growth (the at-init ratios), but after training the "
                        "learned weights, not the init, set the block outputs: at this depth and length the init's "
                        "effect does not survive training"))

    post, pre = results["post-ln-high-nowarm"], results["pre-rms-high-nowarm"]
    ok = math.isfinite(pre.final_loss) and (post.diverged_at is not None or post.final_loss > pre.final_loss + 0.05)
    claims.append(Claim(4, "Post-norm without warm-up at a high learning rate trains worse or diverges, while pre-norm "
                           "at the same settings trains.", ok,
                        f"lr {scale.high_lr}, no warm-up: post-norm final loss {_loss(post)}, pre-norm {_loss(pre)} "
                        f"(pass: post diverges or is > 0.05 worse)",
                        "gradient clipping at 1.0 and the short run kept post-norm stable at this learning rate"))

    g_pre, g_post = init_grad_profile("pre", scale), init_grad_profile("post", scale)
    spread = {k: max(g) / min(g) for k, g in (("pre", g_pre), ("post", g_post))}
    claims.append(Claim(5, "At initialization, pre-norm gradient norms are roughly flat across layers while "
                           "post-norm's are not (Xiong et al. 2020).",
                        spread["pre"] < 2 and spread["post"] > 2 * spread["pre"],
                        f"per-block gradient norm at init, {len(g_pre)} layers, Xavier-scale init as in the paper: "
                        f"pre-norm {_fmt(g_pre)} (max/min {spread['pre']:.2f}); post-norm {_fmt(g_post)} "
                        f"(max/min {spread['post']:.2f}) (pass: pre < 2 and post > 2× pre)",
                        "in this causal LM both placements give the first blocks the largest gradients (they feed "
                        "every later block through the residual path); Xiong et al.'s flat pre-norm profile is an "
                        "expectation at large width under their input scaling, which this small model does not have"))

    no_qk, qk = results["pre-rms-high-nowarm"], results["pre-rms-qk-high-nowarm"]
    last_no = max(no_qk.metrics)
    logit = {k: max(res.metrics[max(res.metrics)][f"attn/max_logit/L{l}"] for l in range(L))
             for k, res in (("none", no_qk), ("qk", qk))}
    sat = {k: statistics.mean(res.metrics[max(res.metrics)][f"attn/saturated_frac/L{l}"] for l in range(L))
           for k, res in (("none", no_qk), ("qk", qk))}
    logit0 = max(no_qk.metrics[0][f"attn/max_logit/L{l}"] for l in range(L))
    claims.append(Claim(6, "At a high learning rate, QK-norm keeps the max attention logit and the saturated fraction "
                           "bounded, where the model without it grows them.",
                        logit["none"] > logit0 and logit["qk"] < logit["none"] and sat["qk"] <= sat["none"],
                        f"lr {scale.high_lr}: max attention logit at step 0 {logit0:.2f}; at step {last_no} without "
                        f"QK-norm {logit['none']:.2f}, with {logit['qk']:.2f}; saturated fraction (≥0.99) "
                        f"{sat['none']:.3f} vs {sat['qk']:.3f}",
                        "the no-QK-norm run's logits did not grow past their starting size in these steps"))

    ln = results["pre-ln"]
    t_rms, t_ln = interleaved_step_times(scale, data_vocab=scale.vocab_size)
    close = abs(base.final_loss - ln.final_loss) <= 0.02 * ln.final_loss
    claims.append(Claim(7, "RMSNorm reaches about the same loss as LayerNorm, in less time per step.",
                        close and t_rms < t_ln,
                        f"final loss RMSNorm {base.final_loss:.4f}, LayerNorm {ln.final_loss:.4f} "
                        f"(within 2%: {close}); "
                        f"median training step {t_rms * 1e3:.1f} ms vs {t_ln * 1e3:.1f} ms, timed alternately in one "
                        f"process (norms are {_norm_share(scale):.1%} of the FLOPs at this size, so the gap is small)"))

    x = torch.randn(256, scale.dim, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)
    diff = (LayerNorm(scale.dim, eps=1e-6).double()(x) - RMSNorm(scale.dim, eps=1e-6).double()(x)).abs().max().item()
    claims.append(Claim(8, "LayerNorm and RMSNorm agree exactly on zero-mean input.", diff < 1e-12,
                        f"max |LN(x) − RMSNorm(x)| over 256 zero-mean float64 vectors of width {scale.dim}: {diff:.1e}",
                        "the two norms' eps enter differently (variance vs mean square); they differ in rounding"))
    return claims


def init_grad_profile(placement: str, scale: Scale, seed: int = 0) -> list[float]:
    """Per-block gradient norms of one backward at init, in Xiong et al.'s setting: Xavier-scale weights
    (std 1/√dim) and twice the grid's depth, so the placement's effect on the gradient path shows."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=scale.vocab_size, dim=scale.dim, n_layers=2 * scale.n_layers, n_heads=scale.n_heads,
                      max_seq_len=scale.seq_len, placement=placement, norm="layernorm",
                      init_std=1 / math.sqrt(scale.dim))
    model = Transformer(cfg)
    tokens = torch.randint(0, scale.vocab_size, (scale.batch_size, scale.seq_len + 1))
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    norms = grad_norms(model)
    return [norms[f"grad/norm/L{l}"] for l in range(cfg.n_layers)]


def interleaved_step_times(scale: Scale, data_vocab: int, rounds: int = 5, steps: int = 3) -> tuple[float, float]:
    """Median training-step time of the RMSNorm and LayerNorm baselines, alternating in one process so that
    load from anything else on the machine hits both alike."""
    torch.manual_seed(0)
    models = {n: Transformer(model_config(Run(n, norm=n), scale, data_vocab)) for n in ("rmsnorm", "layernorm")}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    tokens = torch.randint(0, data_vocab, (scale.batch_size, scale.seq_len + 1))
    times: dict[str, list[float]] = {n: [] for n in models}
    for r in range(rounds + 1):  # round 0 warms up
        for n, m in models.items():
            t = time.perf_counter()
            for _ in range(steps):
                m(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                opts[n].step()
                opts[n].zero_grad(set_to_none=True)
            if r:
                times[n].append((time.perf_counter() - t) / steps)
    return statistics.median(times["rmsnorm"]), statistics.median(times["layernorm"])


def _loss(res: Result) -> str:
    return f"diverged at step {res.diverged_at}" if res.diverged_at is not None else f"{res.final_loss:.4f}"


def _norm_share(scale: Scale) -> float:
    cfg = ModelConfig(vocab_size=scale.vocab_size, dim=scale.dim, n_layers=scale.n_layers, n_heads=scale.n_heads,
                      max_seq_len=scale.seq_len)
    norm_flops = (2 * cfg.n_layers + 1) * 8 * cfg.dim  # ~8 FLOPs per element per norm, forward + backward
    return norm_flops / cfg.flops_per_token(scale.seq_len)


# ---- report ---------------------------------------------------------------------------------------------------
def plot(results: dict[str, Result], scale: Scale, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, end, files = scale.n_layers, scale.steps, []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        ax.plot(res.losses, label=name + ("" if res.diverged_at is None else f" (diverged @{res.diverged_at})"), lw=1)
    ax.set(xlabel="step", ylabel="train loss", title="Loss curves", ylim=(None, min(12, ax.get_ylim()[1])))
    ax.legend(fontsize=7)
    save(fig, "loss_curves.png")

    finished = {n: r for n, r in results.items() if end in r.metrics}
    for stem, ylabel, fname in (("resid/rms", "stream RMS entering block", "residual_rms_vs_depth.png"),
                                ("resid/update_ratio/mlp", "MLP update RMS / stream RMS", "update_ratio_vs_depth.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, res in finished.items():
            ax.plot(range(L), res.profile(stem, end, L), marker="o", label=name)
        ax.set(xlabel="layer", ylabel=ylabel, yscale="log", title=f"{ylabel} after {end} steps")
        ax.legend(fontsize=7)
        save(fig, fname)

    fig, ax = plt.subplots(figsize=(7, 4))
    for placement in ("pre", "post"):
        g = init_grad_profile(placement, scale)
        ax.plot(range(len(g)), g, marker="o", label=f"{placement}-norm (LayerNorm, std 1/√dim)")
    for name in ("pre-rms", "post-ln"):
        if name in results:
            ax.plot(range(L), results[name].profile("grad/norm", 0, L), marker="x", ls="--",
                    label=f"{name} as trained (std 0.02)")
    ax.set(xlabel="layer", ylabel="gradient norm", yscale="log", title="Per-block gradient norm at initialization")
    ax.legend(fontsize=7)
    save(fig, "grad_norm_at_init.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("pre-rms-high-nowarm", "pre-rms-qk-high-nowarm", "pre-rms"):
        res = results[name]
        steps = sorted(res.metrics)
        axes[0].plot(steps, [max(res.metrics[s][f"attn/max_logit/L{l}"] for l in range(L)) for s in steps], label=name)
        axes[1].plot(steps, [statistics.mean(res.metrics[s][f"attn/saturated_frac/L{l}"] for l in range(L))
                             for s in steps], label=name)
    axes[0].set(xlabel="step", ylabel="max attention logit (all layers)", title="Attention logits")
    axes[1].set(xlabel="step", ylabel="saturated fraction (mean over layers)", title="Softmax saturation")
    for a in axes:
        a.legend(fontsize=7)
    save(fig, "attention_saturation.png")
    return files


def write_report(results: dict[str, Result], claims: list[Claim], scale: Scale, out: Path, plots: list[str],
                 seconds: float, quick: bool) -> None:
    lines = [
        "# The normalization study",
        "",
        f"`normlab study{' --quick' if quick else ''}` — {len(results)} runs of a {scale.n_layers}-layer, "
        f"dim-{scale.dim} model ({model_config(GRID[0], scale, scale.vocab_size).num_params() / 1e6:.2f}M parameters), "
        f"seq {scale.seq_len}, batch {scale.batch_size}, {scale.steps} steps each, on the default corpus "
        f"(vocab {scale.vocab_size}); {seconds / 60:.1f} minutes on {torch.get_num_threads()} CPU threads. "
        f"Learning rates: base {scale.lr}, high {scale.high_lr}; AdamW, cosine schedule, clip 1.0.",
        "",
        "## Claims",
        "",
        "| # | claim | result | numbers |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c.number} | {c.text} | **{'PASS' if c.passed else 'FAIL'}** | {c.numbers}"
              f"{'. Why it fails here: ' + c.note if c.note else ''} |" for c in claims]
    lines += ["", "## Runs", "", "| run | placement | norm | QK-norm | init | lr | warm-up | final loss | ms/step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        r = res.run
        lr = scale.lr if r.lr == "base" else scale.high_lr
        ms = statistics.median(res.step_times) * 1e3 if res.step_times else float("nan")
        lines.append(f"| {name} | {r.placement} | {r.norm} | {r.qk_norm} | {r.init} | {lr} | "
                     f"{'yes' if r.warmup else 'no'} | {_loss(res)} | {ms:.1f} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def run_study(output: Path, quick: bool = False, data_dir: Path | None = None) -> list[Claim]:
    scale = SCALES["quick" if quick else "default"]
    grid = QUICK_GRID if quick else GRID
    output.mkdir(parents=True, exist_ok=True)
    data_dir = data_dir or Path("data_cache") / f"study-v{scale.vocab_size}"
    ensure_default_corpus(data_dir, vocab_size=scale.vocab_size)
    data = TokenDataModule(str(data_dir), seq_len=scale.seq_len, batch_size=scale.batch_size, val_batches=0)
    data.setup("fit")
    scale = replace(scale, vocab_size=data.vocab_size)
    start = time.perf_counter()
    results = {}
    for run in grid:
        t = time.perf_counter()
        results[run.name] = train_run(run, scale, data)
        print(f"  {run.name:<26} final loss {_loss(results[run.name]):>10}  ({time.perf_counter() - t:.0f} s)",
              flush=True)
    claims = evaluate(results, scale)
    plots = plot(results, scale, output)
    write_report(results, claims, scale, output, plots, time.perf_counter() - start, quick)
    (output / "results.json").write_text(json.dumps({
        "scale": asdict(scale),
        "runs": {n: {"run": asdict(r.run), "losses": r.losses, "diverged_at": r.diverged_at,
                     "median_step_s": statistics.median(r.step_times) if r.step_times else None,
                     "metrics": {str(k): v for k, v in r.metrics.items()}} for n, r in results.items()},
        "claims": [{**asdict(c), "note": c.note} for c in claims],
    }, indent=1))
    return claims


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid and model (≤ 3 minutes on 2 cores)")
    ap.add_argument("--output", type=Path, default=None, help="report directory (default: runs/study[-quick])")
    ap.add_argument("--data", type=Path, default=None, help="prepared default-corpus directory to use or create")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    output = args.output or Path("runs") / ("study-quick" if args.quick else "study")
    print(f"normlab study{' --quick' if args.quick else ''}: writing {output}/report.md", flush=True)
    claims = run_study(output, quick=args.quick, data_dir=args.data)
    for c in claims:
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.number}. {c.text}\n      {c.numbers}")
        if c.note:
            print(f"      why it fails here: {c.note}")
    print(f"{sum(c.passed for c in claims)}/{len(claims)} claims hold at this scale; report: {output / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
