#!/usr/bin/env python
"""The study's scorecard of record: the exploratory run's verdicts (judged again from its CSVs) beside the
confirmatory runs' (fresh seeds) and the horizon check's (twice the steps, same seeds).

    python scripts/study_scorecard.py docs/study --confirm DIR [DIR ...] --horizon DIR [DIR ...] \\
        [--data data_cache/study-v2048] --out docs/study/scorecard.md

The confirmatory and horizon directories are `normlab study --seed_start 1000 --primaries_only [--horizon 2]`
outputs (their results.json). `--data` is the study's prepared corpus, whose unigram entropy places the plateau
for the exploratory runs (runs.csv does not record it); without it no exploratory run reads as on the plateau.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.errors import UserError  # noqa: E402
from training.study.confirmation import write_scorecard  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exploratory", type=Path, help="the committed study directory (report.md and the two CSVs)")
    ap.add_argument("--confirm", type=Path, nargs="+", required=True, help="confirmatory run directories")
    ap.add_argument("--horizon", type=Path, nargs="*", default=[], help="horizon-check run directories")
    ap.add_argument("--data", type=Path, default=None, help="the study's prepared corpus (for the plateau)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        entropy = math.inf
        if args.data is not None:
            from data.entropy import unigram_entropy

            entropy = unigram_entropy([(args.data, 1.0)])
        write_scorecard(args.out, args.exploratory, args.confirm, args.horizon, entropy)
    except UserError as e:
        print(f"study_scorecard: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
