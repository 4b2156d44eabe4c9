#!/usr/bin/env python
"""changes.md of two study runs, generated from their outputs (`training.study.changes`).

    python scripts/changes_from_csv.py OLD_DIR NEW_DIR --out docs/study/changes.md [--notes notes.md]

OLD_DIR and NEW_DIR are `normlab study` output directories (report.md and measurements.csv); every verdict and
number is read from them. Prose goes in the --notes file, included verbatim under "Notes".
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.errors import UserError, report_user_error  # noqa: E402
from training.study.changes import write_changes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the earlier run's output directory")
    ap.add_argument("new", type=Path, help="the later run's output directory")
    ap.add_argument("--out", type=Path, required=True, help="the changes.md to write")
    ap.add_argument("--notes", type=Path, default=None, help="a Markdown file of prose to include verbatim")
    args = ap.parse_args(argv)
    try:
        write_changes(args.old, args.new, args.out, args.notes)
    except UserError as e:
        return report_user_error("changes_from_csv", e)
    print(f"changes: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
