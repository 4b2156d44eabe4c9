"""The sweep report's Markdown tables (also what `normlab compare --group_by` prints): the cells, the spec's
question judged (the cells against the baseline, or the LR groups against the baseline's group), and the LR
groups. How to read each column: docs/sweep-report.md."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.stats import ALPHA, PLATEAU_NATS, Reduction
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
from training.sweep.rows import comparison_table, fmt, interval, power, tests, verdict
from training.sweep.stability import sections

STATISTIC_NAMES = {"lr_sensitivity": "LR sensitivity", "best_lr": "at its own best LR (cross-fitted)"}


def _seed_values(cell: Cell) -> str:
    return ", ".join(f"s{r.seed}: {r.outcome if r.outcome == 'diverged' else fmt(r.final)}" for r in cell.included)


def where(run: RunResult, root: Path | None) -> str:
    """The run's directory, relative to the sweep's when inside it (a report that can be moved with it)."""
    return str(run.run_dir.relative_to(root)) if root is not None and run.run_dir.is_relative_to(root) else str(
        run.run_dir)


def cell_table(cells: Sequence[Cell], metric: str) -> list[str]:
    """Per cell: seeds, outcome counts, the final metric's mean ± sd and 95% t-interval, and each seed's value."""
    rows = [f"| cell | runs | trains / plateau / diverged | final {metric}: mean ± sd | 95% CI | per seed |",
            "|---|---|---|---|---|---|"]
    for cell in cells:
        e, counts = cell.estimate(), cell.counts()
        mean = "—" if e is None else f"{e.mean:.4f} ± {fmt(e.sd)} (n={e.n})"
        ci = "—" if e is None else f"[{e.lo:.4f}, {e.hi:.4f}]" if e.n > 1 else "— (one seed)"
        rows.append(f"| {cell.name} | {len(cell.included)} | {counts['trains']} / {counts['plateau']} / "
                    f"{counts['diverged']} | {mean} | {ci} | {_seed_values(cell)} |")
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
                        f"{fmt(j.difference.mean, '+.4f')} | {interval(j.difference)} | {boot} | {tests(j)} | "
                        f"{power(j)} | {verdict(j, statistic == question)} |")
    return rows


def lr_table(groups: Sequence[LrGroup], metric: str, mode: str) -> list[str]:
    """Per group of cells that differ only in the LR: its best LR, the final metric there, and its LR
    sensitivity — "norm X at its own best LR" in one line."""
    rows = [f"| group | best LR | final {metric} at the best LR: mean ± sd (n), 95% CI | trains / plateau / "
            "diverged there | LR sensitivity: mean over seeds, 95% CI | score per LR |", "|---|---|---|---|---|---|"]
    for g in groups:
        best = g.best
        e = best.estimate() if best else None
        at_best = "—" if e is None else f"{e.mean:.4f} ± {fmt(e.sd)} (n={e.n}), " + (
            f"[{e.lo:.4f}, {e.hi:.4f}]" if e.n > 1 else "one seed")
        counts = " / ".join(str(v) for v in best.counts().values()) if best else "—"
        s = g.sensitivity
        sens = "—" if s is None else f"{s.mean:.4f}" + (f", [{s.lo:.4f}, {s.hi:.4f}]" if s.n > 1 else " (one seed)")
        scores = ", ".join(f"{lr:g}: {fmt(x)}" for lr, x in g.scores.items())
        edge = " (unbracketed: at the grid's edge)" if g.unbracketed else ""
        rows.append(f"| {g.name} | {fmt(g.best_lr, 'g')}{edge} | {at_best} | {counts} | {sens} | {scores} |")
    cap = ", ".join(f"{g.name}: {fmt(g.cap)}" for g in groups)
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


def definitions(metric: str, mode: str, baseline: str | None, margin: float | None, family: str,
                reduce: Reduction | None = None) -> str:
    """The report's definitions, in its own words (the long form: docs/sweep-report.md)."""
    better = "lower" if mode == "min" else "higher"
    reduce = reduce or Reduction()
    read = ("its value at the last step it was logged" if reduce.kind == "final" else
            f"the {reduce.describe(metric)}, over the values logged")
    text = (f"Final {metric}: {read} in the run's TensorBoard events ({better} is better). Outcome (trains / "
            "plateau / diverged): diverged — the runner recorded a "
            "non-finite loss, a non-finite metric was logged, the mean of the last 10% of the logged "
            "`train/loss` values ended above the first, or a final loss ended above it; plateau — the final loss "
            f"(else the mean of that tail) is within {PLATEAU_NATS:g} nats of the unigram entropy of the run's "
            "training data or above it (a model that learned the token frequencies and no more); else trains. "
            "A diverged run has no final "
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
                   "the sign-flip test does not share (the t-test's rests on normal tails), and with too few seeds for "
                   "the sign-flip test to reach α/k at all (2/2ⁿ is its smallest p: 6 seeds at α = 0.05) there is no "
                   "verdict. Power and MDE are at α/k, the level Holm applies to the family's smallest p.")


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
    reduce, outcomes = Reduction.parse(sweep.get("reduce", "final")), sweep.get("outcomes") or {}
    lines += [definitions(metric, mode, baseline, margin, _family_text(question, baseline, size)
                          if baseline is not None else "", reduce), "", "## Cells", "",
              *cell_table(cells, metric), ""]
    if compared:
        # a baseline the spec fixed before the runs cannot be the winner's curse; one chosen afterwards can
        warning = [] if sweep.get("baseline_from") == "spec" else _best_warning(cells, compared, baseline, mode)
        lines += [f"## Against the baseline `{baseline}`", "", *warning,
                  *comparison_table(compared, baseline, question == "cells"), ""]
    if groups:
        lines += [f"## Learning rate (`{sweep['lr_key']}`)", "", *lr_table(groups, metric, mode), ""]
    if by_stat:
        lines += [f"## LR groups against `{base_group}`", "", *group_table(by_stat, base_group, question), ""]
    lines += sections(outcomes, cells, groups, baseline, base_group, mode, family if question == "cells" else None,
                      family if question != "cells" else None)
    missing = [r for r in results if not r.included]
    if missing:
        lines += ["## Not included", "", *(f"- `{where(r, root)}` ({r.cell}): {r.status}" for r in missing), ""]
    return lines


def _best_warning(cells: Sequence[Cell], compared: Sequence[Comparison], baseline: str, mode: str) -> list[str]:
    """A warning when the baseline is the best of the cells it is compared with: if it was chosen after the
    runs, every difference favours it by construction (`normlab compare --baseline`; a sweep's baseline is fixed
    in its spec before the runs)."""
    pool = [c for c in cells if c.name == baseline or c.name in {x.cell for x in compared}]
    if len(pool) < 2 or best_cell(pool, mode) != baseline:
        return []
    return [f"**Warning:** the baseline `{baseline}` is the best of the {len(pool)} cells compared. If it was "
            "chosen after seeing the results, every difference favours it by construction (the winner's curse: "
            "under no true difference at all, the best of k cells beats the others by about the spread of a "
            "cell's mean); its verdicts are only as good as the choice was made before the runs.", ""]
