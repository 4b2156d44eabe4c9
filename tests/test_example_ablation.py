"""The committed example ablation (docs/sweeps/example/: QK-norm x learning rate) recomputed from its runs.csv
with numpy and scipy alone — not with normlab's statistics — and compared with what its report.md and README.md
say: every LR sensitivity, the paired difference, its interval, both p-values, the power and the verdict."""
from __future__ import annotations

import csv
import itertools
import math
import re
import statistics
from collections.abc import Callable
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


def reach(lrs: list[float], curve: list[float], delta: float) -> float:
    """The width in log10 LR of the range around the curve's minimum where it stays within delta of it, each end
    interpolated linearly in log10 LR (a range that runs to the grid's end stops there)."""
    x, best = np.log10(lrs), int(np.argmin(curve))
    level, ends = curve[best] + delta, []
    for step in (1, -1):
        i = best
        while 0 <= i + step < len(x) and curve[i + step] <= level:
            i += step
        j = i + step
        if not 0 <= j < len(x):
            ends.append(x[i])
        else:
            ends.append(x[i] + (level - curve[i]) / (curve[j] - curve[i]) * (x[j] - x[i]))
    return float(ends[0] - ends[1])


def lr_curves(rows: list[dict[str, str]], group: Callable[[dict[str, str]], str]
              ) -> tuple[list[float], dict[str, np.ndarray]]:
    """The LRs ascending and, per group, the [LR][seed] final val/loss, a diverged run counted as its seed's loss
    at initialization (the median over the group's runs at that seed) and a final above it capped there."""
    lrs = sorted({float(r["optim.lr"]) for r in rows})
    seeds = sorted({int(r["seed"]) for r in rows})
    out = {}
    for name in sorted({group(r) for r in rows}):
        grid = np.full((len(lrs), len(seeds)), np.nan)
        for j, seed in enumerate(seeds):
            at = [r for r in rows if group(r) == name and int(r["seed"]) == seed]
            cap = statistics.median(float(r["initial_loss"]) for r in at)
            for r in at:
                final = float(r["final"]) if r["final"] not in ("", "nan") else math.inf
                value = cap if r["outcome"] == "diverged" or not math.isfinite(final) else min(final, cap)
                grid[lrs.index(float(r["optim.lr"])), j] = value
        assert not np.isnan(grid).any(), name  # every LR at every seed
        out[name] = grid
    return lrs, out


def reach_difference(lrs: list[float], a: np.ndarray, b: np.ndarray, delta: float) -> dict[str, float]:
    """Reach of a's seed-mean curve minus b's, its jackknife interval and t-test over seeds (each seed left out of
    both arms), and the exact swap test (the arms' runs exchanged at every subset of seeds)."""
    n = a.shape[1]

    def diff(x: np.ndarray, y: np.ndarray) -> float:
        return reach(lrs, list(x.mean(axis=1)), delta) - reach(lrs, list(y.mean(axis=1)), delta)

    d = diff(a, b)
    loo = np.array([diff(np.delete(a, s, 1), np.delete(b, s, 1)) for s in range(n)])
    se = math.sqrt((n - 1) / n * float(np.sum((loo - loo.mean()) ** 2)))
    half = stats.t.ppf(1 - ALPHA / 2, n - 1) * se
    swapped = [abs(diff(np.where(s, b, a), np.where(s, a, b)))
               for s in map(np.array, itertools.product((False, True), repeat=n))]
    return {"d": d, "lo": d - half, "hi": d + half, "p_t": 2 * stats.t.sf(abs(d) / se, n - 1),
            "p_swap": float(np.mean(np.array(swapped) >= abs(d) - 1e-9))}


def reach_rows(report: str, group: str) -> list[list[str]]:
    """The LR reach section's rows of `group`: its own reach, then (if compared) its difference."""
    body = report.split("## Stability: LR reach", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("|")]
    return [r for r in rows if r[0] == group]


def check_reach(report: str, lrs: list[float], grids: dict[str, np.ndarray], base: str, delta: float,
                margin: float) -> None:
    """Each group's reach and each other group's difference from `base` against the report's LR reach section."""
    for name, g in grids.items():
        w = reach(lrs, list(g.mean(axis=1)), delta)
        assert numbers(reach_rows(report, name)[0][2].replace("≥", "")) == pytest.approx([w], abs=6e-4), name
    for name in (n for n in grids if n != base):
        r = reach_difference(lrs, grids[name], grids[base], delta)
        cells = reach_rows(report, name)[1]
        assert numbers(cells[2].split("(")[0]) == pytest.approx([r["d"]], abs=6e-4)
        assert numbers(cells[3]) == pytest.approx([r["lo"], r["hi"]], abs=6e-4)
        assert numbers(cells[5])[:2] == pytest.approx([r["p_t"], r["p_swap"]], rel=6e-3, abs=1e-9)
        verdict = ("EQUIVALENT" if -margin < r["lo"] and r["hi"] < margin else
                   ("BETTER" if r["d"] > 0 else "WORSE") if r["p_t"] < ALPHA else "INCONCLUSIVE")  # wider: better
        assert cells[-1].replace("*", "").split()[0] == verdict, (name, cells[-1], r)


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


def test_the_extended_grid_brackets_both_best_lrs_and_its_lr_reach_is_recomputed():
    """LR 1e-3 (runs_low.csv) added below the grid: both groups' best LR is now inside it, and
    report_extended.md's LR reach of each group and their difference are recomputed."""
    ext = yaml.safe_load((EXAMPLE / "spec_extended.yaml").read_text())
    with open(EXAMPLE / "runs_low.csv", newline="") as f:
        low = list(csv.DictReader(f))
    assert len(low) == 2 * len(ext["seeds"]) and all(r["status"] == "finished" for r in low)
    lrs, grids = lr_curves(runs() + low, group_of)
    assert lrs == ext["zip"]["optim.lr"]
    for g in grids.values():
        assert 0 < int(np.argmin(g.mean(axis=1))) < len(lrs) - 1  # bracketed
    rule = ext["outcomes"]["lr_reach"]
    check_reach((EXAMPLE / "report_extended.md").read_text(), lrs, grids, "qk_norm=head", rule["delta"],
                rule["margin"])
