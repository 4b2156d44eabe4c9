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

from data.atomic import write_text_atomic
from training import safe_yaml
from training.errors import UserError
from training.run.dir import RunDir
from training.run.layout import SWEEP_STATE_FILE
from training.stats import MODES, Reduction
from training.sweep import plots
from training.sweep.analysis import cells_of, lr_groups
from training.sweep.outcomes import parse_outcomes
from training.sweep.results import RunResult, plain_tags, result
from training.sweep.spec import QUESTIONS
from training.sweep.tables import tables, where

REPORT_DIR = "report"


def _number(x: float) -> str:
    return "" if math.isnan(x) else repr(x)


def csv_text(results: Sequence[RunResult], axes: Sequence[str], root: Path | None = None,
             outcomes: Sequence[str] = ()) -> str:
    """runs.csv: one row per run; `outcomes`: the per-run stability outcomes' columns (spikes, max_logit_peak)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = [o for o in outcomes if o in ("spikes", "max_logit_peak")]
    writer.writerow(["cell", *axes, "seed", "status", "outcome", "final", "final_step", "steps", "tokens",
                     "initial_loss", "initial_step", *columns, "run_dir"])
    for r in results:
        writer.writerow([r.cell, *(r.params.get(a) for a in axes), r.seed, r.status, r.outcome or "",
                         _number(r.final), r.final_step if r.final_step is not None
                         else "", r.steps, int(r.tokens), _number(r.initial_loss),
                         "" if r.initial_step is None else r.initial_step,
                         *(_number(r.values.get(c, math.nan)) for c in columns), where(r, root)])
    return buf.getvalue()


def _value(text: str) -> Any:
    """An axis value as runs.csv wrote it (str of the value; "" for null)."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return safe_yaml.load(text, "a runs.csv value")


def csv_results(text: str, axes: Sequence[str]) -> list[RunResult]:
    """The runs of a runs.csv (`csv_text`'s columns) as results the report's tables take: every number but the
    curves — so a report's tables can be rebuilt, or runs.csv files of two sweeps joined, without the runs."""
    def number(row: dict[str, str], key: str) -> float:
        return float(row[key]) if row.get(key) not in (None, "") else math.nan

    out = []
    for row in csv.DictReader(io.StringIO(text)):
        params = {a: _value(row[a]) for a in axes}
        seed = int(row["seed"]) if row["seed"].lstrip("-").isdigit() else row["seed"]
        values = {k: number(row, k) for k in ("spikes", "max_logit_peak") if k in row}
        out.append(RunResult(row["cell"], params, seed, Path(row["run_dir"]), row["status"], row["outcome"] or None,
                             number(row, "final"), int(row["final_step"]) if row["final_step"] else None,
                             int(row["steps"] or 0), float(row["tokens"] or 0), number(row, "initial_loss"),
                             int(row["initial_step"]) if row["initial_step"] else None, values=values))
    return out


def load_sweep(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json, checked: one UserError line for what is missing or wrong."""
    path = sweep_dir / SWEEP_STATE_FILE
    if not path.is_file():
        raise UserError(f"no {SWEEP_STATE_FILE} in '{sweep_dir}': pass a sweep directory (runs/<name>/, written by "
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
    if sweep.get("question", "cells") not in QUESTIONS:
        raise UserError(f"'{path}': question {sweep['question']!r} must be one of {list(QUESTIONS)} (set "
                        "`question:` in the spec)")
    try:
        judging_rules(sweep)
    except ValueError as err:
        raise UserError(f"'{path}': {err} (set it in the spec)") from err
    return sweep


def judging_rules(sweep: dict[str, Any]) -> tuple[Reduction, dict[str, dict[str, Any]]]:
    """The metric's reduction and the outcomes' rules a sweep.json (or compare's flags) records."""
    return Reduction.parse(sweep.get("reduce", "final")), parse_outcomes(sweep.get("outcomes"))


def read_results(sweep_dir: Path, sweep: dict[str, Any]) -> list[RunResult]:
    """Every run of sweep.json, read from its own directory (relative to the sweep directory)."""
    out = []
    for i, run in enumerate(sweep["runs"]):
        try:
            cell, params, seed, rel, status = (run[k] for k in ("cell", "params", "seed", "run_dir", "status"))
        except (KeyError, TypeError) as err:
            raise UserError(f"'{sweep_dir / SWEEP_STATE_FILE}': run #{i} lacks {err}: run `normlab sweep SPEC.yaml` "
                            "again to rewrite it") from err
        out.append(result(cell, params, seed, sweep_dir / rel, status, sweep["metric"], None, *judging_rules(sweep)))
    return out


def check(results: Sequence[RunResult], sweep: dict[str, Any], source: str = "") -> None:
    """One line for a report that cannot be made: no finished run, a metric no run logs, a baseline that is no
    cell. `source`: the file the fields come from, to name in the message."""
    at = f"{source}: " if source else ""
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


def render(sweep: dict[str, Any], results: Sequence[RunResult], plot_names: Sequence[str],
           root: Path | None = None) -> str:
    """report.md's text."""
    baseline, margin = sweep.get("baseline"), sweep.get("margin")
    statuses = ", ".join(f"{s} ×{n}" for s, n in Counter(r.status for r in results).items())
    order = {"seed": "the data order varies with the seed", "fixed": "one data order for every run"}.get(
        sweep.get("data_order"), "data order not recorded")
    lines = [f"# Sweep `{sweep.get('name', '?')}`", "",
             f"{len(results)} runs ({statuses}) in {len(cells_of(results))} cells; metric `{sweep['metric']}` "
             f"({'lower' if sweep['mode'] == 'min' else 'higher'} is better); baseline `{baseline}`"
             + (f", margin ±{margin:g}" if margin is not None else ", no margin")
             + f"; question `{sweep.get('question') or 'cells'}`; {order}.", "",
             *tables(sweep, results, root), "## Plots", "", *(f"![{name}]({name})" for name in plot_names), "",
             "Every run's numbers: [runs.csv](runs.csv)."]
    return "\n".join(lines) + "\n"


def write_report(sweep_dir: Path, out_dir: Path | None = None) -> Path:
    """Write report.md, runs.csv and the plots of the sweep in `sweep_dir` into `out_dir` (default
    `<sweep_dir>/report/`), each file atomically; returns the report's path."""
    sweep_dir = Path(sweep_dir)
    sweep = load_sweep(sweep_dir)
    results = read_results(sweep_dir, sweep)
    check(results, sweep, str(sweep_dir / SWEEP_STATE_FILE))
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
    write_text_atomic(out_dir / "runs.csv", csv_text(results, axes, sweep_dir, list(sweep.get("outcomes") or {})))
    report = out_dir / "report.md"
    write_text_atomic(report, render(sweep, results, names, sweep_dir))
    return report


JUDGED = ("## Against the baseline", "## LR groups against", "## Stability:")


def verdicts(report: str) -> str:
    """The report's judged sections (the question's comparisons and each stability outcome), as `--report` prints
    them on the console."""
    sections = report.split("\n## ")
    picked = ["## " + s.strip() for s in sections[1:] if ("## " + s).startswith(JUDGED)]
    return "\n\n".join(picked) + "\n" if picked else ""
