"""The study's report (report.md), its machine-readable twin (results.json) and the per-seed measurements
(measurements.csv, runs.csv), all written atomically."""
from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections import Counter
from pathlib import Path

from data.atomic import write_text_atomic
from training.stats import ALPHA, estimate
from training.study.claims import MECHANISM, PRIMARY, REPORT, REVISIONS, SECONDARY, Claim, specified
from training.study.grid import AtInit, Scale, Train
from training.study.judge import Outcome
from training.study.measure import final_loss, outcome
from training.study.provenance import claims_sha256, header_seeds
from training.study.scorecard import deciding_null, mirror_lines, power_cell
from training.study.statistics import STATISTICS, Context, best_lr_index

TIER_LABEL = {PRIMARY: "primary", SECONDARY: "secondary", MECHANISM: "mechanism check", REPORT: "report"}


def _ci(e) -> str:
    if e is None or not math.isfinite(e.mean):
        return "—" if e is None else str(e)
    if e.n < 2 or not math.isfinite(e.lo):
        return f"{e.mean:.3g} (n={e.n})"
    return f"{e.mean:.3g} [{e.lo:.3g}, {e.hi:.3g}] (n={e.n}, df {e.df:.0f})"


def _effect(o: Outcome) -> str:
    """The estimate shown for a test; without a seed where both arms are finite, who diverged instead."""
    e = o.shown
    if e is not None and not math.isfinite(e.mean) and sum(o.discordant):
        a, b = o.discordant
        n = len(o.samples_a)
        return (f"— (no seed finite in both arms; non-finite in {o.test.a} only on {a} of {n}, in {o.test.b} only "
                f"on {b} of {n})")
    return _ci(e)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a literal | (as in |mean|) would end the cell."""
    return text.replace("|", "\\|")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _per_seed(o: Outcome) -> str:
    if len(o.samples_a) > 12:
        return f"{len(o.samples_a)} values: measurements.csv"
    a = ", ".join(_fmt(x) for x in o.samples_a)
    if o.samples_b is None:
        return a
    return f"{o.test.a}: {a} / {o.test.b}: " + ", ".join(_fmt(x) for x in o.samples_b)


def _mean(ctx: Context, stat: str, role: str, **params) -> float:
    xs = [x for x in STATISTICS[stat](ctx, role, **params) if math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def _by_id(outcomes: list[Outcome]) -> dict[str, Outcome]:
    return {o.test.id: o for o in outcomes}


# Readings: measured, from the run's own numbers. Anything not measured is worded as a hypothesis.
def _reading_2(ctx: Context, o: dict[str, Outcome]) -> str:
    return (f"Measured: on the long run the blocks' update RMS grows with depth at a log-log slope of "
            f"{_ci(o['2f'].a)} (2f) while the stream grows at {_mean(ctx, 'growth_slope', 'long'):.3g} (1a), so "
            "the update ratio's slope (2b, 2c) is their difference.")


def _reading_3(ctx: Context, o: dict[str, Outcome]) -> str:
    d = o["3a"].judged
    direction = "reversed (the scaled init grows more)" if d.mean < 0 else "in the claimed direction"
    return (f"Measured: training moved the stream-writing matrices by {o['3f'].a.mean:.2f} (normal init) and "
            f"{o['3g'].a.mean:.2f} (scaled init) of their initial norm (3f, 3g); 3a's point estimate is "
            f"{direction}.")


def _reading_5(ctx: Context, o: dict[str, Outcome]) -> str:
    cells = {r: _mean(ctx, "w2_top_heavy", r) for r in ctx.roles if r.startswith("post-")}
    if not cells:
        return ""
    top = max(cells, key=cells.get)
    return (f"Measured (table below): post-LN's log(last/first ‖∇W²‖) ranges from {min(cells.values()):.2f} to "
            f"{max(cells.values()):.2f} over inits × embeddings × depths; the most top-heavy cell is `{top}` "
            f"(×{math.exp(cells[top]):.2f}). The ladder is at width {ctx.scale.dim}; width is not varied here.")


def _reading_6(ctx: Context, o: dict[str, Outcome]) -> str:
    lr = ctx.spec("none@-1").lr
    return (f"Measured (6e): at lr {lr:g} without QK-norm {o['6e'].a.mean:.0%} of attention rows are saturated "
            f"(max probability ≥ 0.99), against {o['6e'].b.mean:.0%} with it; the largest logit is "
            f"{math.exp(o['6d'].a.mean):.0f} against {math.exp(o['6d'].b.mean):.0f} (6d). The softmax does saturate; "
            "6a and 6b say what that costs in loss.")


def _reading_12(ctx: Context, o: dict[str, Outcome]) -> str:
    rms = {r: _mean(ctx, "log_final_rms", r) for r in ("deep-final", "deep-no-final")}
    head = {r: statistics.fmean(x["head_rms"] for x in ctx.runs(r)) for r in ("deep-final", "deep-no-final")}
    return (f"Measured (24 layers): the final stream's RMS is {math.exp(rms['deep-no-final']):.2f} without the "
            f"final norm and {math.exp(rms['deep-final']):.2f} with it; the LM head's weight RMS is "
            f"{head['deep-no-final']:.3f} and {head['deep-final']:.3f}.")


def _reading_14(ctx: Context, o: dict[str, Outcome]) -> str:
    return (f"Measured (14e): without gradient clipping post-LN's held-out loss at the highest LR and no warm-up "
            f"changes by {_ci(o['14e'].diff)} nats, so clipping is {'not ' if abs(o['14e'].diff.mean) < 0.05 else ''}"
            "what bounds it here.")


def _reading_16(ctx: Context, o: dict[str, Outcome]) -> str:
    parts = []
    for arm, name in (("post-w1-hi", "post-LN"), ("pre-w1-hi", "pre-LN")):
        members = ctx.family(arm)
        best = best_lr_index(ctx, arm)
        at_best = _mean(ctx, "final_loss", members[best])
        above = [r for m in members[best + 1:] for r in ctx.runs(m)]
        trains = sum(outcome(r) == "trains" for r in above)
        losses = [x for x in map(final_loss, above) if math.isfinite(x)]
        text = f"{name}'s best LR is {ctx.spec(members[best]).lr:g} (held-out loss {at_best:.2f})"
        if not above:
            text += ", the grid's highest"
        else:
            end = f"ending at {statistics.fmean(losses):.2f} on average" if losses else "every one diverging"
            text += f" and {trains} of {len(above)} runs above it train, {end}"
        parts.append(text)
    return ("Measured: " + "; ".join(parts) + ". Hypothesis: 16e measures how far an arm falls from its own "
            "optimum, which the unigram plateau bounds, so an arm whose optimum is already near the plateau "
            "cannot fall far; the range of LRs that train (the runs table's outcomes) is the other reading of "
            "'sensitive', and no test of it was specified before the run.")


def _reading_17(ctx: Context, o: dict[str, Outcome]) -> str:
    return (f"Measured: the no-norm model's best LR is {ctx.spec(ctx.family('none')[best_lr_index(ctx, 'none')]).lr:g} "
            f"and RMSNorm's {ctx.spec(ctx.family('rms')[best_lr_index(ctx, 'rms')]).lr:g}; the largest LR whose "
            f"run trains: {o['17c'].a.mean:.2g} (no norm) and {o['17d'].a.mean:.2g} (RMSNorm), means over seeds.")


def _reading_21(ctx: Context, o: dict[str, Outcome]) -> str:
    t = ctx.extra.get("timing", {})
    med = {k: statistics.median(v) for k, v in t.items() if v and all(math.isfinite(x) for x in v)}
    if not {"norm_time", "norm_time_wide", "fused", "fused_small", "composite"} <= set(med):
        return ""
    return (f"Measured (medians): in a training step the RMSNorm model's norms take {med['norm_time']:.2f}× the "
            f"LayerNorm model's norm time at the trained shape and {med['norm_time_wide']:.2f}× at width "
            f"{ctx.scale.wide_dim}; the fused ops alone are {med['fused_small']:.2f}× at the trained shape and "
            f"{med['fused']:.2f}× at {ctx.extra['op_shape']}; written out in eager PyTorch RMSNorm is "
            f"{med['composite']:.2f}× LayerNorm. Hypothesis: the algorithmic saving is real (the composites), and "
            "normlab's CPU RMSNorm kernel has a per-call overhead that dominates at rows this short.")


READINGS = {2: _reading_2, 3: _reading_3, 5: _reading_5, 6: _reading_6, 12: _reading_12, 14: _reading_14,
            16: _reading_16, 17: _reading_17, 21: _reading_21}


def _trend(claim: Claim, ctx: Context) -> list[str]:
    """Scale ladders as tables: claim 1's at-init growth slope over width × depth; claim 5's post/pre-LN
    log(last/first ‖∇W²‖) over init × embedding × depth; claim 9's read growth over the init std."""
    s = ctx.scale
    if claim.number == 1:
        rows = ["| width \\ depth | " + " | ".join(f"L{L}" for L in s.ladder_depths) + " |",
                "|---" * (len(s.ladder_depths) + 1) + "|"]
        for w in s.ladder_widths:
            cells = []
            for L in s.ladder_depths:
                e = estimate(STATISTICS["growth_slope"](ctx, f"ladder-d{w}-L{L}"))
                cells.append(f"{e.mean:.2f} ± {e.sd:.2f}")
            rows.append(f"| d{w} | " + " | ".join(cells) + " |")
        return ["At init, the stream's growth slope (mean ± sd over "
                f"{s.ladder_seeds} seeds) across widths and depths:", ""] + rows
    if claim.number == 5:
        rows = ["| init | embedding | placement | " + " | ".join(f"L{L}" for L in s.xiong_depths) + " |",
                "|---" * (len(s.xiong_depths) + 3) + "|"]
        for init in ("xavier", "invsqrt", "std02"):
            for emb in ("e02", "unit"):
                for p in ("post", "pre"):
                    cells = [f"{_mean(ctx, 'w2_top_heavy', f'{p}-{init}-{emb}@{i}'):.2f}"
                             for i in range(len(s.xiong_depths))]
                    rows.append(f"| {init} | {emb} | {p} | " + " | ".join(cells) + " |")
        return ["At init, log(last/first layer ‖∇W²‖) (mean over "
                f"{s.ladder_seeds} seeds): init xavier, σ = 1/√d ('invsqrt') or σ = 0.02 ('std02'); embedding "
                "σ = 0.02 ('e02') or rescaled to unit RMS ('unit'):", ""] + rows
    if claim.number == 9:
        rows = ["| init std | no norm: log read growth | RMSNorm | no-norm seeds non-finite |", "|---|---|---|---|"]
        for i, std in enumerate(s.init_stds):
            nf = sum(STATISTICS["non_finite"](ctx, f"none-std{i}"))
            rows.append(f"| {std:.3g} | {_mean(ctx, 'log_read_growth', f'none-std{i}'):.3g} | "
                        f"{_mean(ctx, 'log_read_growth', f'rms-std{i}'):.3g} | {nf:.0f}/{s.init_seeds} |")
        return ["At init, 24 layers, log(last/first block's sublayer-input RMS) by init std:", ""] + rows
    return []


def _best_lrs(ctx: Context) -> list[str]:
    families = sorted({r.split("@")[0] for r in ctx.roles if "@" in r})
    out = []
    for f in families:
        members = ctx.family(f)
        if len(members) > 1 and all(isinstance(ctx.roles[m], Train) for m in members):
            out.append(f"{f} {ctx.roles[members[best_lr_index(ctx, f)]].lr:g}")
    return out


def _role_rows(ctx: Context) -> list[str]:
    rows = ["| role | configuration | seeds | held-out loss (mean ± sd) | outcome per seed |", "|---|---|---|---|---|"]
    for role, spec in ctx.roles.items():
        if isinstance(spec, AtInit) and spec.ladder:
            continue
        runs = ctx.results[spec]
        if isinstance(spec, Train):
            losses = [final_loss(r) for r in runs]
            finite = [x for x in losses if math.isfinite(x)]
            loss = estimate(finite) if finite else None
            loss_s = "diverged" if loss is None else f"{loss.mean:.3f} ± {loss.sd:.3f}"
            if loss is not None and len(finite) < len(losses):
                loss_s += f" ({len(finite)} that trained)"
            outcomes = ", ".join(f"{k} ×{v}" for k, v in Counter(outcome(r) for r in runs).items())
        else:
            loss_s, outcomes = "— (at init)", "—"
        rows.append(f"| {role} | {spec.label()} | {len(runs)} | {loss_s} | {outcomes} |")
    return rows


def _margin(o: Outcome) -> str:
    """The margin and, where the test compares with one, the threshold (estimates are printed unshifted)."""
    t = o.test
    parts = ([] if t.margin is None else [f"±{t.margin:.3g}"]) + \
        ([f"threshold {t.threshold:.4g}"] if t.threshold and t.kind != "exact" else [])
    return "; ".join(parts) or "—"


def claim_section(claim: Claim, verdict: str, outcomes: list[Outcome], ctx: Context, plot: str | None) -> list[str]:
    lines = [f"## {claim.number}. {claim.title} — **{verdict}**", "", f"Source: {claim.source}.", "",
             f"Evidence of: {claim.evidence}. Limits: {claim.limits}", "",
             "| test | kind | margin | verdict | estimate [95% CI] | p: t / sign-flip | numbers | per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        key = "difference" if o.test.kind != "equivalent" else "equivalence"
        ps = f"{_p(o.p.get(key))} / {_p(o.p.get(key + '_perm'))}" if o.judgement else "—"
        lines.append(f"| {o.test.id}: {_cell(o.test.text)} | {TIER_LABEL[o.test.tier]} | {_margin(o)} | "
                     f"**{o.verdict}**{_flags(o)} | {_effect(o)} | {ps} | {o.numbers()} | {_per_seed(o)} |")
    if claim.number == 9 and "toy" in ctx.extra:
        toy = ctx.extra["toy"]
        lines += ["", "Toy, RMS seen by layer (no norm / with norm): "
                  + "; ".join(f"layer {l}: {a:.1f} / {b:.1f}" for l, (a, b) in sorted(toy.items()))]
    if claim.number == 21 and "op_shape" in ctx.extra:
        lines += ["", "Timing: fp32, forward+backward, one thread. Each row is a number of timing runs (fresh models "
                  "or inputs, a warm-up round, then rounds whose candidate order is a seeded shuffle balanced within "
                  "the run); a run's value is the median of its rounds' ratios, and the interval is taken over the "
                  "runs, so it carries the run-to-run variation that one run's rounds miss. The median and IQR of "
                  "the runs' values per row: " + "; ".join(
                      f"{k} {statistics.median(v):.3f} (IQR {_iqr(v)})" for k, v in ctx.extra["timing"].items()
                      if v and all(math.isfinite(x) for x in v)) + "."]
    best = _best_lrs(ctx)
    if best:
        lines += ["", "Best LR per arm (lowest mean held-out loss over all seeds; a diverged run counts as the loss "
                  "at init; the tests read each seed at the LR chosen on the other seeds): " + "; ".join(best) + "."]
    trend = [] if claim.primaries_only else _trend(claim, ctx)  # trends read runs a primaries-only run lacks
    if trend:
        lines += [""] + trend
    reading = None if claim.primaries_only else READINGS.get(claim.number)  # readings quote secondary tests
    text = reading(ctx, _by_id(outcomes)) if reading else ""
    if verdict != "PASS" and claim.if_not_pass:  # the hypothesis the claim stated before the run
        text = f"{text} {claim.if_not_pass}".strip()
    if text:
        lines += ["", f"Reading: {text}"]
    if ctx.roles:
        lines += ["", "Runs:", ""] + _role_rows(ctx)
    if plot:
        lines += ["", f"![claim {claim.number}]({plot})"]
    return lines + [""]


def _iqr(v: list[float]) -> str:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return f"{q[0]:.3f}–{q[2]:.3f}"


def _p(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.2g}"


def _flags(o: Outcome) -> str:
    """† the effect is shown but its interval reaches inside the margin; ‡ the sign-flip test disagrees."""
    flags = ""
    e = o.judged  # the difference from the threshold: what the margin is about
    if o.verdict == "PASS" and o.test.margin and o.test.kind != "equivalent" and \
            abs(e.lo if e.mean > 0 else e.hi) < o.test.margin:
        flags += " †"
    return flags + (" ‡" if o.disagree else "")


def _deciding_p(o: Outcome) -> tuple[str, str]:
    """The p (t / sign-flip) and q cells of the null that decided the verdict, each naming that null."""
    key = deciding_null(o)
    if key is None:
        return "—", f"—, {o.verdict_bh}"
    return (f"{_p(o.p.get(key))} / {_p(o.p.get(key + '_perm'))} ({key})",
            f"{_p(o.q.get(key))} ({key}), {o.verdict_bh}")


def summary_rows(judged: list, seeds: range = range(0)) -> list[str]:
    """One row per primary test (the claim's verdict on its first row); `seeds`, the run's, decide whether each
    test was specified before or after its data (`claims.specified`)."""
    rows = ["| claim | evidence of | primary test | specified | margin | verdict | effect [95% CI] | "
            "p (t / sign-flip) | q (BH), verdict at FDR 5% | power at the margin | MDE (80%) |", "|---" * 11 + "|"]
    for claim, verdict, outcomes, _, _ in judged:
        for i, o in enumerate(x for x in outcomes if x.test.tier == PRIMARY):
            mde = "—" if math.isnan(o.mde) else f"{o.mde:.3g}"
            head = f"{claim.number}. {claim.title}" if i == 0 else ""
            shown = f"**{verdict}**{_flags(o)}" if i == 0 else f"{o.verdict}{_flags(o)}"
            p, q = _deciding_p(o)
            rows.append(f"| {head} | {claim.evidence if i == 0 else ''} | {o.test.id}: {_cell(o.test.text)} | "
                        f"{specified(o.test.id, seeds)} | {_margin(o)} | {shown} | {_effect(o)} | {p} | {q} | "
                        f"{power_cell(o)} | {mde} |")
    return rows


SUMMARY = (
    "Each claim is its own family: its verdict is that of its primary test (with several primaries, Holm's "
    "adjustment across them, and PASS only when all pass), so it is the same whether the claim runs alone or with "
    "the others, and the chance of a false verdict on any one claim stays ≤ α = 0.05. Across the claims the "
    "scorecard adds Benjamini–Hochberg q-values and the verdict they give: rejecting where q < 0.05 keeps the "
    "expected share of false findings in the table ≤ 5%. Effects are paired per-seed differences (or one arm's "
    "statistic, read against the threshold in the margin column) with a 95% t-interval; p: the t-test (for an "
    "equivalence claim, TOST) and its distribution-free twin, the exact sign-flip permutation test of the same "
    "per-seed differences (the smallest two-sided p with n seeds is 2/2ⁿ). Power: the chance the test rejects "
    "at a true effect of one margin (for an equivalence claim: that it shows equivalence at a true difference "
    "of 0), from the observed spread, at the level the verdict uses (α/k for k primaries). MDE: the smallest "
    "effect detected with 80% power at that level, this n and spread. †: the effect is shown to exist, but its "
    "interval reaches inside the margin, so it may be smaller than matters. ‡: the sign-flip test gives another "
    "verdict: the t-test's rests on normal tails. p and q are those of the null whose rejection decided the "
    "verdict, named beside them: 'difference' (no effect; PASS or FAIL of a directional claim, FAIL of an "
    "equivalence claim) or 'equivalence' (TOST: an effect of at least one margin; EQUIVALENT of a directional "
    "claim, PASS of an equivalence claim). 'Specified': before or after data on this run's seeds had been seen "
    "(a test defined after seeing them is a replication on those seeds, not a blind test). 'Uninformative' in "
    "the power column: power at the margin below 50%, so the test was more likely to miss an effect of one "
    "margin than to see it; a PASS there overstates the effect's size (type M). Estimates are the raw "
    "statistic or paired difference; a threshold the claim compares with is printed in the margin column. "
    "'Evidence of': finding (about normalization at this scale), "
    "limit (of this setup: horizon, size), construction (holds by design), implementation (of normlab's kernels "
    "or this machine).")

RULES = (
    "Each test has a margin, the smallest effect of interest, fixed in `training/study/claims.py` before the "
    "run: 0.05 nats for losses and LR sensitivity, log 1.25 for logs of ratios, 0.1 for log-log slopes, 5% "
    "for timing.",
    "A directional claim (the effect is > 0, or < 0) is **PASS** when the 95% interval excludes 0 on the "
    "claimed side, **FAIL** when it excludes 0 on the other side, **EQUIVALENT** when the interval lies inside "
    "±margin (a measured null: no effect of the size that matters; this takes precedence), else "
    "**INCONCLUSIVE**. A claim that nothing changes is PASS when the interval lies inside ±margin and FAIL "
    "when the effect is shown to exceed it. Each side is tested at α = 0.025 (two-sided 0.05).",
    "The claim's verdict is its primary tests'; secondary tests are judged alone and reported; mechanism "
    "checks hold by construction and judge nothing; report rows have no verdict.",
    "Multiplicity: Holm's step-down adjustment runs within each claim, across its primaries, separately for "
    "the difference and the equivalence tests (at most one of the two nulls is true for a comparison, so a "
    "verdict is false with probability ≤ α). Across claims, only the q-values (Benjamini–Hochberg) speak; "
    "running more claims never changes a verdict.",
    "A run that diverged (a non-finite loss) is an outcome, not a number, and is worse than any run that "
    "trained. With seeds where only one arm diverged, the difference test is the exact sign-flip test of the "
    "signed ranks of every seed's difference, a diverged run ranking worst: agreeing evidence from the seeds "
    "that diverged and those that trained adds up, and EQUIVALENT is impossible; the interval shown is over "
    "the seeds where both trained. Where a statistic needs every run (LR sensitivity, best LR), a diverged run "
    "counts as the seed's loss at initialization. Outcome per run: 'diverged' (non-finite, or ending, in "
    "training or held out, above the first step's loss), 'plateau' (a held-out loss within 0.05 nats of the "
    "unigram entropy of the training tokens, or above it: the model learned no more than token frequencies), "
    "else 'trains'. A test with an arm on the plateau (≥ 80% of its seeds, at the LR the statistic reads) is "
    "**AT PLATEAU**, not PASS or FAIL: its statistic measures the plateau, not the claim; so is a claim with "
    "such a primary.",
    "'At its own best LR' is cross-fitted: each seed's value is read at the LR with the lowest mean capped "
    "held-out loss over the *other* seeds, so choosing the LR does not flatter the arm; beside it, a bootstrap "
    "interval that chooses the LR again in every resample.",
    "'Reading' lines are measurements of this run unless they say 'Hypothesis'.",
)


def _setup(scale: Scale, header: dict) -> str:
    return (f"Model: dim {scale.dim}, {scale.n_heads} heads, seq {scale.seq_len}, batch {scale.batch_size}, vocab "
            f"{header['vocab_size']} (the default corpus); {scale.shallow} layers ({scale.steps} steps) for the "
            f"ordinary runs, {scale.mid} layers ({scale.steps} steps) for post- vs pre-LN, {scale.deep} layers "
            f"({scale.deep_steps} steps) for the deep arm and {scale.long_steps} steps for its long run. AdamW (β "
            "0.9/0.95, weight decay 0.1 except norms, biases, embeddings), warm-up 10% of steps unless stated, "
            f"cosine to lr/10, clip 1.0 unless 'no-clip', fp32. Base lr {scale.lr:g}. {scale.seeds} seeds per "
            f"trained configuration, {scale.init_seeds} per at-init measurement, {scale.ladder_seeds} per ladder "
            "cell. A seed sets the initialization and the order of the training batches, so arms compared at one "
            "seed share both (a paired design). Every trained run is scored on the same "
            f"{scale.val_batches} held-out batches: 'held-out loss' below.")


def _provenance(header: dict) -> str:
    """The report's provenance line: the code that measured, the claims that judged, the seeds."""
    now = claims_sha256()
    line = (f"Code: commit {header.get('commit', 'unknown (not recorded by this run)')}; claims sha256 {now} (the "
            "claims this report was judged with)")
    if header.get("claims_sha256", now) != now:
        line += f"; measured under claims sha256 {header['claims_sha256']}"
    if "seeds" in header:
        line += f"; seeds {header['seeds'][0]}–{header['seeds'][1]}"
    return line + "."


def _warnings(judged: list) -> list[str]:
    lines = [w for _, _, outcomes, _, _ in judged for w in mirror_lines(outcomes)]
    return ["", *lines] if lines else []


def write_report(out: Path, scale: Scale, judged: list, header: dict) -> None:
    """report.md: the summary table first, then the setup and rules, the revisions, one section per claim."""
    lines = [
        "# The normalization study", "",
        f"`{header['command']}` — {header['jobs']} job(s) (trained runs and at-init measurements), "
        f"{header['minutes']:.1f} minutes wall time on {header['machine']}; load average "
        f"{header['load_before']} before and {header['load_after']} after the run.", "",
        _provenance(header), "",
        "## Summary", "", SUMMARY, "", *summary_rows(judged, header_seeds(header, scale)),
        *_warnings(judged),
        "", "## Setup", "", _setup(scale, header), "",
        "## Verdict rules", "", *(f"- {r}" for r in RULES), "",
        "## Tests revised after a run", "", *(f"- {r}" for r in REVISIONS), ""]
    for claim, verdict, outcomes, ctx, plot in judged:
        lines += claim_section(claim, verdict, outcomes, ctx, plot)
    lines += ["Per-seed measurements: `measurements.csv` (every test's per-seed values) and `runs.csv` (every run)."]
    write_text_atomic(out / "report.md", "\n".join(lines) + "\n")


VERDICT_COLUMNS = ["verdict", "estimate", "ci_lo", "ci_hi", "null", "p", "q"]


def verdict_columns(o: Outcome) -> list[str]:
    """A test's verdict, its printed estimate and interval, and the deciding null with its p and q: what a
    generated comparison of two runs reads (`training.study.changes`)."""
    e, key = o.shown, deciding_null(o)
    return [o.verdict, repr(e.mean), repr(e.lo), repr(e.hi), key or "", repr(o.p[key]) if key else "",
            repr(o.q[key]) if key and key in o.q else ""]


def _est(e) -> dict | None:
    return None if e is None else vars(e)


def write_results(out: Path, judged: list, results: dict, header: dict) -> None:
    """results.json: the verdicts with their estimates and p-values, and every run's losses and final probes."""
    def seed_json(spec, r: dict) -> dict:
        final = r.get("probes", {}) if isinstance(spec, AtInit) else r["probes"].get(spec.steps, {})
        return {k: v for k, v in r.items() if k != "probes"} | {"final_probes": final}

    doc = {"header": header, "alpha": ALPHA, "claims": [
        {"number": c.number, "title": c.title, "verdict": v,
         "tests": [{"id": o.test.id, "tier": o.test.tier, "text": o.test.text, "kind": o.test.kind,
                    "margin": o.test.margin, "threshold": o.test.threshold, "verdict": o.verdict,
                    "a": _est(o.a), "b": _est(o.b), "diff": _est(o.diff), "welch": _est(o.welch),
                    "p": o.p, "p_adjusted": o.p_adjusted, "discordant": o.discordant, "power": o.power,
                    "mde": o.mde, "level": o.judgement.level if o.judgement else None,
                    "verdict_sign_flip": o.verdict_perm, "q": o.q, "verdict_fdr": o.verdict_bh,
                    "bootstrap": o.bootstrap} for o in outs]}
        for c, v, outs, _, _ in judged],
        "runs": [{"label": spec.label(), "kind": "at_init" if isinstance(spec, AtInit) else "train",
                  "seeds": [seed_json(spec, r) for r in runs]} for spec, runs in results.items()]}
    write_text_atomic(out / "results.json", json.dumps(doc, indent=1, default=str))


def _csv(rows: list[list]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def write_csvs(out: Path, judged: list, results: dict, header: dict | None = None) -> None:
    """measurements.csv: every test's per-seed values, with its verdict and the numbers the report prints for it
    (`verdict_columns`) and the run's provenance on every row; runs.csv: every trained run's held-out loss and
    outcome."""
    header = header or {}
    prov = [header.get("commit", "unknown"), claims_sha256()]
    rows = [["claim", "test", "tier", "statistic", "role_a", "role_b", "seed", "value_a", "value_b",
             *VERDICT_COLUMNS, "specified", "commit", "claims_sha256"]]
    for claim, _, outcomes, ctx, _ in judged:
        run = header_seeds(header, ctx.scale)
        for o in outcomes:
            judged_as = [*verdict_columns(o), specified(o.test.id, run)]
            for seed, x in enumerate(o.samples_a):
                y = o.samples_b[seed] if o.samples_b is not None and seed < len(o.samples_b) else ""
                rows.append([claim.number, o.test.id, o.test.tier, o.test.stat, o.test.a, o.test.b or "",
                             run.start + seed, repr(x), repr(y) if y != "" else "", *judged_as, *prov])
    write_text_atomic(out / "measurements.csv", _csv(rows))
    runs = [["configuration", "seed", "lr", "warmup", "steps", "held_out_loss", "initial_loss", "outcome",
             "diverged_at", "seconds"]]
    first = header_seeds(header, judged[0][3].scale).start if judged else 0  # seeds are numbered as run
    for spec, per_seed in results.items():
        if isinstance(spec, Train):
            for seed, r in enumerate(per_seed):
                runs.append([spec.label(), first + seed, spec.lr, spec.warmup, spec.steps, repr(final_loss(r)),
                             repr(r["losses"][0]) if r["losses"] else "", outcome(r),
                             "" if r["diverged_at"] is None else r["diverged_at"], f"{r['seconds']:.2f}"])
    write_text_atomic(out / "runs.csv", _csv(runs))
