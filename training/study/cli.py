"""The `normlab study` command: parse the options, run the grid of the selected claims, judge, plot, report."""
from __future__ import annotations

import argparse
import logging
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from data.prepare import ensure_default_corpus
from training.errors import UserError
from training.study.claims import CLAIMS, Claim, select
from training.study.grid import SCALES
from training.study.judge import Context, judge
from training.study.plots import plot
from training.study.report import write_report, write_results
from training.study.runner import load_data, main_process_measurements, plan, roles_of, run_jobs

log = logging.getLogger(__name__)


def parse_claims(text: str | None) -> list[int] | None:
    """`--claims 1,5` → [1, 5]; None → all."""
    if text is None:
        return None
    valid = [c.number for c in CLAIMS]
    try:
        numbers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if not numbers or any(n not in valid for n in numbers):
        raise UserError(f"--claims={text!r} must be a comma-separated list of claim numbers from {valid}, "
                        "e.g. --claims 1,5")
    return numbers


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_study(output: Path, quick: bool = False, claims: list[int] | None = None, jobs: int = 1,
              data_dir: Path | None = None) -> list[tuple[Claim, str]]:
    """Run the selected claims' grid and write report.md, results.json and the plots into `output`."""
    if jobs < 1:
        raise UserError(f"--jobs={jobs} must be at least 1 (the number of worker processes)")
    scale = SCALES["quick" if quick else "default"]
    selected = select(claims)
    data_dir = data_dir or Path("data_cache") / f"study-v{scale.vocab_size}"
    output.mkdir(parents=True, exist_ok=True)
    load_before, start = _load(), time.perf_counter()
    ensure_default_corpus(data_dir, vocab_size=scale.vocab_size)
    data = load_data(data_dir, scale)
    scale = replace(scale, vocab_size=data.vocab_size)
    todo = plan(selected, scale)
    log.info("study: %d jobs for claims %s on %d process(es)", len(todo), [c.number for c in selected], jobs)
    results = run_jobs(todo, data_dir, scale, jobs)
    extra = main_process_measurements(selected, scale, data)
    # Every measurement, before any judging: the report can be rebuilt from it (torch.load) without rerunning.
    torch.save({"scale": scale, "results": results, "extra": extra}, output / "measurements.pt")
    judged = []
    for claim, roles in zip(selected, roles_of(selected, scale).values(), strict=True):
        ctx = Context(scale, roles, results, extra)
        verdict, outcomes = judge(claim, ctx)
        judged.append((claim, verdict, outcomes, ctx, plot(claim.number, ctx, output)))
    header = {"command": "normlab study" + (" --quick" if quick else "")
              + (f" --claims {','.join(map(str, claims))}" if claims else "") + f" --jobs {jobs}",
              "jobs": len(todo), "minutes": (time.perf_counter() - start) / 60, "vocab_size": data.vocab_size,
              "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {jobs} worker process(es)",
              "load_before": load_before, "load_after": _load()}
    write_report(output, scale, judged, header)
    write_results(output, judged, results, header)
    return [(c, v) for c, v, *_ in judged]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny grid (a smoke test, under a minute on 2 cores)")
    ap.add_argument("--claims", default=None, help="comma-separated claim numbers to run, e.g. 1,5 (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for independent runs (default 1)")
    ap.add_argument("--output", type=Path, default=None, help="report directory (default: runs/study[-quick])")
    ap.add_argument("--data", type=Path, default=None, help="prepared default-corpus directory to use or create")
    args = ap.parse_args(argv)
    claims = parse_claims(args.claims)
    output = args.output or Path("runs") / ("study-quick" if args.quick else "study")
    print(f"normlab study: writing {output}/report.md", flush=True)
    verdicts = run_study(output, quick=args.quick, claims=claims, jobs=args.jobs, data_dir=args.data)
    for claim, verdict in verdicts:
        print(f"{verdict:<12} {claim.number}. {claim.title}")
    print(f"report: {output / 'report.md'}")
    return 0
