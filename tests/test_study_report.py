"""The study's scorecard, in process on synthetic per-seed values: its provenance (commit, claims hash, seeds),
which tests were specified after their data, the p and q of the null that decided each verdict, raw differences
with the threshold in the margin column, the uninformative marker, the ± check, and changes.md generated from two
runs' CSVs."""
from __future__ import annotations

import csv
import re
import statistics
from dataclasses import replace

import pytest

from training.stats import ALPHA, EQUIVALENT, FAIL, INCONCLUSIVE, PASS
from training.study import claims as claims_module
from training.study.changes import write_changes
from training.study.claims import BY_NUMBER, CLAIMS, PRIMARY, SECONDARY, Claim
from training.study.claims import Test as StudyTest
from training.study.grid import SCALES
from training.study.judge import bh_scorecard, from_samples, judge_tests
from training.study.provenance import claims_sha256, git_commit, provenance
from training.study.report import _warnings, summary_rows, write_csvs, write_report
from training.study.scorecard import mirrored
from training.study.statistics import Context

BASE = [0.0, 0.11, -0.07, 0.04, -0.12, 0.09]  # a fixed spread around zero, mean 0.0083


def _outcome(test: StudyTest, shift: float, scale: float = 1.0, b: bool = True):
    a = [shift + scale * x for x in BASE]
    return from_samples(test, a if not b else [3.0 + x for x in a], [3.0] * len(a) if b else None)


def _judged(claim: Claim, outs: list) -> list:
    judge_tests([o for o in outs if o.test.tier == PRIMARY])
    for o in outs:
        if o.test.tier != PRIMARY:
            judge_tests([o])
    bh_scorecard([o for o in outs if o.test.tier == PRIMARY])
    return [(claim, outs[0].verdict, outs, Context(SCALES["quick"], {}, {}), None)]


def _claim(*tests: StudyTest, number: int = 99) -> Claim:
    return Claim(number, "synthetic", "none", lambda s: {}, tests, limits="synthetic values")


def _rows(judged: list, seeds: range = range(6)) -> dict[str, dict[str, str]]:
    lines = summary_rows(judged, seeds)
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[2].split(":")[0]: dict(zip(names, cells, strict=True))
            for cells in ([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:])}


def test_claims_hash_is_stable_and_sees_every_judging_field():
    same = tuple(replace(c, tests=tuple(replace(t) for t in c.tests)) for c in CLAIMS)
    assert claims_sha256(same) == claims_sha256(CLAIMS) == claims_sha256()
    c = CLAIMS[3]
    for change in ({"margin": 0.07}, {"threshold": 0.01}, {"kind": "less"}, {"params": {"k": 2.0}},
                   {"tier": "mechanism"}, {"stat": "best_lr_loss"}, {"a": "pre-w0@0"}, {"text": "another"}):
        tests = c.tests[:1] + (replace(c.tests[1], **change),) + c.tests[2:]
        changed = CLAIMS[:3] + (replace(c, tests=tests),) + CLAIMS[4:]
        # wording is how a verdict is read, not how it is reached
        assert (claims_sha256(changed) == claims_sha256(CLAIMS)) == ("text" in change), change
    relabelled = CLAIMS[:8] + (replace(CLAIMS[8], evidence="finding", title="another"),) + CLAIMS[9:]
    assert claims_sha256(relabelled) == claims_sha256()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", git_commit())


def test_report_and_csv_record_the_run_and_the_claims_they_were_judged_with(tmp_path, monkeypatch):
    t = StudyTest("99a", "a − b > 0", "final_loss", "x", "y", margin=0.05, tier=PRIMARY)
    judged = _judged(_claim(t), [_outcome(t, 0.3)])
    header = {"command": "normlab study", "jobs": 1, "minutes": 0.1, "machine": "cpu", "load_before": "0",
              "load_after": "0", "vocab_size": 64, **provenance(SCALES["quick"])}
    write_report(tmp_path, SCALES["quick"], judged, header)
    write_csvs(tmp_path, judged, {}, header)
    report = (tmp_path / "report.md").read_text()
    assert f"Code: commit {git_commit()}; claims sha256 {claims_sha256()} " in report
    rows = list(csv.DictReader((tmp_path / "measurements.csv").open()))
    assert {(r["commit"], r["claims_sha256"]) for r in rows} == {(git_commit(), claims_sha256())}
    # judged again under claims with another margin: the report names the new hash and the run's own
    changed = CLAIMS[:1] + (replace(CLAIMS[1], tests=(replace(CLAIMS[1].tests[0], margin=0.2),)
                                    + CLAIMS[1].tests[1:]),) + CLAIMS[2:]
    monkeypatch.setattr(claims_module, "CLAIMS", changed)
    write_report(tmp_path, SCALES["quick"], judged, header)
    again = (tmp_path / "report.md").read_text()
    assert claims_sha256(changed) != header["claims_sha256"]
    assert f"claims sha256 {claims_sha256(changed)} " in again
    assert f"measured under claims sha256 {header['claims_sha256']}" in again


def test_a_test_specified_after_seeds_0_to_5_is_before_on_a_confirmatory_run(tmp_path):
    claim = BY_NUMBER[4]
    f4 = next(t for t in claim.tests if t.id == "4f")
    judged = _judged(claim, [_outcome(f4, 0.3)])
    assert _rows(judged, range(0, 6))["4f"]["specified"] == "after"
    assert _rows(judged, range(1000, 1006))["4f"]["specified"] == "before"
    other = replace(f4, id="4z")
    assert _rows(_judged(claim, [_outcome(other, 0.3)]), range(0, 6))["4z"]["specified"] == "before"
    for first, expected in ((0, "after"), (1000, "before")):
        write_csvs(tmp_path, judged, {}, {"seeds": [first, first + 5]})
        rows = list(csv.DictReader((tmp_path / "measurements.csv").open()))
        assert {r["specified"] for r in rows} == {expected}


def test_evidence_labels():
    assert {n: BY_NUMBER[n].evidence for n in (9, 16, 22)} == {9: "construction", 16: "limit", 22: "construction"}


@pytest.mark.parametrize("kind,shift,scale,expected,null", [
    ("greater", 0.3, 1, PASS, "difference"), ("greater", -0.3, 1, FAIL, "difference"),
    ("greater", 0.0, 1, EQUIVALENT, "equivalence"), ("greater", 0.1, 2, INCONCLUSIVE, "difference"),
    ("equivalent", 0.0, 1, PASS, "equivalence"), ("equivalent", 0.6, 1, FAIL, "difference")])
def test_the_printed_p_and_q_are_those_of_the_null_that_decided(kind, shift, scale, expected, null):
    margin = 0.5 if kind == "equivalent" else 0.2
    t = StudyTest("99a", "synthetic", "final_loss", "x", "y", kind=kind, margin=margin, tier=PRIMARY)
    o = _outcome(t, shift, scale)
    row = _rows(_judged(_claim(t), [o]))["99a"]
    assert o.verdict == expected
    if expected != INCONCLUSIVE:  # the printed null is the one rejected
        assert o.p_adjusted[null] < ALPHA
    assert row["p (t / sign-flip)"] == f"{o.p[null]:.2g} / {o.p[null + '_perm']:.2g} ({null})"
    assert row["q (BH), verdict at FDR 5%"].startswith(f"{o.q[null]:.2g} ({null}), ")


@pytest.mark.parametrize("shift", [0.4, 0.0, 0.06, -0.3])
def test_a_two_role_test_prints_the_raw_difference_with_the_threshold_beside_it(shift):
    t = StudyTest("99a", "a − b > 0.05", "final_loss", "x", "y", threshold=0.05, margin=0.05, tier=PRIMARY)
    o = _outcome(t, shift)
    row = _rows(_judged(_claim(t), [o]))["99a"]
    mean, lo, hi = map(float, re.match(r"(\S+) \[(\S+), (\S+)\]", row["effect [95% CI]"]).groups())
    raw = statistics.fmean(a - b for a, b in zip(o.samples_a, o.samples_b, strict=True))
    assert mean == pytest.approx(raw, abs=5e-3) and o.shown.mean == pytest.approx(raw, rel=1e-12)
    assert f"{mean:.3g}" == f"{shift + statistics.fmean(BASE):.3g}"
    assert "threshold 0.05" in row["margin"]
    assert (not lo <= 0.05 <= hi) == (o.verdict in (PASS, FAIL))


def test_an_underpowered_primary_is_marked_uninformative():
    t = StudyTest("99a", "synthetic", "final_loss", "x", "y", margin=0.05, tier=PRIMARY)
    strong = _outcome(t, 4.0, scale=8.0)  # shown, but with a spread that hides an effect of one margin
    row = _rows(_judged(_claim(t), [strong]))["99a"]
    assert strong.verdict == PASS and strong.power < 0.5
    assert "uninformative; effect size may be exaggerated (type M)" in row["power at the margin"]
    precise = _outcome(t, 0.3, scale=0.3)
    row = _rows(_judged(_claim(t), [precise]))["99a"]
    assert precise.power >= 0.5 and "uninformative" not in row["power at the margin"]


def test_tests_that_are_plus_or_minus_each_other_are_named():
    p1 = StudyTest("99a", "a", "final_loss", "x", "y", margin=0.05, tier=PRIMARY)
    p2 = StudyTest("99b", "b", "final_loss", "x", margin=0.05, tier=PRIMARY)
    s1 = StudyTest("99c", "c", "final_loss", "x", margin=0.05)
    s2 = StudyTest("99d", "d", "final_loss", "x", margin=0.05)
    a = [0.3, 0.1, 0.5, -0.2, 0.4, 0.0]
    outs = [from_samples(p1, [1.0 + x for x in a], [1.0] * 6),
            from_samples(p2, [-x + 0.002 * (-1) ** i for i, x in enumerate(a)], None),  # −(a − b), to 0.002
            from_samples(s1, [-2 * x for x in a], None),  # r = −1 but twice the size: not one measurement
            from_samples(s2, [0.2, -0.1, 0.3, 0.1, -0.4, 0.2], None)]
    assert [(x, y) for x, y, *_ in mirrored(outs)] == [("99a", "99b")]
    outs[1] = from_samples(replace(p2, tier=SECONDARY), outs[1].samples_a, None)
    assert [(x, y) for x, y, *_ in mirrored(outs)] == [("99a", "99b")]
    outs[1] = from_samples(p2, outs[1].samples_a, None)
    warnings = _warnings(_judged(_claim(p1, p2), outs[:2]))
    assert len(warnings) == 2 and "99a and 99b have per-seed values the negative of each other" in warnings[1]


def _run(tmp_path, name: str, verdict: str, est: str, p: str, q: str):
    d = tmp_path / name
    d.mkdir()
    (d / "report.md").write_text(f"# x\n\n## 99. synthetic — **{verdict}**\n")
    cols = ["claim", "test", "tier", "statistic", "role_a", "role_b", "seed", "value_a", "value_b", "verdict",
            "estimate", "ci_lo", "ci_hi", "null", "p", "q", "specified", "commit", "claims_sha256"]
    rows = [["99", "99a", "primary", "final_loss", "x", "y", s, "1.0", "0.5", verdict, est, "0.0812345",
             "0.187654", "difference", p, q, "before", name, "abc"] for s in range(2)]
    with (d / "measurements.csv").open("w", newline="") as f:
        csv.writer(f).writerows([cols, *rows])
    return d


def test_changes_md_holds_exactly_the_csvs_numbers(tmp_path):
    old = _run(tmp_path, "old", "PASS", "0.134217", "0.00123456", "0.0049876")
    new = _run(tmp_path, "new", "INCONCLUSIVE", "0.0412345", "0.21987", "0.4321")
    notes = tmp_path / "notes.md"
    notes.write_text("Prose about why.\n")
    out = tmp_path / "changes.md"
    write_changes(old, new, out, notes)
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 99 |"))
    assert row == ("| 99 | PASS | INCONCLUSIVE (changed) | 99a | PASS: 0.134 [0.0812, 0.188]; p 0.00123, q 0.00499 "
                   "(difference) | INCONCLUSIVE: 0.0412 [0.0812, 0.188]; p 0.22, q 0.432 (difference) |")
    assert text.rstrip().endswith("## Notes\n\nProse about why.")
    assert "commit old" in text and "commit new" in text
    numbers = {f"{float(x):.3g}" for x in re.findall(r"\d+\.\d+", row)}
    csv_numbers = {f"{float(x):.3g}" for x in ("0.134217", "0.00123456", "0.0049876", "0.0412345", "0.21987",
                                               "0.4321", "0.0812345", "0.187654")}
    assert numbers == csv_numbers


def test_changes_from_a_csv_without_the_verdict_columns_is_one_error_line(tmp_path, capsys):
    from scripts.changes_from_csv import main
    d = tmp_path / "old"
    d.mkdir()
    (d / "report.md").write_text("")
    (d / "measurements.csv").write_text("claim,test,tier\n")
    assert main([str(d), str(d), "--out", str(tmp_path / "c.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "measurements.csv lacks the columns verdict" in err[0] and "--rejudge" in err[0]
    assert not (tmp_path / "c.md").exists()
