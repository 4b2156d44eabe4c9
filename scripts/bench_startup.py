#!/usr/bin/env python
"""Start-up of `normlab fit`: how long a user waits for help, for a refused start, and for a first trained step —
each against the floor every PyTorch program pays (`python -c "import torch"`), measured in the same run.

Each command runs `--repeats` times as a fresh process (the file cache warm: one untimed run of each first); the
median wall time is printed with its ratio to the torch import:

    import torch                       the floor
    import the fit path                training.lightning_cli (Lightning, DeepSpeed's hooks, the model)
    normlab fit --help                 LightningCLI's parser, every field
    normlab fit -c list.yaml           a -c file that is no YAML mapping, refused before Lightning is imported
    normlab fit --model.placement x    a bad value refused in one line (it needs the parser: after the imports)
    normlab fit, 1 step                the default job's model and data for one optimizer step, then its save

The default corpus is prepared (data_cache/default) by the untimed run if it is missing. Runs go to a temporary
directory. Machine load moves every number; compare the ratios, and name the machine with the figures.

    python scripts/bench_startup.py                 # 3 repeats
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], repeats: int, expect_ok: bool = True) -> float:
    """Median wall seconds of `cmd` over `repeats` fresh processes (after one untimed run); a `{i}` in an
    argument becomes the run's index (a fresh run directory each time)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        proc = subprocess.run([a.replace("{i}", str(i)) for a in cmd], cwd=REPO, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if (proc.returncode == 0) != expect_ok:
            sys.exit(f"bench_startup: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        if i:
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    py, normlab = sys.executable, [sys.executable, "-m", "training.cli"]
    with tempfile.TemporaryDirectory() as runs:
        bad = str(Path(runs) / "list.yaml")
        Path(bad).write_text("- lr: 0.1\n")
        one_step = [*normlab, "fit", "--runs_dir", runs, "--trainer.max_steps", "1", "--name", "startup-{i}"]
        cases = {
            "import torch": ([py, "-c", "import torch"], True),
            "import the fit path": ([py, "-c", "import training.lightning_cli"], True),
            "normlab fit --help": ([*normlab, "fit", "--help"], True),
            "normlab fit, a bad -c file": ([*normlab, "fit", "-c", bad], False),
            "normlab fit, a bad value": ([*normlab, "fit", "--model.placement", "nowhere"], False),
            "normlab fit, 1 step": (one_step, True),
        }
        results = {name: timed(cmd, args.repeats, ok) for name, (cmd, ok) in cases.items()}
    floor = results["import torch"]
    print(f"{'command':28} {'median s':>9} {'× import torch':>15}   ({os.cpu_count()} CPUs, {args.repeats} repeats)")
    for name, seconds in results.items():
        print(f"{name:28} {seconds:9.2f} {seconds / floor:15.2f}")


if __name__ == "__main__":
    main()
