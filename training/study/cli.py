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

from data.atomic import atomic_write
from data.prepare import ensure_default_corpus
from training.errors import UserError
from training.study.claims import CLAIMS, Claim, select
from training.study.grid import SCALES, Arch, AtInit, Scale, Train
from training.study.judge import judge_all
from training.study.measure import UNIGRAM_ENTROPY
from training.study.plots import plot
from training.study.provenance import provenance
from training.study.report import write_csvs, write_report, write_results
from training.study.runner import claim_jobs, data_entropy, load_data, main_process_measurements, roles_of, run_jobs
from training.study.statistics import Context

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
              data_dir: Path | None = None, seeds: int | None = None, seed_start: int = 0, horizon: int = 1,
              primaries_only: bool = False) -> list[tuple[Claim, str]]:
    """Run the selected claims' grid and write report.md, results.json, the CSVs and the plots into `output`.
    `seed_start` moves the seeds (a confirmatory run on seeds no test was specified on), `horizon` makes every
    trained run that many times longer, `primaries_only` runs and judges only the primaries."""
    if jobs < 1:
        raise UserError(f"--jobs={jobs} must be at least 1 (the number of worker processes)")
    if seeds is not None and seeds < 2:
        raise UserError(f"--seeds={seeds} must be at least 2 (a paired interval needs two seeds)")
    if seed_start < 0 or horizon < 1:
        raise UserError(f"--seed_start={seed_start} must be ≥ 0 and --horizon={horizon} ≥ 1 (a whole factor of the "
                        "steps)")
    print(f"normlab study: writing {output}/report.md", flush=True)
    scale = SCALES["quick" if quick else "default"]
    if seeds is not None:
        scale = replace(scale, seeds=seeds, init_seeds=max(seeds, scale.init_seeds))
    scale = replace(scale.longer(horizon), seed_start=seed_start)
    selected = select(claims, primaries_only)
    data_dir = data_dir or Path("data_cache") / f"study-v{scale.vocab_size}"
    output.mkdir(parents=True, exist_ok=True)
    load_before, start = _load(), time.perf_counter()
    prov = provenance(scale)  # the code and claims as the run starts
    ensure_default_corpus(data_dir, vocab_size=scale.vocab_size)
    data = load_data(data_dir, scale)
    scale = replace(scale, vocab_size=data.vocab_size)
    todo = claim_jobs(selected, scale)
    log.info("study: %d jobs for claims %s on %d process(es)", len(todo), [c.number for c in selected], jobs)
    results = run_jobs(todo, data_dir, scale, jobs)
    extra = main_process_measurements(selected, scale, data)
    header = {"command": "normlab study" + (" --quick" if quick else "")
              + (f" --claims {','.join(map(str, claims))}" if claims else "")
              + (f" --seeds {seeds}" if seeds is not None else "")
              + (f" --seed_start {seed_start}" if seed_start else "") + (f" --horizon {horizon}" if horizon > 1 else "")
              + (" --primaries_only" if primaries_only else "") + f" --jobs {jobs}",
              "seed_start": seed_start, "horizon": horizon, "primaries_only": primaries_only,
              "jobs": len(todo), "minutes": (time.perf_counter() - start) / 60, "vocab_size": data.vocab_size,
              "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {jobs} worker process(es)",
              "load_before": load_before, "load_after": _load(), "claims": [c.number for c in selected],
              **prov}
    # Every measurement, before any judging: `--rejudge` rebuilds the report from it without rerunning.
    save_measurements(output / MEASUREMENTS, {"scale": scale, "results": results, "extra": extra, "header": header})
    return write_all(output, scale, selected, results, extra, header)


MEASUREMENTS = "measurements.pt"
_SAFE = [Scale, Train, AtInit, Arch]


def save_measurements(path: Path, doc: dict) -> None:
    with atomic_write(path, "wb") as f:
        torch.save(doc, f)


def load_measurements(path: Path) -> dict:
    """A study's saved measurements, read without running code (weights-only unpickling that admits only the
    study's own frozen dataclasses besides plain containers and numbers)."""
    if not path.is_file():
        raise UserError(f"--rejudge: {path} does not exist; give the directory of a finished `normlab study` run")
    try:
        with torch.serialization.safe_globals(_SAFE):
            doc = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        raise UserError(f"--rejudge: {path} is not a study's measurements file ({type(e).__name__}); rerun the "
                        "study to write it") from None
    if not isinstance(doc, dict) or not {"scale", "results", "extra", "header"} <= set(doc):
        raise UserError(f"--rejudge: {path} lacks the scale/results/extra/header a study writes; rerun the study")
    return doc


def _record_entropy(doc: dict, data_dir: Path | None) -> None:
    """Measurements written before the plateau rule carry no unigram entropy: count it from the study's data
    (the same prepared corpus, `--data` or the default directory) and give it to every trained run."""
    if UNIGRAM_ENTROPY in doc["extra"]:
        return
    data_dir = data_dir or Path("data_cache") / f"study-v{doc['scale'].vocab_size}"
    if not data_dir.is_dir():
        raise UserError(f"--rejudge: these measurements do not record the unigram entropy of their training data "
                        f"and {data_dir} does not exist: give the study's data with --data DIR")
    entropy = data_entropy(load_data(data_dir, doc["scale"]))
    doc["extra"][UNIGRAM_ENTROPY] = entropy
    for spec, runs in doc["results"].items():
        if isinstance(spec, Train):
            for r in runs:
                r[UNIGRAM_ENTROPY] = entropy


def rejudge(output: Path, data_dir: Path | None = None) -> list[tuple[Claim, str]]:
    """Judge a finished run's measurements again with the committed claims and rewrite its report."""
    doc = load_measurements(output / MEASUREMENTS)
    print(f"normlab study: writing {output}/report.md", flush=True)
    header = doc["header"]
    _record_entropy(doc, data_dir)
    return write_all(output, doc["scale"], select(header["claims"], header.get("primaries_only", False)),
                     doc["results"], doc["extra"], header)


def write_all(output: Path, scale, selected: tuple[Claim, ...], results: dict, extra: dict,
              header: dict) -> list[tuple[Claim, str]]:
    contexts = [Context(scale, roles, results, extra) for roles in roles_of(selected, scale).values()]
    judged = [(claim, verdict, outcomes, ctx, None if claim.primaries_only else plot(claim.number, ctx, output))
              for claim, ctx, (verdict, outcomes) in zip(selected, contexts, judge_all(selected, contexts),
                                                         strict=True)]
    write_report(output, scale, judged, header)
    write_results(output, judged, results, header)
    write_csvs(output, judged, results, header)
    return [(c, v) for c, v, *_ in judged]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny grid (a smoke test, under a minute on 2 cores)")
    ap.add_argument("--claims", default=None, help="comma-separated claim numbers to run, e.g. 1,5 (default: all)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes for independent runs, one thread each (default: one per core)")
    ap.add_argument("--output", type=Path, default=None, help="report directory (default: runs/study[-quick])")
    ap.add_argument("--data", type=Path, default=None, help="prepared default-corpus directory to use or create")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per trained configuration (default 6; --quick 2); at-init measurements take at "
                    "least as many")
    ap.add_argument("--seed_start", type=int, default=0,
                    help="first seed (default 0); a confirmatory run takes seeds no test was specified on, e.g. 1000")
    ap.add_argument("--horizon", type=int, default=1,
                    help="train every run this many times longer (the horizon check; default 1)")
    ap.add_argument("--primaries_only", action="store_true",
                    help="run and judge only the claims' primary tests (no plots, no readings)")
    ap.add_argument("--rejudge", action="store_true",
                    help="judge the measurements saved in the output directory again and rewrite its report "
                    "(no training)")
    args = ap.parse_args(argv)
    claims = parse_claims(args.claims)
    output = args.output or Path("runs") / ("study-quick" if args.quick else "study")
    if args.rejudge:
        verdicts = rejudge(output, args.data)
    else:
        verdicts = run_study(output, quick=args.quick, claims=claims, jobs=args.jobs, data_dir=args.data,
                             seeds=args.seeds, seed_start=args.seed_start, horizon=args.horizon,
                             primaries_only=args.primaries_only)
    for claim, verdict in verdicts:
        print(f"{verdict:<12} {claim.number}. {claim.title}")
    print(f"report: {output / 'report.md'}")
    return 0
