"""`normlab sweep SPEC.yaml`: train every cell × seed of a spec (training/sweep/spec.py) as ordinary fit runs.

    normlab sweep SPEC.yaml                    train what is not finished, locally (--max_parallel N at once)
    normlab sweep SPEC.yaml --executor slurm   submit it as one Slurm job array (--wait to follow it)
    normlab sweep SPEC.yaml --dry_run          list every run and its exact fit command
    normlab sweep SPEC.yaml --status           each run's state, step, time and metric; the ETA
    normlab sweep SPEC.yaml --report           the statistics report (training/sweep/report.py)
    normlab sweep SPEC.yaml --plan --pilot DIR the seeds the spec's question needs, from a pilot's spread
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from training.errors import UserError
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
    what.add_argument("--report", action="store_true", help="write the statistics report of the sweep")
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


def report(sweep_dir: Path, out: Path | None) -> int:
    try:
        module = importlib.import_module("training.sweep.report")
    except ModuleNotFoundError as err:
        if err.name != "training.sweep.report":
            raise
        raise UserError("the sweep report is not available in this version of normlab "
                        "(training/sweep/report.py is missing)") from err
    if not (sweep_dir / "sweep.json").is_file():
        raise UserError(f"'{sweep_dir}' has no sweep.json: run the sweep first (normlab sweep SPEC.yaml)")
    from training.sweep.results import check_one_config_per_cell

    check_one_config_per_cell(sweep_dir, module.load_sweep(sweep_dir)["runs"])
    path = module.write_report(sweep_dir, out)
    sys.stdout.write(f"report: {path}\n")
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
        sys.stdout.write(dry_run(spec, runs))
        return 0
    if args.status:
        sys.stdout.write(status_table(spec, runs))
        return 0
    if args.report:
        return report(spec.sweep_dir, args.out)
    if args.plan:
        from training.sweep.plan import plan

        sys.stdout.write(plan(spec, args.pilot, args.sd))
        return 0
    return EXECUTORS[args.executor].launch(spec, runs, args.max_parallel, args.wait)
