"""The committed example ablation (docs/sweeps/example/: QK-norm x learning rate) recomputed from its runs.csv
with numpy and scipy alone — not with normlab's statistics — and compared with what its report.md and README.md
say: every LR sensitivity, the paired difference, its interval, both p-values, the power and the verdict."""
from __future__ import annotations

import csv
import itertools
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "sweeps" / "example"
ALPHA = 0.05


def spec() -> dict:
    return yaml.safe_load((EXAMPLE / "spec.yaml").read_text())


def runs() -> list[dict[str, str]]:
    with open(EXAMPLE / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


def group_of(row: dict[str, str]) -> str:
    return f"qk_norm={row['model.qk_norm']}"


def sensitivities() -> dict[str, dict[int, float]]:
    """Per group and seed, Wortsman et al.'s LR sensitivity: the mean over the LR grid of the final val/loss minus
    the best of them, each final capped at the seed's loss at initialization (the median over the group's runs at
    that seed), a diverged run counted as the cap."""
    by: dict[tuple[str, int], list[dict[str, str]]] = {}
    for row in runs():
        by.setdefault((group_of(row), int(row["seed"])), []).append(row)
    out: dict[str, dict[int, float]] = {}
    for (group, seed), rows in by.items():
        assert all(r["initial_step"] == "1" for r in rows)  # the loss at initialization, logged at step 1
        cap = statistics.median(float(r["initial_loss"]) for r in rows)
        finals = []
        for r in rows:
            final = float(r["final"]) if r["final"] not in ("", "nan") else math.inf
            finals.append(cap if r["outcome"] == "diverged" or not math.isfinite(final) else min(final, cap))
        assert len(finals) == len(spec()["zip"]["optim.lr"])  # every LR of the grid, once
        out.setdefault(group, {})[seed] = statistics.fmean(finals) - min(finals)
    return out


def interval(xs: list[float]) -> tuple[float, float, float]:
    n, mean = len(xs), float(np.mean(xs))
    half = stats.t.ppf(1 - ALPHA / 2, n - 1) * np.std(xs, ddof=1) / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_flip_p(d: list[float]) -> float:
    """The exact two-sided sign-flip p by enumerating all 2^n sign patterns."""
    observed = abs(sum(d))
    patterns = itertools.product((1, -1), repeat=len(d))
    sums = [abs(sum(s * x for s, x in zip(signs, d, strict=True))) for signs in patterns]
    return sum(s >= observed - 1e-12 for s in sums) / len(sums)


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]


def table_row(report: str, section: str, first_cell: str, contains: str) -> list[str]:
    body = report.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == first_cell and contains in line:
            return cells
    raise AssertionError(f"no row {first_cell!r} with {contains!r} under '## {section}'")


@pytest.fixture(scope="module")
def report() -> str:
    return (EXAMPLE / "report.md").read_text()


def test_the_example_is_the_qk_norm_lr_ablation_complete():
    s, rows = spec(), runs()
    assert s["question"] == "lr_sensitivity" and s["grid"] == {"model.qk_norm": ["none", "head"]}
    expected = len(s["zip"]["optim.lr"]) * 2 * len(s["seeds"])
    assert len(rows) == expected and all(r["status"] == "finished" for r in rows)
    assert {int(r["seed"]) for r in rows} == set(s["seeds"])


def test_each_groups_lr_sensitivity_is_recomputed(report):
    for group, per_seed in sensitivities().items():
        mean, lo, hi = interval(list(per_seed.values()))
        cells = table_row(report, "Learning rate", group, group)
        got = numbers(cells[4])
        assert got == pytest.approx([mean, lo, hi], abs=1.5e-4), (group, cells[4])


def test_the_verdict_and_its_numbers_are_recomputed(report):
    s = spec()
    base = "qk_norm=" + dict(p.split("=") for p in s["baseline"].split(","))["qk_norm"]
    other = "qk_norm=none" if base == "qk_norm=head" else "qk_norm=head"
    sens = sensitivities()
    seeds = sorted(set(sens[base]) & set(sens[other]))
    d = [sens[other][i] - sens[base][i] for i in seeds]
    mean, lo, hi = interval(d)
    p_t = stats.ttest_1samp(d, 0.0).pvalue
    p_flip = sign_flip_p(d)
    margin = s["margin"]
    if -margin < lo and hi < margin:
        verdict = "EQUIVALENT"
    elif p_t < ALPHA:
        verdict = "WORSE" if mean > 0 else "BETTER"  # a higher sensitivity is worse
    else:
        verdict = "INCONCLUSIVE"
    disagree = verdict in ("WORSE", "BETTER") and p_flip >= ALPHA

    cells = table_row(report, f"LR groups against `{base}`", other, "LR sensitivity")
    assert cells[2] == str(len(seeds))
    assert numbers(cells[3]) == pytest.approx([mean], abs=1.5e-4)
    assert numbers(cells[4]) == pytest.approx([lo, hi], abs=1.5e-4)
    t_and_flip = numbers(cells[6])[:2]  # "p_t / p_flip, Holm ..." (one comparison: Holm changes nothing)
    assert t_and_flip == pytest.approx([p_t, p_flip], rel=6e-3, abs=1e-12)
    # Power at ±margin at α (one comparison), from the noncentral t: the report's planning number.
    n, se = len(d), float(np.std(d, ddof=1)) / math.sqrt(len(d))
    crit = stats.t.ppf(1 - ALPHA / 2, n - 1)
    power = stats.nct.sf(crit, n - 1, margin / se) + stats.nct.cdf(-crit, n - 1, margin / se)
    mde = (crit + stats.t.ppf(0.8, n - 1)) * se  # the smallest difference found 80% of the time
    assert numbers(cells[7]) == pytest.approx([100 * power, mde], rel=1e-2)
    shown = cells[-1].replace("*", "")
    assert shown.split()[0] == verdict and ("‡" in shown) == disagree, (shown, verdict, p_t, p_flip)

    readme = (EXAMPLE / "README.md").read_text()
    assert f"**{verdict}**" in readme and "Wall time" in readme and "Machine" in readme


def test_the_example_is_powered_as_its_readme_says():
    """Sized before the run: the README states the planned power and the seeds; the spec has those seeds."""
    readme = (EXAMPLE / "README.md").read_text()
    assert f"{len(spec()['seeds'])} seeds" in readme and "--plan" in readme
