#!/usr/bin/env python
"""The local sweep runner's own cost: a sweep's wall time against its runs' own time, per run.

For each round: a fresh 4-run sweep (2 cells x 2 seeds of a tiny model, `--max_parallel 1`) timed from the
start of `normlab sweep` to its exit, and the same 4 `fit` commands (from `--dry_run`) run by hand one after
the other, timed the same way. Per run:
- overhead = (sweep wall - sum of the runs' own times as the sweep recorded them: spawn to exit) / runs:
  the runner's start-up, spec and state work, scheduling and polling between runs;
- versus by hand = (sweep wall - the same commands' wall by hand) / runs: that, plus any slowdown of a run
  inside the sweep.
Rounds alternate sweep and by-hand, so a change in the machine's load hits both.

    python scripts/bench_sweep_overhead.py --rounds 2 --steps 8
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from tests.helpers.data import make_tiny_corpus

    work = Path(tempfile.mkdtemp(prefix="sweep-overhead-"))
    make_tiny_corpus(work)
    (work / "tiny.yaml").write_text((REPO / "tests" / "helpers" / "tiny.yaml").read_text())
    normlab = [sys.executable, "-m", "training.cli"]
    rows = []
    for r in range(args.rounds):
        for kind in ("sweep", "by hand"):
            name = f"{kind.replace(' ', '')}{r}"
            spec = work / f"{name}.yaml"
            overrides = {"data.path": "tiny", "trainer.max_steps": args.steps}
            spec.write_text(json.dumps({"name": name, "runs_dir": "runs", "seeds": [0, 1],
                                        "grid": {"model.placement": ["pre", "post"]},
                                        "base": {"config": ["tiny.yaml"], "overrides": overrides}}))
            if kind == "sweep":
                wall = timed([*normlab, "sweep", str(spec), "--max_parallel", "1"], work)
                records = [json.loads(p.read_text()) for p in (work / "runs" / name).glob("*/s*/sweep-run.json")]
                own = sum(rec["ended"] - rec["started"] for rec in records)
                rows.append(("sweep", wall, own, len(records)))
            else:
                listing = subprocess.run([*normlab, "sweep", str(spec), "--dry_run"], cwd=work, check=True,
                                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
                commands = [shlex.split(ln.strip()) for ln in listing.stdout.splitlines() if ln.startswith("  python")]
                walls = [timed([sys.executable, *cmd[1:]], work) for cmd in commands]
                rows.append(("by hand", sum(walls), sum(walls), len(walls)))
    print(f"load average at the end: {os.getloadavg()}")
    for kind, wall, own, n in rows:
        print(f"{kind:8} {n} runs: wall {wall:6.1f} s, runs' own {own:6.1f} s, "
              f"(wall - own)/run {(wall - own) / n:5.2f} s")
    sweeps = [row for row in rows if row[0] == "sweep"]
    hands = [row for row in rows if row[0] == "by hand"]
    per_run = [(s[1] - s[2]) / s[3] for s in sweeps]
    versus = [(s[1] - h[1]) / s[3] for s, h in zip(sweeps, hands, strict=True)]
    for what, values in (("runner overhead per run", per_run), ("sweep vs by hand per run", versus)):
        print(f"{what}: median {statistics.median(values):.2f} s ({', '.join(f'{x:.2f}' for x in values)})")


if __name__ == "__main__":
    main()
