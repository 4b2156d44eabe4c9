"""The Markdown cells every table of the sweep's report shares: numbers, intervals, p-values and verdicts, and the
table of comparisons against the baseline (the final metric's and each stability outcome's).

A verdict is printed as decisive only where both of its tests can decide (`verdict`): with too few seeds for
the exact sign-flip test to reach its level at all, the row says so instead of resting a bold verdict on the
t-test's normal tails (docs/sweep-report.md)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from training.stats import Estimate, Judgement, seeds_for_exact
from training.sweep.analysis import Comparison


def fmt(x: float | None, spec: str = ".4f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def p_text(p: float) -> str:
    return "—" if math.isnan(p) else f"{p:.3g}"


def interval(e: Estimate | None) -> str:
    if e is None or math.isnan(e.mean):
        return "—"
    return f"[{e.lo:+.4f}, {e.hi:+.4f}]" if e.n > 1 and e.se > 0 else "— (one seed)" if e.n == 1 else "[exact]"


def verdict(j: Judgement, judged: bool, untested: str = "no test") -> str:
    """The verdict cell: `— (not the question)` outside the question's family; `— (untested)` without a test;
    no verdict where the exact test cannot decide at this many seeds; else the bold verdict, ‡ where the
    sign-flip twin disagrees."""
    if not judged:
        return "— (not the question)"
    if math.isnan(j.p["difference"]) and math.isnan(j.p["equivalence"]) and math.isnan(j.p["equivalence_perm"]):
        return f"— ({untested})"
    if not j.exact_can_decide:
        need = seeds_for_exact(j.level)
        alone = "" if j.exact_only else f" (the t-test alone: {j.verdict})"
        return (f"no verdict: {j.seeds} seed{'s' if j.seeds != 1 else ''}, and the exact sign-flip test needs ≥ "
                f"{need} to reach α/k = {j.level:.3g}{alone}")
    return f"**{j.verdict}**" + (f" ‡ (sign-flip: {j.verdict_perm})" if j.disagree else "")


def tests(j: Judgement) -> str:
    """p: t / sign-flip (raw), then Holm."""
    p, q = j.p, j.p_adjusted
    return (f"{p_text(p['difference'])} / {p_text(p['difference_perm'])}, {p_text(q['difference'])} / "
            f"{p_text(q['difference_perm'])}")


def power(j: Judgement) -> str:
    shown = "—" if math.isnan(j.power) else f"{j.power:.0%}"
    return f"{shown}, {fmt(j.mde)}"


def comparison_table(comparisons: Sequence[Comparison], baseline: str, judged: bool = True,
                     untested: str = "no test") -> list[str]:
    """Per cell against the baseline: the paired difference, its interval, the p-values (t-test and sign-flip,
    raw and Holm; a count's exact test twice), the equivalence p (a count's: the sign-flip TOST), the seeds that
    diverged in one arm only, the power and MDE at the family's level, and the verdict (when the cells are the
    question: `judged`)."""
    rows = [f"| cell − {baseline} | paired seeds | mean difference | 95% CI | p: t / sign-flip, Holm | "
            "equivalence p, Holm | diverged here only / in baseline only | power at ±margin, MDE (α/k) | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        j = c.judgement
        key = "equivalence_perm" if j.exact_only else "equivalence"
        only_here, only_base = c.diverged
        rows.append(
            f"| {c.cell} | {len(c.paired)} of {len(c.shared)} | {fmt(j.difference.mean, '+.4f')} | "
            f"{interval(j.difference)} | {tests(j)} | {p_text(j.p[key])}, {p_text(j.p_adjusted[key])} "
            f"| {only_here} / {only_base} | {power(j)} | {verdict(j, judged, untested)} |")
    return rows
