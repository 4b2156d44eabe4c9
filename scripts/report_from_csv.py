#!/usr/bin/env python
"""A sweep report's tables from runs.csv files alone: the runs of one or more sweeps (their `report/runs.csv`),
judged by a spec's judging fields — for a sweep whose run directories are gone, or the runs of two sweeps of the
same model joined into one grid (the QK-norm example's 5 learning rates and the 2 added below them).

    python scripts/report_from_csv.py SPEC.yaml RUNS.csv [RUNS.csv ...] [--out report.md]

The spec gives the metric's name, mode, baseline, margins, question and outcomes, and the axes (its grid and zip,
which must cover every row's cell). Everything but the curves is rebuilt (training/sweep/report.py `csv_results`,
then the report's own `tables`): the per-cell values, the question's comparisons, the LR groups and the stability
outcomes (the LR reach; spikes and the peak logit where runs.csv has them).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.sweep.report import csv_results  # noqa: E402
from training.sweep.spec import load_spec  # noqa: E402
from training.sweep.state import judging  # noqa: E402
from training.sweep.tables import tables  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path)
    ap.add_argument("runs", type=Path, nargs="+", help="runs.csv files (a report's)")
    ap.add_argument("--out", type=Path, help="write the tables here (default: print them)")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    results = [r for path in args.runs for r in csv_results(path.read_text(), spec.axes)]
    cells = {name for name, _ in spec.cells()}
    stray = sorted({r.cell for r in results} - cells)
    if stray:
        sys.exit(f"report_from_csv: cells {stray[:3]} of the runs.csv files are not cells of {args.spec}")
    sweep = {**judging(spec), "axes": spec.axes, "baseline_from": "spec"}
    text = "\n".join([f"# `{spec.name}` from {', '.join(map(str, args.runs))}", "", *tables(sweep, results)]) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
