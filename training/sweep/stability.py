"""The report's stability sections: each outcome of the spec's `outcomes` (training/sweep/outcomes.py) per cell and
against the baseline — loss spikes (a count, judged by the exact test alone), the peak max attention logit, and the
LR reach of each LR group against the baseline's group. Each outcome is its own family, judged against its own
margin (how to read them: docs/sweep-report.md)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from training import health_tags as T
from training.stats import compare_reach, judge_reach, lr_reach, reach_interval
from training.sweep.analysis import Cell, LrGroup, compare_to_baseline
from training.sweep.outcomes import UNITS
from training.sweep.rows import comparison_table, fmt, p_text, verdict

TITLES = {"spikes": "loss spikes", "max_logit_peak": "peak max attention logit", "lr_reach": "LR reach"}


def _margin(rule: dict[str, Any], name: str) -> str:
    return f"margin ±{rule['margin']:g} {UNITS[name]}" if rule.get("margin") is not None else "no margin"


def _definition(name: str, rule: dict[str, Any], cells: Sequence[Cell]) -> str:
    if name == "spikes":
        every = sorted({r.loss_every for c in cells for r in c.included if r.loss_every})
        sparse = (f" The runs logged `train/loss` every {', '.join(map(str, every))} steps, so the count sees only "
                  "those steps (`trainer.log_every_n_steps: 1` counts every step, as the guard sees them)."
                  if any(e > 1 for e in every) else "")
        return (f"A spike: a logged `train/loss` whose z-score against the {rule['window']} earlier ones exceeds "
                f"{rule['threshold']:g} (the non-finite guard's `guard/loss_z` rule), counted per run; judged on the "
                "per-seed count differences by the exact sign-flip test alone; a diverged run counts as the most "
                f"spikes; lower is better; {_margin(rule, name)}.{sparse}")
    return ("The largest exact pre-softmax attention logit over training, every layer and head (the worst head "
            f"of `{T.ATTN_MAX_LOGIT_EXACT}`, logged every `metrics.every_n_steps`); paired t-test and its "
            f"sign-flip twin; a diverged run counts as the largest; lower is better; {_margin(rule, name)}.")


def outcome_section(name: str, rule: dict[str, Any], cells: Sequence[Cell], baseline: str | None,
                    family: Sequence[str] | None) -> list[str]:
    """One per-run outcome: its definition, each cell's values and, with a baseline, the family's comparisons."""
    rows = [f"## Stability: {TITLES[name]}", "", _definition(name, rule, cells), "",
            "| cell | runs with a value | mean ± sd (n) | per seed |", "|---|---|---|---|"]
    for cell in cells:
        values = {r.seed: r.values.get(name, math.nan) for r in cell.included}
        numbers = [v for r in cell.included if r.outcome != "diverged" and math.isfinite(v := values[r.seed])]
        mean = (f"{sum(numbers) / len(numbers):.4g} ± {fmt(_sd(numbers), '.3g')} (n={len(numbers)})" if numbers
                else "—")
        seeds = ", ".join(f"s{r.seed}: {'diverged' if r.outcome == 'diverged' else fmt(values[r.seed], '.4g')}"
                          for r in cell.included)
        rows.append(f"| {cell.name} | {len(numbers)} | {mean} | {seeds} |")
    if baseline is not None:
        compared = compare_to_baseline(cells, baseline, rule.get("margin"), "min", family=family, outcome=name)
        untested = "no spikes in either arm" if name == "spikes" else "no value in either arm"
        rows += ["", *comparison_table(compared, baseline, True, untested)]
    return [*rows, ""]


def _sd(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _curves(group: LrGroup, seeds: Sequence[Any]) -> tuple[list[float], list[list[float]]]:
    """(the group's LRs ascending, [LR][seed] capped final metrics of `seeds`)."""
    lrs = list(group.cells)
    return lrs, [[group.grid[s][i] for s in seeds] for i in range(len(lrs))]


def reach_section(rule: dict[str, Any], groups: Sequence[LrGroup], base_group: str | None, mode: str,
                  family: Sequence[str] | None) -> list[str]:
    """Each LR group's reach (seed-mean curve, bootstrap interval) and, with a baseline group, each group of the
    family against it (`training.stats.compare_reach`, Holm across the family)."""
    delta = rule["delta"]
    rows = ["## Stability: LR reach", "",
            f"The width, in decades of LR, of the range around each group's best LR where the seed-mean final metric "
            f"stays within {delta:g} of that best, its ends interpolated linearly in log₁₀ LR (a diverged run counts "
            "as its seed's loss at initialization); ≥ where the range runs to an end of the grid (an unbracketed "
            f"best LR always does); a wider reach is better; {_margin(rule, 'lr_reach')}. Differences: jackknife "
            "t-interval and test over seeds, the exact permutation test that swaps the two groups' runs within "
            "seeds, and a paired bootstrap.", "",
            "| group | best LR | reach (decades) | range of LR | bootstrap 95% CI | seeds |",
            "|---|---|---|---|---|---|"]
    for g in groups:
        if len(g.cells) < 2 or not g.grid:
            continue
        lrs, per_lr = _curves(g, list(g.grid))
        r = lr_reach(lrs, [sum(row) / len(row) for row in per_lr], delta, mode)
        lo, hi = reach_interval(lrs, per_lr, delta, mode)
        edge = " (unbracketed)" if r.unbracketed else ""
        rows.append(f"| {g.name} | {r.best_lr:g}{edge} | {'≥ ' if r.at_least else ''}{r.width:.3f} | "
                    f"{10 ** r.low:.3g} to {10 ** r.high:.3g} | [{fmt(lo, '.3f')}, {fmt(hi, '.3f')}] | {len(g.grid)} |")
    base = next((g for g in groups if g.name == base_group), None)
    if base is None:
        return [*rows, ""]
    comparisons, shared = {}, {}
    for g in groups:
        if g is base or (family is not None and g.name not in family) or list(g.cells) != list(base.cells):
            continue
        shared[g.name] = [s for s in g.grid if s in base.grid]
        if shared[g.name]:
            comparisons[g.name] = compare_reach(list(g.cells), _curves(g, shared[g.name])[1],
                                                _curves(base, shared[g.name])[1], delta, mode)
    judged = judge_reach(comparisons, rule.get("margin"))
    rows += ["", f"| group − {base_group} | paired seeds | reach difference | 95% CI (jackknife) | bootstrap 95% CI | "
             "p: jackknife t / permutation, Holm | equivalence p: t / bootstrap, Holm | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in comparisons.items():
        j, e = judged[name], c.estimate
        untested = ("a reach is a lower bound (≥): the grid does not contain its range" if c.censored
                    else "too few seeds")
        bounds = " (of lower bounds)" if c.censored else ""
        rows.append(f"| {name} | {len(shared[name])} | {fmt(e.mean, '+.3f')}{bounds} | "
                    f"[{fmt(e.lo, '+.3f')}, {fmt(e.hi, '+.3f')}] | "
                    f"[{fmt(c.bootstrap[0], '+.3f')}, {fmt(c.bootstrap[1], '+.3f')}] | "
                    f"{p_text(j.p['difference'])} / {p_text(j.p['difference_perm'])}, "
                    f"{p_text(j.p_adjusted['difference'])} / {p_text(j.p_adjusted['difference_perm'])} | "
                    f"{p_text(j.p['equivalence'])} / {p_text(j.p['equivalence_perm'])}, "
                    f"{p_text(j.p_adjusted['equivalence'])} / {p_text(j.p_adjusted['equivalence_perm'])} | "
                    f"{verdict(j, True, untested)} |")
    return [*rows, ""]


def sections(outcomes: dict[str, dict[str, Any]], cells: Sequence[Cell], groups: Sequence[LrGroup],
             baseline: str | None, base_group: str | None, mode: str, cell_family: Sequence[str] | None,
             group_family: Sequence[str] | None) -> list[str]:
    """Every stability section the outcomes ask for, in `outcomes`' order (the reach needs LR groups)."""
    lines: list[str] = []
    for name, rule in outcomes.items():
        if name == "lr_reach":
            lines += reach_section(rule, groups, base_group, mode, group_family) if groups else []
        else:
            lines += outcome_section(name, rule, cells, baseline, cell_family)
    return lines
