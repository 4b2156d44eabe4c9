"""The sweep report's Markdown tables (also what `normlab compare --group_by` prints): the cells, the spec's
question judged (the cells against the baseline, or the LR groups against the baseline's group), and the LR
groups. How to read each column: docs/sweep-report.md."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.stats import ALPHA, Estimate, Judgement
from training.sweep.analysis import (
    Cell,
    Comparison,
    LrGroup,
    best_cell,
    cells_of,
    compare_groups,
    compare_to_baseline,
    lr_groups,
)
from training.sweep.results import RunResult

STATISTIC_NAMES = {"lr_sensitivity": "LR sensitivity", "best_lr": "at its own best LR (cross-fitted)"}


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _p(p: float) -> str:
    return "—" if math.isnan(p) else f"{p:.3g}"


def _interval(e: Estimate | None) -> str:
    if e is None or math.isnan(e.mean):
        return "—"
    return f"[{e.lo:+.4f}, {e.hi:+.4f}]" if e.n > 1 and e.se > 0 else "— (one seed)" if e.n == 1 else "[exact]"


def _seed_values(cell: Cell) -> str:
    return ", ".join(f"s{r.seed}: {r.outcome if r.outcome == 'diverged' else _fmt(r.final)}" for r in cell.included)


def where(run: RunResult, root: Path | None) -> str:
    """The run's directory, relative to the sweep's when inside it (a report that can be moved with it)."""
    return str(run.run_dir.relative_to(root)) if root is not None and run.run_dir.is_relative_to(root) else str(
        run.run_dir)


def cell_table(cells: Sequence[Cell], metric: str) -> list[str]:
    """Per cell: seeds, outcome counts, the final metric's mean ± sd and 95% t-interval, and each seed's value."""
    rows = [f"| cell | runs | trains / stalled / diverged | final {metric}: mean ± sd | 95% CI | per seed |",
            "|---|---|---|---|---|---|"]
    for cell in cells:
        e, counts = cell.estimate(), cell.counts()
        mean = "—" if e is None else f"{e.mean:.4f} ± {_fmt(e.sd)} (n={e.n})"
        ci = "—" if e is None else f"[{e.lo:.4f}, {e.hi:.4f}]" if e.n > 1 else "— (one seed)"
        rows.append(f"| {cell.name} | {len(cell.included)} | {counts['trains']} / {counts['stalled']} / "
                    f"{counts['diverged']} | {mean} | {ci} | {_seed_values(cell)} |")
    return rows


def _verdict(j: Judgement, judged: bool) -> str:
    if not judged:
        return "— (not the question)"
    return f"**{j.verdict}**" + (f" ‡ (sign-flip: {j.verdict_perm})" if j.disagree else "")


def _tests(j: Judgement) -> str:
    """p: t / sign-flip (raw), then Holm."""
    p, q = j.p, j.p_adjusted
    return (f"{_p(p['difference'])} / {_p(p['difference_perm'])}, {_p(q['difference'])} / "
            f"{_p(q['difference_perm'])}")


def _power(j: Judgement) -> str:
    power = "—" if math.isnan(j.power) else f"{j.power:.0%}"
    return f"{power}, {_fmt(j.mde)}"


def comparison_table(comparisons: Sequence[Comparison], baseline: str, judged: bool = True) -> list[str]:
    """Per cell against the baseline: the paired difference, its interval, the p-values (t-test and sign-flip,
    raw and Holm), the equivalence p, the seeds that diverged in one arm only, the power and MDE at the family's
    level, and the verdict (when the cells are the spec's question: `judged`)."""
    rows = [f"| cell − {baseline} | paired seeds | mean difference | 95% CI | p: t / sign-flip, Holm | "
            "equivalence p, Holm | diverged here only / in baseline only | power at ±margin, MDE (α/k) | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        j = c.judgement
        only_here, only_base = c.diverged
        rows.append(
            f"| {c.cell} | {len(c.paired)} of {len(c.shared)} | {_fmt(j.difference.mean, '+.4f')} | "
            f"{_interval(j.difference)} | {_tests(j)} | {_p(j.p['equivalence'])}, {_p(j.p_adjusted['equivalence'])} "
            f"| {only_here} / {only_base} | {_power(j)} | {_verdict(j, judged)} |")
    return rows


def group_table(judged: dict[str, list[Comparison]], baseline: str, question: str) -> list[str]:
    """Each LR group against the baseline's group, per statistic: the paired per-seed difference, its t-interval
    (and for best-LR the bootstrap interval that chooses the LR again per resample), the tests and the verdict —
    judged for the spec's question only."""
    rows = [f"| group − {baseline} | statistic | paired seeds | mean difference | 95% CI | bootstrap 95% CI (LR "
            "chosen per resample) | p: t / sign-flip, Holm | power at ±margin, MDE (α/k) | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for statistic, comparisons in judged.items():
        for c in comparisons:
            j = c.judgement
            boot = "—" if c.bootstrap is None else f"[{c.bootstrap[0]:+.4f}, {c.bootstrap[1]:+.4f}]"
            rows.append(f"| {c.cell} | {STATISTIC_NAMES[statistic]} | {len(c.paired)} | "
                        f"{_fmt(j.difference.mean, '+.4f')} | {_interval(j.difference)} | {boot} | {_tests(j)} | "
                        f"{_power(j)} | {_verdict(j, statistic == question)} |")
    return rows


def lr_table(groups: Sequence[LrGroup], metric: str, mode: str) -> list[str]:
    """Per group of cells that differ only in the LR: its best LR, the final metric there, and its LR
    sensitivity — "norm X at its own best LR" in one line."""
    rows = [f"| group | best LR | final {metric} at the best LR: mean ± sd (n), 95% CI | trains / stalled / "
            "diverged there | LR sensitivity: mean over seeds, 95% CI | score per LR |", "|---|---|---|---|---|---|"]
    for g in groups:
        best = g.best
        e = best.estimate() if best else None
        at_best = "—" if e is None else f"{e.mean:.4f} ± {_fmt(e.sd)} (n={e.n}), " + (
            f"[{e.lo:.4f}, {e.hi:.4f}]" if e.n > 1 else "one seed")
        counts = " / ".join(str(v) for v in best.counts().values()) if best else "—"
        s = g.sensitivity
        sens = "—" if s is None else f"{s.mean:.4f}" + (f", [{s.lo:.4f}, {s.hi:.4f}]" if s.n > 1 else " (one seed)")
        scores = ", ".join(f"{lr:g}: {_fmt(x)}" for lr, x in g.scores.items())
        edge = " (unbracketed: at the grid's edge)" if g.unbracketed else ""
        rows.append(f"| {g.name} | {_fmt(g.best_lr, 'g')}{edge} | {at_best} | {counts} | {sens} | {scores} |")
    cap = ", ".join(f"{g.name}: {_fmt(g.cap)}" for g in groups)
    note = (f"Score: the mean over seeds of the final {metric}, a diverged run counted as its seed's loss at "
            f"initialization and a final value above it capped there (median per group: {cap}); "
            if mode == "min" else f"Score: the mean over seeds of the final {metric}, a diverged run counted as "
            "−∞; LR sensitivity is defined for losses only; ")
    note += ("the best LR has the best score. The final value at the best LR is chosen on the same runs it is read "
             "from (optimistic): compare groups in the table of LR groups below, which is cross-fitted.")
    late = sorted({str(s) for g in groups for s in g.late_caps})
    if late:
        note += (f" Seeds {', '.join(late)}: their runs did not log the step-0 loss (written before normlab logged "
                 "it), so their cap is the first logged loss, after some updates — it depends on the LR.")
    return rows + ["", note]


def definitions(metric: str, mode: str, baseline: str | None, margin: float | None, family: str) -> str:
    """The report's definitions, in its own words (the long form: docs/sweep-report.md)."""
    better = "lower" if mode == "min" else "higher"
    text = (f"Final {metric}: its value at the last step it was logged in the run's TensorBoard events "
            f"({better} is better). Outcome (trains / stalled / diverged): diverged — the runner recorded a "
            "non-finite loss, a non-finite metric was logged, the mean of the last 10% of the logged "
            "`train/loss` values ended above the first, or a final loss ended above it; stalled — less than 0.1 "
            "nats of progress from the best of the first 20% of them; else trains. A diverged run has no final "
            "value: it is an outcome, counted above and tested below as the worst value, never averaged. "
            "Intervals: Student's t at 95% over seeds.")
    if baseline is None:
        return text
    text += (f" The question ({family}) is one family: Holm's step-down correction runs across exactly its "
             "comparisons, separately for \"different\" (the paired t-test of a zero difference, and its twin, the "
             "exact sign-flip permutation test of the same per-seed differences) and \"equivalent\" (two one-sided "
             "t-tests against ±margin, each at α/2, so before correction it rejects exactly when the 95% interval "
             "lies inside ±margin). With seeds that diverged in one arm only, \"different\" is the exact "
             "sign-flip test of the signed ranks of every seed's difference, a diverged run ranking worst. "
             f"Verdict at α = {ALPHA} after correction: ")
    text += ("EQUIVALENT if \"equivalent\" rejects, " if margin is not None else "(no margin given: no "
             "equivalence test) ")
    return text + ("else BETTER / WORSE by the sign if \"different\" rejects, else INCONCLUSIVE; ‡ marks a verdict "
                   "the sign-flip test does not share (the t-test's rests on normal tails). Power and MDE are at "
                   "α/k, the level Holm applies to the family's smallest p.")


def _family_text(question: str, baseline: str, n: int) -> str:
    what = "cell" if question == "cells" else f"LR group's {STATISTIC_NAMES[question]}"
    return f"{n} {what}{'s' if n != 1 else ''} against `{baseline}`"


def tables(sweep: dict[str, Any], results: Sequence[RunResult], root: Path | None = None) -> list[str]:
    """The report's body (Markdown lines): definitions, cells, the question's comparisons, the LR groups and
    the runs not included — also what `normlab compare --group_by` prints."""
    metric, mode, baseline, margin = sweep["metric"], sweep["mode"], sweep.get("baseline"), sweep.get("margin")
    question, family = sweep.get("question") or "cells", sweep.get("compare")
    cells = cells_of(results)
    lines = []
    steps = sorted({r.final_step for r in results if r.has_number})
    if len(steps) > 1:
        lines += [f"**Note:** the final `{metric}` was logged at different steps across runs ({steps}): those runs "
                  "are compared at different horizons.", ""]
    groups = lr_groups(cells, sweep["lr_key"], sweep.get("axes") or [], mode) if sweep.get("lr_key") else []
    compared = compare_to_baseline(cells, baseline, margin, mode, family=family if question == "cells" else None) \
        if baseline is not None else []
    base_group = next((g.name for g in groups if baseline in {c.name for c in g.cells.values()}), None)
    by_stat = {}
    if base_group is not None and len(groups) > 1:
        stats = ("lr_sensitivity", "best_lr") if mode == "min" else ("best_lr",)
        by_stat = {s: compare_groups(groups, base_group, margin, mode, s,
                                     family=family if question == s else None) for s in stats}
    size = len(compared) if question == "cells" else len(by_stat.get(question, []))
    lines += [definitions(metric, mode, baseline, margin, _family_text(question, baseline, size)
                          if baseline is not None else ""), "", "## Cells", "", *cell_table(cells, metric), ""]
    if compared:
        lines += [f"## Against the baseline `{baseline}`", "", *_best_warning(cells, compared, baseline, mode),
                  *comparison_table(compared, baseline, question == "cells"), ""]
    if groups:
        lines += [f"## Learning rate (`{sweep['lr_key']}`)", "", *lr_table(groups, metric, mode), ""]
    if by_stat:
        lines += [f"## LR groups against `{base_group}`", "", *group_table(by_stat, base_group, question), ""]
    missing = [r for r in results if not r.included]
    if missing:
        lines += ["## Not included", "", *(f"- `{where(r, root)}` ({r.cell}): {r.status}" for r in missing), ""]
    return lines


def _best_warning(cells: Sequence[Cell], compared: Sequence[Comparison], baseline: str, mode: str) -> list[str]:
    """A warning when the baseline is the best of the cells it is compared with: if it was chosen after the
    runs, every difference favours it by construction."""
    pool = [c for c in cells if c.name == baseline or c.name in {x.cell for x in compared}]
    if len(pool) < 2 or best_cell(pool, mode) != baseline:
        return []
    return [f"**Warning:** the baseline `{baseline}` is the best of the {len(pool)} cells compared. If it was "
            "chosen after seeing the results, every difference favours it by construction (the winner's curse: "
            "under no true difference at all, the best of k cells beats the others by about the spread of a "
            "cell's mean); its verdicts are only as good as the choice was made before the runs.", ""]
