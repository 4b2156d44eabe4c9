"""The committed study (docs/study/) checked against its own CSVs: every per-seed value behind a primary t-test
is recomputed with scipy and must give the p the summary prints, and the whole scorecard judged again from the
CSVs alone (scripts/rejudge_from_csv.py, which never reads measurements.pt) must give every claim the verdict its
report.md gives — so the report, its CSVs and the committed claims and rules cannot drift apart."""
from __future__ import annotations

import csv
import importlib.util
import math
import re
from pathlib import Path

import pytest
from scipy import stats

from training.study.claims import CLAIMS

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "docs" / "study"


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def summary() -> dict[str, dict[str, str]]:
    """The report's summary table, one entry per primary test id."""
    text = STUDY.joinpath("report.md").read_text()
    table = text.split("## Summary", 1)[1].split("## Setup", 1)[0]
    rows = [_cells(line) for line in table.splitlines() if line.startswith("| ")][1:]
    header = ["claim", "evidence", "test", "specified", "margin", "verdict", "effect", "p", "q", "power", "mde"]
    if rows and len(rows[0]) == len(header) - 1:  # a report written before the "specified" column
        header.remove("specified")
    return {r[2].split(":", 1)[0]: dict(zip(header, r, strict=True)) for r in rows}


def claim_verdicts() -> dict[int, str]:
    return {int(n): v for n, v in re.findall(r"^## (\d+)\. .* — \*\*([\w ]+)\*\*$", STUDY.joinpath("report.md")
                                                                                .read_text(), flags=re.M)}


def per_seed() -> dict[str, list[tuple[float, float | None]]]:
    out: dict[str, list[tuple[float, float | None]]] = {}
    with open(STUDY / "measurements.csv", newline="") as f:
        for row in csv.DictReader(f):
            b = float(row["value_b"]) if row["value_b"] else None
            out.setdefault(row["test"], []).append((float(row["value_a"]), b))
    return out


def test_every_claim_has_a_verdict_and_one_primary_row_or_more():
    verdicts, rows = claim_verdicts(), summary()
    assert sorted(verdicts) == list(range(1, 23))
    assert {int(re.match(r"\d+", t).group()) for t in rows} == set(verdicts)


def test_the_printed_t_test_p_values_are_scipys():
    """For each primary of a plain kind (an effect > 0, < 0 or ≠ 0 against its threshold, every seed finite) the
    two-sided one-sample t-test of the per-seed differences, minus the threshold, is the p the summary prints."""
    kinds = {t.id: t for c in CLAIMS for t in c.tests}  # the committed run's primaries, some secondary now
    values, checked = per_seed(), 0
    for test, row in summary().items():
        if kinds[test].kind not in ("greater", "less", "nonzero"):
            continue  # an equivalence (TOST) or exact-value test
        diffs = [a - (b if b is not None else 0.0) for a, b in values[test]]
        if not all(math.isfinite(d) for d in diffs) or "(equivalence)" in row["p"]:
            continue  # a diverged arm (the signed-rank sign-flip test decides), or an EQUIVALENT verdict (TOST)
        p_printed = float(row["p"].split("/")[0])
        p = stats.ttest_1samp([d - kinds[test].threshold for d in diffs], 0.0).pvalue
        assert f"{p:.2g}" == f"{p_printed:.2g}", (test, p, p_printed)
        checked += 1
    assert checked >= 15


# Claims whose verdict the current rules change from the committed run's (until the study is run again): the
# verdict judged again from the CSVs, and why. Empty while the committed run is judged with the current rules.
CHANGED_BY_RULES: dict[int, tuple[str, str]] = {}


def test_the_scorecard_judged_again_from_the_csvs_gives_the_reports_verdicts():
    spec = importlib.util.spec_from_file_location("rejudge_from_csv", REPO / "scripts" / "rejudge_from_csv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = module.rejudge(STUDY, [])
    again = {int(n): v for n, v in re.findall(r"^\| (\d+) \|.*?\(claim: \*\*([\w ]+)\*\*\)", "\n".join(lines),
                                                 flags=re.M)}
    committed = claim_verdicts()
    for n, (now, _why) in CHANGED_BY_RULES.items():
        assert committed[n] != now, f"claim {n}: the committed report already says {now}; drop it from the list"
    expected = committed | {n: now for n, (now, _) in CHANGED_BY_RULES.items()}
    assert again == expected
    changed = lines[lines.index("| test | committed | now | estimate [95% CI] |") + 2:]
    assert changed == [], "secondary verdicts the CSVs do not reproduce"


@pytest.mark.parametrize("test", ["2g", "4f", "16f", "22e"])
def test_the_primaries_the_v3_run_lacked_are_measured(test):
    assert len(per_seed()[test]) >= 6
