"""Benchmark ``normlab prepare``: overhead over sentencepiece's raw encoding, and memory at scale.

    python scripts/bench_data.py [--vocab_size 8192] [--repeats 3] [--input FILES...]
    python scripts/bench_data.py --scale 50 200 [--num_proc 1 2]

``--scale MB ...``: builds synthetic-but-realistic JSON-lines corpora of those sizes (paragraphs of the default
corpus, real English, recombined at random into documents of 1-40 paragraphs), trains one tokenizer on the
smallest, then runs ``normlab prepare --tokenizer`` on each size with each ``--num_proc`` as a subprocess and
reports wall time, MB/s and the peak RSS of the whole process tree (prepare and its workers together, sampled
every 0.1 s from /proc) and of the largest single process. Memory that does not grow with the size is the point.

Text: the default corpus (or ``--input`` files, read the same way prepare reads them). A tokenizer is trained
once; then the measurements run ``--repeats`` times, interleaved, and the fastest of each is kept (the
machines are shared):

* raw encode: ``SentencePieceProcessor.encode(documents, num_threads=1)`` on documents already in memory;
* prepare with that tokenizer (``--tokenizer``), ``num_proc`` 1 and 2: the whole pipeline, from hashing and
  checking the input files, through ``datasets`` loading and ``map``, to the token files and ``meta.json``.

Overhead = prepare time at num_proc 1 / raw encode time - 1 (target: ≤ 20%). The tokenizer training time is
printed separately: it is a one-off cost that a given ``--tokenizer`` skips.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402

from data.corpus import TEXT, inspect_files, local_documents, resolve_inputs  # noqa: E402
from data.default_corpus import gather_default_corpus  # noqa: E402
from data.layout import read_meta  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.tokenizer import load_processor  # noqa: E402


def _documents(inputs: list[str], work: Path) -> tuple[list[str], list[str]]:
    """(documents, input paths for prepare): the given files, or the default corpus written as JSON lines."""
    if inputs:
        return [t or "" for t in local_documents(inspect_files(resolve_inputs(inputs)), TEXT, "strict")], inputs
    docs = gather_default_corpus()
    path = work / "default_corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({TEXT: doc}, ensure_ascii=False) + "\n")
    return docs, [str(path)]


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the num_proc workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _seconds(run) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), _cpu()
    run()
    return time.perf_counter() - wall, _cpu() - cpu


def _synthetic_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write ~``megabytes`` of JSON lines made of default-corpus paragraphs; return the text bytes written."""
    paragraphs = [p for doc in gather_default_corpus() for p in doc.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 40)))
            f.write(json.dumps({TEXT: doc}, ensure_ascii=False) + "\n")
            written += len(doc.encode("utf-8"))
    return written


def _tree_rss(pid: int) -> tuple[int, int]:
    """(sum, max) resident set size in bytes over ``pid`` and all its descendants."""
    sizes, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            sizes.append(int(status.split("VmRSS:")[1].split()[0]) * 1024)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
    return sum(sizes), max(sizes, default=0)


def _run_measured(argv: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak tree RSS, peak single-process RSS) of a command."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_sum = peak_max = 0
    while proc.poll() is None:
        total, largest = _tree_rss(proc.pid)
        peak_sum, peak_max = max(peak_sum, total), max(peak_max, largest)
        time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr.read().decode()}")
    return time.perf_counter() - start, peak_sum, peak_max


def scale(sizes: list[float], num_procs: list[int], vocab_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpora = {mb: work / f"corpus_{mb:g}mb.jsonl" for mb in sizes}
        text_mb = {mb: _synthetic_corpus(path, mb) / 1e6 for mb, path in corpora.items()}
        small = min(sizes)
        prepare([str(corpora[small])], output=work / "tok", vocab_size=vocab_size, max_tokens=2_000_000)
        tokenizer = work / "tok" / "tokenizer.model"
        print(f"cpu cores: {os.cpu_count()}; load average before: {os.getloadavg()}; tokenizer: {vocab_size} pieces")
        print(f"{'text MB':>8s}{'num_proc':>9s}{'wall s':>8s}{'MB/s':>7s}{'peak RSS tree MB':>18s}"
              f"{'largest proc MB':>17s}")
        for mb in sizes:
            for n in num_procs:
                out = work / f"out_{mb:g}_{n}"
                wall, rss_sum, rss_max = _run_measured([
                    sys.executable, "-m", "data.prepare", "--input", str(corpora[mb]), "--output", str(out),
                    "--tokenizer", str(tokenizer), "--num_proc", str(n)])
                print(f"{text_mb[mb]:8.1f}{n:9d}{wall:8.1f}{text_mb[mb] / wall:7.2f}{rss_sum / 1e6:18.0f}"
                      f"{rss_max / 1e6:17.0f}", flush=True)
                shutil.rmtree(out)
        print(f"load average after: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", default=[])
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", nargs="+", type=float, metavar="MB", help="measure memory at these corpus sizes")
    parser.add_argument("--num_proc", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    datasets.disable_progress_bars()
    if args.scale:
        scale(args.scale, args.num_proc, args.vocab_size)
        return

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs, inputs = _documents(args.input, work)
        mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6

        train = _seconds(
            lambda: prepare(inputs, output=work / "trained", vocab_size=args.vocab_size, val_fraction=0.01)
        )
        trained = work / "trained"
        tokenizer = trained / "tokenizer.model"
        meta = read_meta(trained)
        tokens = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]

        sp = load_processor(tokenizer)
        raw_tokens = sum(len(ids) for ids in sp.encode(docs, num_threads=1)) + len(docs)  # + one EOS each
        # Interleave the measurements so a burst of load from other processes hits all of them alike.
        jobs = {"raw": lambda: sp.encode(docs, num_threads=1)}
        for num_proc in (1, 2):
            jobs[num_proc] = lambda n=num_proc: prepare(
                inputs, output=work / f"p{n}", tokenizer=tokenizer, val_fraction=0.01, num_proc=n, overwrite=True)
        best = {name: (float("inf"), float("inf")) for name in jobs}
        for _ in range(args.repeats):
            for name, job in jobs.items():
                if name != "raw":
                    shutil.rmtree(work / f"p{name}", ignore_errors=True)  # else prepare finds it up to date
                wall, cpu = _seconds(job)
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))

    print(f"text: {mb:.2f} MB in {len(docs)} documents, {tokens:,} tokens (vocab {args.vocab_size}); "
          f"cpu cores: {os.cpu_count()}; best of {args.repeats}")
    assert raw_tokens == tokens, (raw_tokens, tokens)
    print(f"{'':36s}{'wall s':>8s}{'MB/s':>8s}{'Mtok/s':>8s}{'CPU s':>8s}")
    rows = {"sentencepiece raw encode, 1 thread": best["raw"], "prepare --tokenizer, num_proc 1": best[1],
            "prepare --tokenizer, num_proc 2": best[2], "prepare with tokenizer training": train}
    for name, (wall, cpu) in rows.items():
        print(f"{name:36s}{wall:8.2f}{mb / wall:8.2f}{tokens / wall / 1e6:8.3f}{cpu:8.2f}")
    for what, i in (("wall", 0), ("CPU", 1)):
        print(f"overhead of prepare (num_proc 1) over raw encode, {what} time: "
              f"{100 * (best[1][i] / best['raw'][i] - 1):.1f}% (target <= 20%)")

if __name__ == "__main__":  # datasets' num_proc workers must not re-run the benchmark
    main()
