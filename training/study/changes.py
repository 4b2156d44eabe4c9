"""changes.md generated from two study runs' outputs: per claim, the old and the new run's verdict, and per
primary test its verdict, estimate, interval and the p and q of the null that decided it — every number read
from the runs' measurements.csv (the verdict columns `report.write_csvs` writes) and every claim verdict from
their report.md, so no number in changes.md is copied by hand. Prose lives in a separate notes file that the
generator includes verbatim under its own heading."""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

from data.atomic import write_text_atomic
from training.errors import UserError
from training.study.report import VERDICT_COLUMNS

_CLAIM_HEADING = re.compile(r"^## (\d+)\. .* — \*\*(\w+)\*\*$", flags=re.M)


@dataclass
class Run:
    """One run's claim verdicts (report.md) and its primaries' verdict columns (measurements.csv)."""

    claims: dict[int, str]
    primaries: dict[str, dict[str, str]]  # test id → its row's columns, in the CSV's order of tests
    provenance: str


def read_run(directory: Path) -> Run:
    """A run's verdicts and numbers; a missing file or a CSV written before the verdict columns is a UserError."""
    report, values = directory / "report.md", directory / "measurements.csv"
    for path in (report, values):
        if not path.is_file():
            raise UserError(f"{path} does not exist: give the output directory of a finished `normlab study` run")
    with values.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in (*VERDICT_COLUMNS, "claim", "test", "tier") if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{values} lacks the columns {', '.join(missing)} (written before they existed): run "
                            f"`normlab study --rejudge --output {directory}` to rewrite it")
        rows = list(reader)
    primaries = {}
    for row in rows:
        if row["tier"] == "primary":
            primaries.setdefault(row["test"], row)
    first = rows[0] if rows else {}
    prov = f"commit {first.get('commit', 'unknown')}, claims sha256 {first.get('claims_sha256', 'unknown')}"
    return Run({int(n): v for n, v in _CLAIM_HEADING.findall(report.read_text())}, primaries, prov)


def _num(text: str) -> str:
    return "—" if not text else f"{float(text):.3g}"


def describe(row: dict[str, str] | None) -> str:
    """One primary's cell: verdict, estimate [CI], the deciding null's p and q — as the CSV holds them."""
    if row is None:
        return "— (not in this run)"
    ci = "" if not row["ci_lo"] or math.isnan(float(row["ci_lo"])) else \
        f" [{_num(row['ci_lo'])}, {_num(row['ci_hi'])}]"
    decided = f"; p {_num(row['p'])}, q {_num(row['q'])} ({row['null']})" if row["null"] else ""
    return f"{row['verdict']}: {_num(row['estimate'])}{ci}{decided}"


def changes_lines(old: Run, new: Run, old_name: str, new_name: str, notes: str = "") -> list[str]:
    """The Markdown of changes.md."""
    lines = ["# Changes between two study runs", "",
             f"Generated from `{old_name}` ({old.provenance}) and `{new_name}` ({new.provenance}): every "
             "verdict and number below is read from their report.md and measurements.csv. Per primary: verdict, "
             "estimate [95% CI]; p and q of the null that decided the verdict.", "",
             "| claim | old verdict | new verdict | primary | old | new |", "|---|---|---|---|---|---|"]
    tests = list(dict.fromkeys([*old.primaries, *new.primaries]))
    for n in sorted(set(old.claims) | set(new.claims)):
        ids = [t for t in tests if (old.primaries.get(t) or new.primaries.get(t))["claim"] == str(n)]
        changed = " (changed)" if old.claims.get(n) != new.claims.get(n) else ""
        for i, t in enumerate(ids or [""]):
            head = f"{n} | {old.claims.get(n, '—')} | {new.claims.get(n, '—')}{changed}" if i == 0 else " | | "
            lines.append(f"| {head} | {t or '—'} | {describe(old.primaries.get(t))} | "
                         f"{describe(new.primaries.get(t))} |")
    if notes.strip():
        lines += ["", "## Notes", "", notes.strip()]
    return lines


def write_changes(old_dir: Path, new_dir: Path, out: Path, notes: Path | None = None) -> None:
    """Read both runs and write `out` atomically; `notes`, if given, is a Markdown file included verbatim."""
    if notes is not None and not notes.is_file():
        raise UserError(f"--notes {notes} does not exist: give a Markdown file of prose, or leave --notes out")
    text = notes.read_text() if notes is not None else ""
    lines = changes_lines(read_run(old_dir), read_run(new_dir), str(old_dir), str(new_dir), text)
    write_text_atomic(out, "\n".join(lines) + "\n")
