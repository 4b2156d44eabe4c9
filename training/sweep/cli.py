"""`normlab sweep SPEC.yaml`: train every cell × seed of a spec (training/sweep/spec.py) as ordinary fit runs.

    normlab sweep SPEC.yaml                    train what is not finished, locally (--max_parallel N at once)
    normlab sweep SPEC.yaml --executor slurm   submit it as one Slurm job array (--wait to follow it)
    normlab sweep SPEC.yaml --dry_run          list every run and its exact fit command; the time they would take
    normlab sweep SPEC.yaml --status           each run's state, step, time and metric; the ETA
    normlab sweep SPEC.yaml --report           the statistics report (training/sweep/report.py); prints its verdicts
    normlab sweep SPEC.yaml --plan --pilot DIR the seeds the spec's question needs, from a pilot's spread
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from training.errors import UserError
from training.run.layout import SWEEP_STATE_FILE
from training.sweep.executors import EXECUTORS
from training.sweep.runner import dry_run, status_table
from training.sweep.spec import load_spec

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normlab sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, exit_on_error=False)
    p.add_argument("spec", help="the sweep spec (YAML)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry_run", action="store_true", help="list the runs and their fit commands; start nothing")
    what.add_argument("--status", action="store_true",
                      help="show each run's state, step, time and metric, and the sweep's ETA")
    what.add_argument("--report", action="store_true",
                      help="write the statistics report of the sweep and print its verdict tables")
    what.add_argument("--plan", action="store_true",
                      help="before the runs: power, MDE and the seeds the spec's question needs (from a pilot)")
    p.add_argument("--executor", choices=tuple(EXECUTORS), default="local",
                   help="local (default): subprocesses on this machine; slurm: one job array "
                        "(training/sweep/executors.py)")
    p.add_argument("--max_parallel", type=int, default=1,
                   help="local: runs at once, each on its own share of the CPUs/GPUs (default 1); "
                        "slurm: the array's concurrency limit (default: the spec's slurm.max_parallel)")
    p.add_argument("--wait", action="store_true", help="slurm: wait until the array has ended, then show --status")
    p.add_argument("--out", type=Path, default=None, help="--report: the report directory (default: the sweep's)")
    p.add_argument("--pilot", type=Path, default=None,
                   help="--plan: a pilot sweep's directory with the same cells (default: this spec's)")
    p.add_argument("--sd", type=float, default=None,
                   help="--plan: the standard deviation of the per-seed differences, instead of a pilot's")
    return p


def write_report(sweep_dir: Path, out: Path | None) -> int:
    """`--report`: the report of the sweep in `sweep_dir`, once its runs are checked to have trained one config
    per cell."""
    if not (sweep_dir / SWEEP_STATE_FILE).is_file():
        raise UserError(f"'{sweep_dir}' has no {SWEEP_STATE_FILE}: run the sweep first (normlab sweep SPEC.yaml)")
    from training.sweep import report
    from training.sweep.results import check_one_config_per_cell

    check_one_config_per_cell(sweep_dir, report.load_sweep(sweep_dir)["runs"])
    path = report.write_report(sweep_dir, out)
    sys.stdout.write(report.verdicts(path.read_text()) + f"\nreport: {path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except argparse.ArgumentError as err:
        raise UserError(str(err)) from err
    if args.max_parallel < 1:  # (before anything is written into the sweep directory)
        raise UserError(f"--max_parallel {args.max_parallel} must be >= 1")
    spec = load_spec(args.spec)
    unknown = sorted(set(spec.executor) - set(EXECUTORS))
    if unknown:
        raise UserError(f"sweep spec '{spec.path}': executor key {unknown[0]!r} is not an executor; choose from "
                        f"{', '.join(EXECUTORS)}")
    runs = spec.runs()
    if args.dry_run:
        sys.stdout.write(dry_run(spec, runs, args.max_parallel, args.executor))
        return 0
    if args.status:
        sys.stdout.write(status_table(spec, runs))
        return 0
    if args.report:
        return write_report(spec.sweep_dir, args.out)
    if args.plan:
        from training.sweep.power import seeds_needed_table

        sys.stdout.write(seeds_needed_table(spec, args.pilot, args.sd))
        return 0
    return EXECUTORS[args.executor].launch(spec, runs, args.max_parallel, args.wait)
