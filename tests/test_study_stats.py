"""The study's statistics and verdicts on synthetic numbers (no training): intervals against scipy, each of the
four verdicts for directional and equivalence claims, divergence as an outcome, one multiplicity family per
claim (Holm across its own primaries, Benjamini–Hochberg across claims), and the grid's seeds and sharing."""
import math
import statistics

import pytest
import scipy.stats as scipy_stats

from training.stats import (
    EQUIVALENT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    difference,
    estimate,
    holm,
    judge,
    paired_difference,
    slope,
)
from training.study import claims as claims_module
from training.study.claims import LOSS
from training.study.claims import Test as ClaimTest
from training.study.grid import SCALES, AtInit, Train, shallow
from training.study.judge import decide, judge_all, judge_tests, measure
from training.study.statistics import Context

SCALE = SCALES["quick"]


def test_estimate_and_intervals_match_scipy():
    a, b = [5.1, 5.3, 4.9, 5.2], [4.6, 4.9, 4.7, 4.8]
    e = estimate(a)
    lo, hi = scipy_stats.t.interval(0.95, len(a) - 1, loc=statistics.fmean(a), scale=scipy_stats.sem(a))
    assert (e.mean, e.sd, e.lo, e.hi) == pytest.approx((statistics.fmean(a), statistics.stdev(a), lo, hi), rel=1e-9)
    w = difference(a, b)
    ci = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (w.lo, w.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)
    p = paired_difference(a, b)
    rel = scipy_stats.ttest_rel(a, b)
    assert (p.lo, p.hi) == pytest.approx(tuple(rel.confidence_interval(0.95)), rel=1e-9)
    assert p.p_value() == pytest.approx(rel.pvalue, rel=1e-9)
    assert slope([1, 2, 3], [2, 4, 6]) == pytest.approx(2.0)


def _t(kind="greater", margin=LOSS, threshold=0.0):
    return ClaimTest("x", "x", "final_loss", "a", "b", kind=kind, margin=margin, threshold=threshold)


def _decide(kind: str, diffs: list[float], discordant=(0, 0), margin=LOSS) -> str:
    j = judge(estimate(diffs), margin, "lower", discordant=discordant, equivalence_claim=kind == "equivalent")
    return decide(_t(kind, margin), j.verdict)


@pytest.mark.parametrize("kind, diffs, expected", [
    ("greater", [0.30, 0.32, 0.28, 0.31], PASS),  # clearly > 0 and not inside ±0.05
    ("greater", [-0.30, -0.32, -0.28, -0.31], FAIL),
    ("greater", [0.001, -0.002, 0.0015, 0.0], EQUIVALENT),  # a precise null: inside ±0.05
    ("greater", [0.3, -0.4, 0.5, -0.2], INCONCLUSIVE),  # the interval is wider than the margin and holds 0
    ("less", [-0.30, -0.32, -0.28, -0.31], PASS),
    ("nonzero", [-0.30, -0.32, -0.28, -0.31], PASS),  # either sign
    ("nonzero", [0.001, -0.002, 0.0015, 0.0], EQUIVALENT),
    ("nonzero", [0.3, -0.4, 0.5, -0.2], INCONCLUSIVE),
    ("equivalent", [0.001, -0.002, 0.0015, 0.0], PASS),
    ("equivalent", [0.30, 0.32, 0.28, 0.31], FAIL),  # shown to exceed the margin
    ("equivalent", [0.06, 0.04, 0.05, 0.055], INCONCLUSIVE),  # a real difference, but not shown beyond ±0.05
])
def test_four_way_verdicts(kind, diffs, expected):
    assert _decide(kind, diffs) == expected


def test_divergence_is_an_outcome():
    # six seeds diverged in arm a only (two ties): the signed-rank p is 2/64 < 0.05, and "a is worse" is what a
    # "greater" claim says
    assert _decide("greater", [0.0, 0.0], discordant=(6, 0)) == PASS
    assert _decide("less", [0.0, 0.0], discordant=(6, 0)) == FAIL
    assert _decide("greater", [0.3, 0.31, 0.29], discordant=(2, 0)) == INCONCLUSIVE  # 5 of 5: p = 2/32
    assert _decide("greater", [0.3, 0.31, 0.29, 0.33], discordant=(2, 0)) == PASS  # 6 of 6 one way: p = 2/64
    assert _decide("equivalent", [0.0, 0.0], discordant=(0, 6)) == FAIL


def _run(loss: float, steps: int = 10, diverged: bool = False, probes: dict | None = None) -> dict:
    return {"losses": [7.0] + [loss] * (steps - 1), "diverged_at": 3 if diverged else None,
            "val_loss": math.inf if diverged else loss, "probes": {steps: probes or {}},
            "unigram_entropy": 6.3}  # the study corpus's plateau: these runs end well below it


def _ctx(claim: claims_module.Claim, per_role: dict[str, list[dict]]) -> Context:
    roles = claim.setup(SCALE)
    return Context(SCALE, roles, {roles[r]: runs for r, runs in per_role.items()})


def test_paired_difference_counts_diverged_seeds_apart():
    """Claim 12's primary with one seed diverged in 'deep-no-final' only: the difference runs over the seeds
    where both trained, the diverged one is counted, and the Welch interval is kept beside the paired one."""
    claim = claims_module.BY_NUMBER[12]
    without = [_run(4.5), _run(4.7), _run(0, diverged=True), _run(4.6)]
    with_ = [_run(4.0), _run(4.3), _run(4.1), _run(4.05)]
    o = measure(_ctx(claim, {"deep-no-final": without, "deep-final": with_}), claim.primary)
    assert o.discordant == (1, 0)
    ref = scipy_stats.ttest_rel([4.5, 4.7, 4.6], [4.0, 4.3, 4.05])
    assert (o.diff.lo, o.diff.hi) == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-9)
    judge_tests([o])  # 4 of 4 seeds one way (the diverged one ranks worst): p = 2/16, not shown
    assert o.welch is not None and o.p["difference"] == pytest.approx(2 / 16) and o.verdict == INCONCLUSIVE


def _ctx12_7():
    c12, c7 = claims_module.BY_NUMBER[12], claims_module.BY_NUMBER[7]
    ctx12 = _ctx(c12, {"deep-no-final": [_run(x) for x in (4.10, 4.07, 4.16, 4.05)],
                       "deep-final": [_run(x) for x in (4.0, 4.03, 4.01, 4.0)],
                       "no-final": [_run(4.0)] * 4, "final": [_run(4.0)] * 4})
    ctx7 = _ctx(c7, {"rmsnorm": [_run(x) for x in (4.0, 4.1, 4.05, 4.2)],
                     "layernorm": [_run(x) for x in (4.3, 4.05, 4.0, 4.1)]}
                | {f"{n}-w{i}": [_run(4.0)] * 4 for n in ("rmsnorm", "layernorm") for i in (1, 2)})
    return c12, c7, ctx12, ctx7


def test_a_claims_verdict_does_not_depend_on_which_other_claims_ran():
    """Claim 12's primary passes alone (p < 0.05); judged with claim 7 (a pooled Holm would double its p) it
    keeps the same verdict and p-values: each claim is its own family. Across claims, the Benjamini–Hochberg
    q-values are scipy's over the primaries' p-values."""
    c12, c7, ctx12, ctx7 = _ctx12_7()
    ((alone, outs_alone),) = judge_all([c12], [ctx12])
    (together, outs12), (_, outs7) = judge_all([c12, c7], [ctx12, ctx7])
    assert alone == together == PASS
    assert outs_alone[0].p_adjusted == outs12[0].p_adjusted == outs12[0].p
    ps = [outs12[0].p["difference"], outs7[0].p["difference"]]
    assert [outs12[0].q["difference"], outs7[0].q["difference"]] == pytest.approx(
        list(scipy_stats.false_discovery_control(ps)))


def test_holm_runs_across_a_claims_own_primaries():
    """Claim 13 has two primaries (the sign of the slope and its size): their p-values are Holm-adjusted together,
    and the claim passes only when both do."""
    claim = claims_module.BY_NUMBER[13]
    assert [t.id for t in claim.primaries] == ["13a", "13b"]
    roles = claim.setup(SCALE)
    depths = {r: ctx_depth for r, ctx_depth in ((r, roles[r].arch.layers) for r in roles if r.split("@")[0]
                                                in ("pre", "post"))}
    # pre-LN's last-layer gradient ∝ L^-0.5 per seed (with a little noise), post-LN flat
    noise = [0.01, -0.02, 0.015, 0.0]
    results = {roles[r]: [{"w2_grad": [1.0, depths[r] ** (-0.5 + e) if r.startswith("pre") else 1.0 + e]}
                          for e in noise] for r in depths}
    ctx = Context(SCALE, roles, results)
    ((verdict, outs),) = judge_all([claim], [ctx])
    by_id = {o.test.id: o for o in outs}
    for key in ("difference", "equivalence"):
        raw = [by_id[t].p[key] for t in ("13a", "13b")]
        assert [by_id[t].p_adjusted[key] for t in ("13a", "13b")] == pytest.approx(holm(raw))
    assert by_id["13a"].verdict == PASS and by_id["13b"].verdict == PASS and verdict == PASS


def test_lr_sensitivity_and_best_lr_per_seed():
    """Claim 6's LR sensitivity per seed, by hand: mean over the LRs of min(loss, loss at init) minus the best,
    a diverged run counting as the loss at init (7.0)."""
    claim = claims_module.BY_NUMBER[6]
    roles = claim.setup(SCALE)
    n_lr = len(SCALE.lrs)
    none = {f"none@{i}": [_run(4.0 + i), _run(4.2 + i)] for i in range(n_lr)}
    none[f"none@{n_lr - 1}"] = [_run(0, diverged=True), _run(4.5)]
    head = {f"head@{i}": [_run(4.0), _run(4.1)] for i in range(n_lr)}
    full = {f"full@{i}": [_run(4.0), _run(4.1)] for i in range(n_lr)}
    ctx = Context(SCALE, roles, {roles[r]: v for r, v in (none | head | full).items()})
    o = measure(ctx, claim.primary)
    seed0 = [4.0 + i for i in range(n_lr - 1)] + [7.0]
    seed1 = [4.2 + i for i in range(n_lr - 1)] + [4.5]
    by_hand = [statistics.fmean(s) - min(s) for s in (seed0, seed1)]
    assert o.samples_a == pytest.approx(by_hand) and o.samples_b == pytest.approx([0.0, 0.0])


def test_setups_use_the_required_seeds_and_share_runs():
    from training.study.runner import claim_jobs as plan

    scale = SCALES["default"]
    jobs = plan(claims_module.CLAIMS, scale)
    assert len(jobs) == len(set(jobs))
    seeds: dict = {}
    for spec, seed in jobs:
        seeds.setdefault(spec, set()).add(seed)
    for spec, s in seeds.items():
        assert len(s) >= (5 if isinstance(spec, AtInit) else 6), spec
    # claims 7 and 8 read the same runs: one job per (spec, seed), not one per claim
    rms = Train(shallow(scale, bias=True), scale.lr, scale.steps, scale.warmup)
    assert sum(spec == rms for spec, _ in jobs) == scale.seeds
    assert max(spec.arch.layers for spec in seeds) >= 48
    assert any(isinstance(s, Train) and s.steps >= 1000 and s.ablate for s in seeds)
    assert all(c.primaries and c.limits for c in claims_module.CLAIMS)
