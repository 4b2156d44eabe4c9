"""The study's report (report.md) and its machine-readable twin (results.json), both written atomically."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from training.checkpointing.layout import write_text_atomic
from training.stats import estimate
from training.study.claims import Claim
from training.study.grid import AtInit, Scale, Train
from training.study.judge import Context, Outcome
from training.study.measure import final_loss, outcome


def _role_rows(ctx: Context) -> list[str]:
    rows = ["| role | configuration | seeds | final loss (mean ± sd) | outcome per seed |", "|---|---|---|---|---|"]
    for role, spec in ctx.roles.items():
        runs = ctx.results[spec]
        if isinstance(spec, Train):
            loss = estimate([final_loss(r) for r in runs])
            loss_s = f"{loss.mean:.3f} ± {loss.sd:.3f}" if math.isfinite(loss.mean) else "diverged"
            outcomes = ", ".join(f"{k} ×{v}" for k, v in Counter(outcome(r) for r in runs).items())
        else:
            loss_s, outcomes = "— (at init)", "—"
        rows.append(f"| {role} | {spec.label()} | {len(runs)} | {loss_s} | {outcomes} |")
    return rows


def claim_section(claim: Claim, verdict: str, outcomes: list[Outcome], ctx: Context, plot: str | None) -> list[str]:
    lines = [f"## {claim.number}. {claim.title} — **{verdict}**", "", f"Source: {claim.source}.", ""]
    lines += ["| test | verdict | numbers |", "|---|---|---|"]
    lines += [f"| {o.test.id}: {o.test.text} | **{o.verdict}** | {o.numbers()} |" for o in outcomes]
    if claim.number == 9 and "toy" in ctx.extra:
        toy = ctx.extra["toy"]
        lines += ["", "Toy, RMS seen by layer (no norm / with norm): "
                  + "; ".join(f"layer {l}: {a:.1f} / {b:.1f}" for l, (a, b) in sorted(toy.items()))]
    if claim.number == 7 and "op_ratios" in ctx.extra:
        lines += ["", f"Op timing: fp32, input {ctx.extra['op_shape']}, forward+backward, one thread, "
                  f"{len(next(iter(ctx.extra['op_ratios'].values())))} interleaved rounds."]
    if verdict != "PASS" and claim.if_not_pass:
        lines += ["", f"Reading: {claim.if_not_pass}"]
    lines += ["", "Runs:", ""] + _role_rows(ctx)
    if plot:
        lines += ["", f"![claim {claim.number}]({plot})"]
    return lines + [""]


def write_report(out: Path, scale: Scale, judged: list[tuple[Claim, str, list[Outcome], Context, str | None]],
                 header: dict) -> None:
    """report.md: the setup, a verdict table, then one section per claim."""
    lines = [
        "# The normalization study", "",
        f"`{header['command']}` — {header['jobs']} job(s) (trained runs and at-init measurements), "
        f"{header['minutes']:.1f} minutes wall time on {header['machine']}; load average "
        f"{header['load_before']} before and {header['load_after']} after the run.", "",
        f"Model: dim {scale.dim}, {scale.n_heads} heads, seq {scale.seq_len}, batch {scale.batch_size}, vocab "
        f"{header['vocab_size']} (the default corpus); {scale.shallow} layers ({scale.steps} steps) for the "
        f"ordinary runs, {scale.deep} layers ({scale.deep_steps} steps) for the deep arm. AdamW (β 0.9/0.95, "
        f"weight decay 0.1 except norms, biases, embeddings), warm-up 10% of steps unless 'no-warmup', cosine "
        f"to lr/10, clip 1.0, fp32. Base lr {scale.lr:g}, high lr {scale.high_lr:g}, claim 6's sweep "
        f"{', '.join(f'{x:g}' for x in scale.lrs)}. {scale.seeds} seeds per trained configuration and "
        f"{scale.init_seeds} per at-init measurement; a seed sets the initialization, every run reads the same "
        "batches.", "",
        "Verdicts: each number is a mean over seeds with its sd and a 95% t-interval (differences: Welch). PASS "
        "when the interval clears the threshold fixed in `training/study/claims.py`, FAIL when it lies wholly on "
        "the wrong side, INCONCLUSIVE when it contains the threshold (the difference is within its noise). "
        "Final loss is the mean training loss over the last 10% of steps. Outcome per run: 'diverged' (a "
        "non-finite loss, or ending above the first step's loss), 'stalled' (< 0.1 nats of progress over the "
        "last 80% of steps), else 'trains'. 'Reading' lines are hypotheses unless they name a measurement.", "",
        "| claim | verdict | tests (verdict) |", "|---|---|---|",
    ]
    for claim, verdict, outcomes, _, _ in judged:
        tests = ", ".join(f"{o.test.id} {o.verdict}" for o in outcomes if o.test.kind != "report")
        lines.append(f"| {claim.number}. {claim.title} | **{verdict}** | {tests} |")
    lines.append("")
    for claim, verdict, outcomes, ctx, plot in judged:
        lines += claim_section(claim, verdict, outcomes, ctx, plot)
    write_text_atomic(out / "report.md", "\n".join(lines))


def write_results(out: Path, judged: list, results: dict, header: dict) -> None:
    """results.json: the verdicts with their estimates, and every job's losses and final-step probes."""
    def spec_json(spec):
        return {"label": spec.label(), "kind": "at_init" if isinstance(spec, AtInit) else "train"}

    def seed_json(spec, r: dict) -> dict:
        final = r.get("probes", {}) if isinstance(spec, AtInit) else r["probes"].get(spec.steps, {})
        return {k: v for k, v in r.items() if k != "probes"} | {"final_probes": final}

    doc = {"header": header, "claims": [
        {"number": c.number, "title": c.title, "verdict": v,
         "tests": [{"id": o.test.id, "text": o.test.text, "verdict": o.verdict, "a": vars(o.a),
                    "b": vars(o.b) if o.b else None, "diff": vars(o.diff) if o.diff else None} for o in outs]}
        for c, v, outs, _, _ in judged],
        "runs": [{**spec_json(spec), "seeds": [seed_json(spec, r) for r in runs]} for spec, runs in results.items()]}
    write_text_atomic(out / "results.json", json.dumps(doc, indent=1, default=str))
