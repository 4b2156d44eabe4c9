"""`normlab sweep SPEC --report`: a sweep's report, from `<sweep>/sweep.json` and each run's own TensorBoard
events — report.md, runs.csv (every run's numbers) and the plots, written atomically into `<sweep>/report/`.

How to read it, and the statistics behind each column: docs/sweep-report.md. The tables are also what
`normlab compare --group_by` prints (training/compare.py).
"""
from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.checkpointing.layout import write_text_atomic
from training.errors import UserError
from training.rundir import RunDir
from training.stats import ALPHA, Estimate
from training.sweep import plots
from training.sweep.analysis import Cell, Comparison, LrGroup, cells_of, compare_to_baseline, lr_groups
from training.sweep.results import RunResult, plain_tags, result

STATE_FILE = "sweep.json"
REPORT_DIR = "report"
MODES = ("min", "max")


def _where(run: RunResult, root: Path | None) -> str:
    """The run's directory, relative to the sweep's when inside it (a report that can be moved with it)."""
    return str(run.run_dir.relative_to(root)) if root is not None and run.run_dir.is_relative_to(root) else str(
        run.run_dir)


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


def comparison_table(comparisons: Sequence[Comparison], baseline: str) -> list[str]:
    """Per cell against the baseline: the paired difference, its interval, the Holm-adjusted p-values, the
    seeds that diverged in one arm only, and the verdict."""
    rows = [f"| cell − {baseline} | paired seeds | mean difference | 95% CI | p, Holm | equivalence p, Holm | "
            "diverged here only / in baseline only: p, Holm | verdict |", "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        j = c.judgement
        d = j.difference
        only_here, only_base = j.discordant
        rows.append(
            f"| {c.cell} | {len(c.paired)} of {len(c.shared)} | {_fmt(d.mean, '+.4f')} | {_interval(d)} | "
            f"{_p(j.p_difference)}, {_p(j.p_difference_adjusted)} | {_p(j.p_equivalent)}, "
            f"{_p(j.p_equivalent_adjusted)} | {only_here} / {only_base}: {_p(j.p_outcome)}, "
            f"{_p(j.p_outcome_adjusted)} | **{j.verdict}** |")
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
        rows.append(f"| {g.name} | {_fmt(g.best_lr, 'g')} | {at_best} | {counts} | {sens} | {scores} |")
    cap = ", ".join(f"{g.name}: {_fmt(g.cap)}" for g in groups)
    note = (f"Score: the mean over seeds of the final {metric}, a diverged run counted as the group's initial "
            f"loss and a final value above it capped there ({cap}); " if mode == "min" else
            f"Score: the mean over seeds of the final {metric}, a diverged run counted as −∞; LR sensitivity "
            "is defined for losses only; ")
    return rows + ["", note + "the best LR has the best score."]


def definitions(metric: str, mode: str, baseline: str | None, margin: float | None, compared: int = 0) -> str:
    """The report's definitions, in its own words (the long form: docs/sweep-report.md)."""
    better = "lower" if mode == "min" else "higher"
    text = (f"Final {metric}: its value at the last step it was logged in the run's TensorBoard events "
            f"({better} is better). Outcome (trains / stalled / diverged): diverged — the runner recorded a "
            "non-finite loss, a non-finite metric was logged, or the mean of the last 10% of the logged "
            "`train/loss` values ended above the first; stalled — less than 0.1 nats of progress from the best "
            "of the first 20% of them; else trains. A diverged run has no final value: it is an outcome, counted "
            "above and tested below, never averaged. Intervals: Student's t at 95% over seeds.")
    if baseline is None:
        return text
    text += (f" Against `{baseline}`: the difference of each seed's final value (cell − baseline, same seed: "
             "same initialization and, with a paired data order, the same batches), its mean and t-interval. "
             f"Holm's step-down correction across the {compared} cells compared, separately for three families of "
             "p-values: \"different\" (the paired t-test of a zero difference), \"equivalent\" (two one-sided "
             "t-tests against ±margin, each at α/2, so before correction it rejects exactly when the 95% "
             "interval lies inside ±margin), and the McNemar exact test on the seeds that diverged in one arm "
             f"only. Verdict at α = {ALPHA} after correction: ")
    text += ("EQUIVALENT if \"equivalent\" rejects, " if margin is not None else "(no margin given: no "
             "equivalence test) ")
    return text + ("else BETTER / WORSE by the sign if \"different\" rejects, else INCONCLUSIVE; when a seed "
                   "diverged in one arm only, the divergence test decides (the arm that diverges less is BETTER "
                   "when it rejects, INCONCLUSIVE when it does not).")


def csv_text(results: Sequence[RunResult], axes: Sequence[str], root: Path | None = None) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["cell", *axes, "seed", "status", "outcome", "final", "final_step", "steps", "tokens",
                     "initial_loss", "run_dir"])
    for r in results:
        writer.writerow([r.cell, *(r.params.get(a) for a in axes), r.seed, r.status, r.outcome or "",
                         "" if math.isnan(r.final) else repr(r.final), r.final_step if r.final_step is not None
                         else "", r.steps, int(r.tokens), "" if math.isnan(r.initial_loss) else repr(r.initial_loss),
                         _where(r, root)])
    return buf.getvalue()


def load_sweep(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json, checked: one UserError line for what is missing or wrong."""
    path = sweep_dir / STATE_FILE
    if not path.is_file():
        raise UserError(f"no {STATE_FILE} in '{sweep_dir}': pass a sweep directory (runs/<name>/, written by "
                        "`normlab sweep SPEC.yaml`)")
    try:
        sweep = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"'{path}' is not readable JSON ({err}): run `normlab sweep SPEC.yaml` again to "
                        "rewrite it") from err
    for key in ("metric", "mode", "runs"):
        if key not in (sweep if isinstance(sweep, dict) else {}):
            raise UserError(f"'{path}' has no '{key}': it was not written by `normlab sweep`; run it again")
    if sweep["mode"] not in MODES:
        raise UserError(f"'{path}': mode {sweep['mode']!r} must be one of {list(MODES)} (set `mode:` in the spec)")
    margin = sweep.get("margin")
    if margin is not None and not (isinstance(margin, (int, float)) and margin > 0):
        raise UserError(f"'{path}': margin {margin!r} must be a number > 0 (set `margin:` in the spec)")
    return sweep


def read_results(sweep_dir: Path, sweep: dict[str, Any]) -> list[RunResult]:
    """Every run of sweep.json, read from its own directory (relative to the sweep directory)."""
    out = []
    for i, run in enumerate(sweep["runs"]):
        try:
            cell, params, seed, rel, status = (run[k] for k in ("cell", "params", "seed", "run_dir", "status"))
        except (KeyError, TypeError) as err:
            raise UserError(f"'{sweep_dir / STATE_FILE}': run #{i} lacks {err}: run `normlab sweep SPEC.yaml` "
                            "again to rewrite it") from err
        out.append(result(cell, params, seed, sweep_dir / rel, status, sweep["metric"]))
    return out


def check(results: Sequence[RunResult], sweep: dict[str, Any], where: str = "") -> None:
    """One line for a report that cannot be made: no finished run, a metric no run logs, a baseline that is no
    cell. `where`: the file the fields come from, to name in the message."""
    at = f"{where}: " if where else ""
    included = [r for r in results if r.included]
    if not included:
        statuses = ", ".join(f"{s} ×{n}" for s, n in Counter(r.status for r in results).items()) or "no runs"
        raise UserError(f"{at}nothing to report yet — no run has finished ({statuses}); run the sweep first")
    metric = sweep["metric"]
    if not any(metric in r.curves for r in included) and not all(r.outcome == "diverged" for r in included):
        logged = plain_tags(t for r in included if r.curves for t in RunDir(r.run_dir).scalars)
        raise UserError(f"{at}metric {metric!r} is logged by none of the {len(included)} runs that finished or "
                        f"diverged; choose a scalar tag they log, e.g. {', '.join(logged[:12])}")
    baseline = sweep.get("baseline")
    cells = list(dict.fromkeys(r.cell for r in results))
    if baseline is not None and baseline not in cells:
        raise UserError(f"{at}baseline {baseline!r} is not a cell; choose one of {cells}")


def tables(sweep: dict[str, Any], results: Sequence[RunResult], root: Path | None = None) -> list[str]:
    """The report's body (Markdown lines): definitions, cells, comparisons with the baseline, the LR groups and
    the runs not included — also what `normlab compare --group_by` prints."""
    metric, mode, baseline, margin = sweep["metric"], sweep["mode"], sweep.get("baseline"), sweep.get("margin")
    cells = cells_of(results)
    lines = []
    steps = sorted({r.final_step for r in results if r.has_number})
    if len(steps) > 1:
        lines += [f"**Note:** the final `{metric}` was logged at different steps across runs ({steps}): those runs "
                  "are compared at different horizons.", ""]
    comparisons = compare_to_baseline(cells, baseline, margin, mode) if baseline is not None else []
    lines += [definitions(metric, mode, baseline, margin, len(comparisons)), "", "## Cells", "",
              *cell_table(cells, metric), ""]
    if comparisons:
        lines += [f"## Against the baseline `{baseline}`", "", *comparison_table(comparisons, baseline), ""]
    if sweep.get("lr_key"):
        groups = lr_groups(cells, sweep["lr_key"], sweep.get("axes") or [], mode)
        lines += [f"## Learning rate (`{sweep['lr_key']}`)", "", *lr_table(groups, metric, mode), ""]
    missing = [r for r in results if not r.included]
    if missing:
        lines += ["## Not included", "", *(f"- `{_where(r, root)}` ({r.cell}): {r.status}" for r in missing), ""]
    return lines


def render(sweep: dict[str, Any], results: Sequence[RunResult], plot_names: Sequence[str],
           root: Path | None = None) -> str:
    """report.md's text."""
    baseline, margin = sweep.get("baseline"), sweep.get("margin")
    statuses = ", ".join(f"{s} ×{n}" for s, n in Counter(r.status for r in results).items())
    lines = [f"# Sweep `{sweep.get('name', '?')}`", "",
             f"{len(results)} runs ({statuses}) in {len(cells_of(results))} cells; metric `{sweep['metric']}` "
             f"({'lower' if sweep['mode'] == 'min' else 'higher'} is better); baseline `{baseline}`"
             + (f", margin ±{margin:g}" if margin is not None else ", no margin") + ".", "",
             *tables(sweep, results, root), "## Plots", "", *(f"![{name}]({name})" for name in plot_names), "",
             "Every run's numbers: [runs.csv](runs.csv)."]
    return "\n".join(lines) + "\n"


def write_report(sweep_dir: Path, out_dir: Path | None = None) -> Path:
    """Write report.md, runs.csv and the plots of the sweep in `sweep_dir` into `out_dir` (default
    `<sweep_dir>/report/`), each file atomically; returns the report's path."""
    sweep_dir = Path(sweep_dir)
    sweep = load_sweep(sweep_dir)
    results = read_results(sweep_dir, sweep)
    check(results, sweep, str(sweep_dir / STATE_FILE))
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir / REPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = cells_of(results)
    names = ["curves.png"]
    plots.curves(cells, plots.curve_tags(sweep["metric"]), out_dir / names[0])
    if sweep.get("lr_key"):
        names.append("lr.png")
        plots.lr_curves(lr_groups(cells, sweep["lr_key"], sweep.get("axes") or [], sweep["mode"]), sweep["metric"],
                        out_dir / names[1])
    axes = sweep.get("axes") or sorted({k for r in results for k in r.params})
    write_text_atomic(out_dir / "runs.csv", csv_text(results, axes, sweep_dir))
    report = out_dir / "report.md"
    write_text_atomic(report, render(sweep, results, names, sweep_dir))
    return report
