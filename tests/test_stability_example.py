"""The committed stability example (docs/sweeps/stability/: no control vs QK-clip over learning rates) recomputed
from its runs.csv with numpy and scipy alone — not with normlab's statistics — and compared with its report.md:
each judged outcome's paired difference, interval, p-values and verdict (the final loss and the peak max logit at
the judged LR, the spike counts), and each arm's LR reach with its jackknife interval and exact swap test."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from tests.test_example_ablation import check_reach, interval, lr_curves, numbers, sign_flip_p, table_row

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "sweeps" / "stability"
ALPHA = 0.05


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load((EXAMPLE / "spec.yaml").read_text())


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    with open(EXAMPLE / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def report() -> str:
    return (EXAMPLE / "report.md").read_text()


def per_seed(rows: list[dict[str, str]], cell: str, column: str) -> dict[int, float]:
    return {int(r["seed"]): float(r[column]) for r in rows if r["cell"] == cell}


def arm(row: dict[str, str]) -> str:
    return f"qk_clip={row['optim.qk_clip'] or 'null'}"


def test_the_example_is_complete_and_judges_what_its_spec_fixed(spec, rows):
    cells = len(spec["grid"]["optim.lr"]) * len(spec["zip"]["optim.qk_clip"])
    assert len(rows) == cells * len(spec["seeds"]) and all(r["status"] == "finished" for r in rows)
    assert set(spec["outcomes"]) == {"max_logit_peak", "spikes", "lr_reach"} and len(spec["compare"]) == 1
    assert all(r["spikes"] != "" and r["max_logit_peak"] != "" for r in rows)


@pytest.mark.parametrize("section, column, margin_key", [
    ("Against the baseline", "final", None), ("Stability: peak max attention logit", "max_logit_peak",
                                              "max_logit_peak"), ("Stability: loss spikes", "spikes", "spikes")])
def test_each_judged_outcome_is_recomputed(spec, rows, report, section, column, margin_key):
    base, cell = spec["baseline"], spec["compare"][0]
    mine, theirs = per_seed(rows, cell, column), per_seed(rows, base, column)
    d = [mine[s] - theirs[s] for s in sorted(mine)]
    margin = spec["margin"] if margin_key is None else spec["outcomes"][margin_key]["margin"]
    cells = table_row(report, section, cell, " of ")  # the comparison's row, not the cell's own
    assert cells[1] == f"{len(d)} of {len(d)}"
    if column == "spikes" and not any(mine.values()) and not any(theirs.values()):
        assert cells[-1] == "— (no spikes in either arm)"  # 0 against 0: nothing to test, no verdict
        return
    p_flip = sign_flip_p(d)
    if column == "spikes":  # a count: the exact test alone, never a t-test
        assert numbers(cells[4])[:2] == pytest.approx([p_flip, p_flip], rel=1e-6)
        lo = hi = math.nan
        verdict = ("BETTER" if sum(d) < 0 else "WORSE") if p_flip < ALPHA else "INCONCLUSIVE"
    else:
        mean, lo, hi = interval(d)
        p_t = stats.ttest_1samp(d, 0.0).pvalue
        assert numbers(cells[2]) == pytest.approx([mean], abs=1.5e-4, rel=1e-4)
        assert numbers(cells[3]) == pytest.approx([lo, hi], abs=1.5e-4, rel=1e-4)
        assert numbers(cells[4])[:2] == pytest.approx([p_t, p_flip], rel=6e-3, abs=1e-12)
        verdict = ("EQUIVALENT" if -margin < lo and hi < margin else
                   ("BETTER" if mean < 0 else "WORSE") if p_t < ALPHA else "INCONCLUSIVE")
    shown = cells[-1].replace("*", "")
    assert shown.split()[0] == verdict, (section, shown, verdict, d, lo, hi)


def test_each_arms_lr_reach_and_their_difference_are_recomputed(spec, rows, report):
    rule = spec["outcomes"]["lr_reach"]
    lrs, grids = lr_curves(rows, arm)
    assert lrs == spec["grid"]["optim.lr"]
    for g in grids.values():
        assert 0 < int(np.argmin(g.mean(axis=1))) < len(lrs) - 1  # every arm's best LR inside the grid
    check_reach(report, lrs, grids, "qk_clip=null", rule["delta"], rule["margin"])
