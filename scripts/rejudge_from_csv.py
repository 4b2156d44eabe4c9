"""Judge a finished study's primaries again, with the committed claims and rules, from its CSVs alone.

    python scripts/rejudge_from_csv.py docs/study [--extra runs/study-22 ...] [--output FILE]

`normlab study --rejudge` rebuilds a whole report from the run's `measurements.pt`; this script is for a run
whose `measurements.pt` is not at hand but whose `measurements.csv` (every test's per-seed values) and
`runs.csv` (every trained run's held-out loss, loss at initialization and outcome) are. Each primary of the
current claims is measured, where possible, with the study's own code (`training.study.judge`):

- statistics of held-out losses over runs (final loss, LR sensitivity, best LR cross-fitted, loss gaps,
  divergence counts) are computed again from runs.csv;
- other statistics (probes, timings) reuse measurements.csv's per-seed values, when the test's statistic and
  roles are unchanged;
- a primary that needs a run the study did not make is listed as awaiting the next run.
- the plateau rule reads the outcome runs.csv records for each run ('plateau'), so AT PLATEAU is kept.

It prints a Markdown table: per claim, the committed report's verdict (read from `report.md`) beside the
verdict under the current rules, the estimate and the p-values (t-test and sign-flip, within the claim's own
family) and the Benjamini–Hochberg q across the claims judged here.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from training.study.claims import CLAIMS, MECHANISM, PRIMARY, SECONDARY, Claim, Test
from training.study.confirmation import csv_outcome, judged_primaries, measurements, runs_results
from training.study.judge import Outcome, bh_scorecard, combine, judge_tests, mark_plateau


def old_verdicts(report: Path) -> dict[str, str]:
    """Per test id, the verdict the committed report gave."""
    # a claim section's row; the flags sat inside the bold in v3 (**PASS †**), after it now (**PASS** † ‡)
    row = r"^\| (\w+): .*? \| \w[\w ]* \| [^|]* \| \*\*(\w[\w ]*?)(?: †)?\*\*(?: [†‡])* \|"
    return dict(re.findall(row, report.read_text(), flags=re.M))


def rejudge(study: Path, extra: list[Path]) -> list[str]:
    runs, csv_values = runs_results(study / "runs.csv"), measurements(study / "measurements.csv")
    for more in extra:  # later runs of some claims: their per-seed values, and their trained runs, win
        csv_values |= measurements(more / "measurements.csv")
        runs |= runs_results(more / "runs.csv") if (more / "runs.csv").is_file() else {}
    old = old_verdicts(study / "report.md")
    rows, judged, others = [], [], []
    for claim in CLAIMS:
        ctx, outs = judged_primaries(claim, runs, csv_values)
        judged += [o for o in outs if o is not None and o.judgement is not None]
        rows.append((claim, ctx, outs))
        for test in (t for t in claim.tests if t.tier in (SECONDARY, MECHANISM) and t.id in old):
            o = csv_outcome(test, ctx, csv_values)
            if o is not None:
                judge_tests([o])
                mark_plateau(ctx, [o])
            if o is None or o.verdict != old[test.id]:
                others.append((test, o, old[test.id]))
    bh_scorecard(judged)
    for _, ctx, outs in rows:  # after the q-values, as in the study's own judging
        mark_plateau(ctx, [o for o in outs if o is not None])
    lines = ["| claim | committed report | primary now | estimate [95% CI] | p: t / sign-flip | verdict now | "
             "q (BH), verdict at FDR 5% |", "|---|---|---|---|---|---|---|"]
    for claim, _, outs in rows:
        lines += _rows(claim, outs, old)
    lines += ["", "Secondary tests and mechanism checks whose verdict changed (or not judged from the CSVs):",
              "", "| test | committed | now | estimate [95% CI] |", "|---|---|---|---|"]
    for test, o, was in others:
        now = "— (not in the CSVs)" if o is None else o.verdict + (" ‡" if o.disagree else "")
        e = None if o is None else o.shown
        ci = f"{e.mean:.3g} [{e.lo:.3g}, {e.hi:.3g}]" if e is not None and math.isfinite(e.mean) else "—"
        lines.append(f"| {test.id} | {was} | {now} | {ci} |")
    return lines


def _rows(claim: Claim, outs: list[Outcome | None], old: dict[str, str]) -> list[str]:
    shown = [t for t in claim.primaries if t.id in old] or [t for t in _v3_primary(claim) if t.id in old]
    was = f"{shown[0].id} {old[shown[0].id]}" if shown else "—"
    verdicts = [o.verdict for o in outs if o is not None]
    now = "awaits the next run" if len(verdicts) < len(outs) else combine(verdicts)
    lines = []
    for i, (test, o) in enumerate(zip(claim.primaries, outs, strict=True)):
        head = (f"{claim.number} | {was}", f"**{now}**") if i == 0 else (" | ", "")
        if o is None:
            lines.append(f"| {head[0]} | {test.id} | — | — | awaits the next run | — |")
            continue
        key = "difference" if test.kind != "equivalent" else "equivalence"
        e = o.shown
        ci = f"{e.mean:.3g} [{e.lo:.3g}, {e.hi:.3g}]" if math.isfinite(e.mean) else "— (one arm never finite)"
        if o.bootstrap is not None:
            ci += f"; bootstrap, best LR chosen per resample: [{o.bootstrap[0]:.3g}, {o.bootstrap[1]:.3g}]"
        flag = " ‡" if o.disagree else ""
        lines.append(f"| {head[0]} | {test.id} | {ci} | {o.p[key]:.2g} / {o.p[key + '_perm']:.2g} | "
                     f"{o.verdict}{flag} (claim: {head[1] or 'above'}) | {o.q[key]:.2g}, {o.verdict_bh} |")
    return lines


def _v3_primary(claim: Claim) -> list[Test]:
    """The committed report's primary: the claim's first test in v3 (a primary then, perhaps secondary now)."""
    return [t for t in claim.tests if t.tier == PRIMARY or t.id.endswith("a")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", type=Path, help="a study's output directory with report.md and the two CSVs")
    ap.add_argument("--extra", type=Path, nargs="*", default=[],
                    help="output directories of later `normlab study --claims ...` runs whose values complete it")
    ap.add_argument("--output", type=Path, default=None, help="write the table there instead of printing it")
    args = ap.parse_args()
    text = "\n".join(rejudge(args.study, args.extra)) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
