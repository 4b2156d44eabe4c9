"""The study's statistics and verdicts on synthetic numbers (no training): intervals against scipy, and each
of PASS, FAIL and INCONCLUSIVE for every kind of test, then for whole claims through `judge`."""
import math
import statistics

import pytest
import scipy.stats as scipy_stats

from training.stats import FAIL, INCONCLUSIVE, PASS, combine, difference, estimate, slope, verdict
from training.study import claims as claims_module
from training.study.grid import SCALES, AtInit, Train, shallow
from training.study.judge import Context, judge


def test_estimate_and_welch_interval_match_scipy():
    a, b = [5.1, 5.3, 4.9, 5.2], [4.6, 4.9, 4.7]
    e = estimate(a)
    lo, hi = scipy_stats.t.interval(0.95, len(a) - 1, loc=statistics.fmean(a), scale=scipy_stats.sem(a))
    assert (e.mean, e.sd, e.lo, e.hi) == pytest.approx((statistics.fmean(a), statistics.stdev(a), lo, hi), rel=1e-9)
    d = difference(a, b)
    ci = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert d.mean == pytest.approx(statistics.fmean(a) - statistics.fmean(b))
    assert (d.lo, d.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)


@pytest.mark.parametrize("kind, samples, threshold, expected", [
    ("greater", [1.0, 1.1, 0.9], 0.0, PASS),
    ("greater", [-1.0, -1.1, -0.9], 0.0, FAIL),
    ("greater", [1.0, -1.0, 0.5], 0.0, INCONCLUSIVE),  # the interval contains 0: the effect is within its noise
    ("less", [0.5, 0.6, 0.55], 1.0, PASS),
    ("less", [1.5, 1.6, 1.55], 1.0, FAIL),
    ("less", [0.5, 1.5, 1.0], 1.0, INCONCLUSIVE),
    ("equivalent", [0.01, -0.02, 0.0], 0.1, PASS),
    ("equivalent", [0.3, 0.35, 0.32], 0.1, FAIL),
    ("equivalent", [0.05, 0.15, 0.1], 0.1, INCONCLUSIVE),  # straddles the margin
    ("equivalent", [0.0, 0.2, -0.2], 0.1, INCONCLUSIVE),  # centred, but too noisy to show equivalence
])
def test_verdicts_on_synthetic_samples(kind, samples, threshold, expected):
    assert verdict(estimate(samples), kind, threshold) == expected


def test_exact_and_infinite_and_combined():
    assert verdict(estimate([2738.69]), "exact", 2738.7, 0.05) == PASS
    assert verdict(estimate([2700.0]), "exact", 2738.7, 0.05) == FAIL
    diverged = difference([math.inf, 6.0, 6.1], [5.0, 5.1, 5.0])  # a diverged post-norm seed: worse, not NaN
    assert verdict(diverged, "greater") == PASS
    assert verdict(difference([math.inf] * 2, [math.inf] * 2), "greater") == INCONCLUSIVE
    assert combine([PASS, PASS]) == PASS and combine([PASS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, FAIL, PASS]) == FAIL
    assert slope([1, 2, 3], [2, 4, 6]) == pytest.approx(2.0)


# ---- whole claims on synthetic runs --------------------------------------------------------------------------
SCALE = SCALES["quick"]


def _run(loss: float, probes: dict | None = None, steps: int = 10) -> dict:
    return {"losses": [7.0] + [loss] * (steps - 1), "diverged_at": None, "probes": {steps: probes or {}}}


def _ctx(claim: claims_module.Claim, per_role: dict[str, list[dict]]) -> Context:
    roles = claim.setup(SCALE)
    results = {roles[r]: runs for r, runs in per_role.items()}
    return Context(SCALE, roles, results)


@pytest.mark.parametrize("with_final, without_final, expected", [
    ([4.0, 4.05, 3.98], [4.5, 4.6, 4.55], PASS),  # clearly worse without the final norm
    ([4.5, 4.6, 4.55], [4.0, 4.05, 3.98], FAIL),  # clearly better without it
    ([4.0, 4.3, 4.1], [4.1, 4.0, 4.3], INCONCLUSIVE),  # the gap is inside the seed noise
])
def test_claim_12_verdict(with_final, without_final, expected):
    claim = claims_module.BY_NUMBER[12]
    ctx = _ctx(claim, {"final": [_run(x) for x in with_final], "no-final": [_run(x) for x in without_final]})
    verdict_, outcomes = judge(claim, ctx)
    assert verdict_ == expected
    assert outcomes[0].diff.mean == pytest.approx(statistics.fmean(without_final) - statistics.fmean(with_final),
                                                  rel=1e-6)


def _profile(rms: list[float], L: int) -> dict:
    """At-init probes of an L-layer model whose stream has RMS rms[l] after l blocks (rms[0] = embedding)."""
    p = {f"resid/rms/L{l}": rms[l] for l in range(L)}
    p["resid/final_in"] = rms[L]
    return p


@pytest.mark.parametrize("growth, expected", [(0.3, PASS), (-0.3, FAIL), (0.0, INCONCLUSIVE)])
def test_claim_1_growth_slope_verdict(growth, expected):
    """Streams RMS ∝ l^growth (with seed noise): the log-log slope is `growth`, judged against 0."""
    claim = claims_module.BY_NUMBER[1]
    L = SCALE.deep
    noise = [(0.02, -0.01, 0.0, 0.01, 0.0), (-0.02, 0.01, 0.02, 0.0, -0.01), (0.0, 0.02, -0.02, 0.01, 0.0)]
    runs = [{"probes": _profile([0.02] + [l ** growth * math.exp(n[l % 5] * (1 + 5 * (growth == 0)))
                                          for l in range(1, L + 1)], L)} for n in noise]
    trained = [{**_run(4.0, _profile([0.02] + [l ** growth for l in range(1, L + 1)], L),
                       claim.setup(SCALE)["trained-normal"].steps)} for _ in noise]
    ctx = _ctx(claim, {"init-normal": runs, "trained-normal": trained})
    _, outcomes = judge(claim, ctx)
    assert outcomes[0].verdict == expected
    assert outcomes[0].a.mean == pytest.approx(growth, abs=0.05)


def test_setups_use_the_required_seeds_and_share_runs():
    from training.study.runner import plan

    scale = SCALES["default"]
    jobs = plan(claims_module.CLAIMS, scale)
    assert len(jobs) == len(set(jobs))
    seeds: dict = {}
    for spec, seed in jobs:
        seeds.setdefault(spec, set()).add(seed)
    for spec, s in seeds.items():
        assert len(s) >= (10 if isinstance(spec, AtInit) else 3), spec
    # claims 7 and 8 read the same runs: one job per (spec, seed), not one per claim
    rms = Train(shallow(scale, bias=True), scale.lr, scale.steps)
    assert sum(spec == rms for spec, _ in jobs) == scale.seeds
    assert max(spec.arch.layers for spec in seeds) >= 24
