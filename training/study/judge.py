"""From measured runs to verdicts: `measure` applies one test's statistic (`training.study.statistics`) and
`judge_all` judges every claim.

A test comparing two roles takes the per-seed differences (the arms share each seed's weights and batches: a
paired design); the Welch interval is kept beside it for the report. A trained run that diverged has no
held-out loss: the t-interval is taken over the seeds where both arms trained, and seeds where one arm
diverged and the other did not decide the test through `training.stats.p_values` (diverged = worst).

Multiplicity: a claim is one family — Holm across its own primaries (`judge_all`), so a claim's verdict is the
same whether it runs alone or with the others; across claims the report adds Benjamini–Hochberg q-values.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from training.stats import (
    ALPHA,
    AT_PLATEAU,
    BETTER,
    EQUIVALENT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    WORSE,
    Estimate,
    Judgement,
    benjamini_hochberg,
    best_lr_bootstrap,
    comparison_verdict,
    difference,
    estimate,
    judge_family,
    no_estimate,
)
from training.study.claims import PRIMARY, REPORT, Claim, Test
from training.study.grid import Job, Train
from training.study.measure import outcome
from training.study.statistics import COUNT_STATISTICS, STATISTICS, Context, best_lr_index, capped_grid


@dataclass
class Outcome:
    """One test's result: its per-seed samples, estimates (a; b and the paired difference when the test compares
    two roles, with the Welch interval beside it), its judgement (p-values raw and Holm-adjusted within its
    family, the sign-flip twin, power and MDE at the level used) and the verdict in the claim's words."""

    test: Test
    samples_a: list[float]
    samples_b: list[float] | None
    a: Estimate
    b: Estimate | None = None
    diff: Estimate | None = None
    welch: Estimate | None = None
    discordant: tuple[int, int] = (0, 0)  # seeds that diverged in a only, in b only
    bootstrap: tuple[float, float] | None = None  # best-LR tests: the interval with the LR chosen again per resample
    judgement: Judgement | None = None
    verdict: str = "—"
    verdict_perm: str = "—"  # the same rule on the sign-flip p-values
    q: dict[str, float] = field(default_factory=dict)  # Benjamini–Hochberg across the claims (primaries only)
    verdict_bh: str = "—"

    @property
    def judged(self) -> Estimate:
        """The estimate the verdict reads, shifted by the test's threshold."""
        return self.diff if self.diff is not None else self.a

    @property
    def shown(self) -> Estimate:
        """The estimate a reader compares with the threshold: one role's statistic, or the raw paired difference
        mean(a − b) with its interval (the judged difference moved back by the threshold, so the printed number
        is the measured one and the threshold sits beside it)."""
        if self.b is None:
            return self.a
        e, t = self.judged, self.test.threshold
        if not t:
            return e
        return replace(e, mean=e.mean + t, lo=e.lo + t, hi=e.hi + t, samples=tuple(x + t for x in e.samples))

    @property
    def p(self) -> dict[str, float]:
        return self.judgement.p if self.judgement else {}

    @property
    def p_adjusted(self) -> dict[str, float]:
        return self.judgement.p_adjusted if self.judgement else {}

    @property
    def power(self) -> float:
        return self.judgement.power if self.judgement else math.nan

    @property
    def mde(self) -> float:
        return self.judgement.mde if self.judgement else math.nan

    @property
    def disagree(self) -> bool:
        """The t-test and the sign-flip test give this test different verdicts."""
        return self.verdict_perm not in ("—", self.verdict) and self.judgement is not None and \
            self.judgement.disagree

    def numbers(self) -> str:
        t = self.test
        if self.b is None:
            return f"{t.a}: {self.a}"
        text = f"{t.a}: {self.a}; {t.b}: {self.b}; paired difference {self.shown}"
        if self.welch is not None and math.isfinite(self.welch.mean) and self.welch.df:
            text += f" (Welch: CI [{self.welch.lo:.3g}, {self.welch.hi:.3g}], df {self.welch.df:.1f})"
        if self.bootstrap is not None:  # kept on the judged scale: shown here on the raw difference's
            text += (f"; bootstrap with the best LR chosen again per resample: [{self.bootstrap[0] + t.threshold:.3g}, "
                     f"{self.bootstrap[1] + t.threshold:.3g}]")
        if sum(self.discordant):
            text += f"; diverged in {t.a} only: {self.discordant[0]}, in {t.b} only: {self.discordant[1]}"
        return text


def _samples(ctx: Context, test: Test) -> tuple[list[float], list[float] | None]:
    fn = STATISTICS[test.stat]
    a = fn(ctx, test.a, **test.params)
    return a, (fn(ctx, test.b, **test.params) if test.b is not None else None)


def measure(ctx: Context, test: Test) -> Outcome:
    """A test's samples (its statistic on the context's runs) and estimates (`from_samples`)."""
    a, b = _samples(ctx, test)
    out = from_samples(test, a, b)
    if b is not None and test.stat == "best_lr_loss":
        lo, hi = best_lr_bootstrap(capped_grid(ctx, test.a), capped_grid(ctx, test.b))
        out.bootstrap = lo - test.threshold, hi - test.threshold  # on the scale of the judged difference
    return out


def from_samples(test: Test, a: list[float], b: list[float] | None) -> Outcome:
    """A test's estimates from its per-seed samples. The difference (a − b − threshold, or a − threshold for
    one role) is taken over the seeds where every value is finite; a seed whose difference is ±inf (one arm
    diverged) is counted in `discordant`."""
    out = Outcome(test, a, b, estimate(a) if a else no_estimate())
    if b is None:
        diffs = [x - test.threshold for x in a]
    else:
        out.b = estimate(b)
        diffs = [x - y - test.threshold if math.isfinite(x) or math.isfinite(y) else math.nan
                 for x, y in zip(a, b, strict=True)]
        both = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
        out.welch = difference([x for x, _ in both], [y for _, y in both]) if len(both) > 1 else None
    finite = [d for d in diffs if math.isfinite(d)]
    out.discordant = (sum(d == math.inf for d in diffs), sum(d == -math.inf for d in diffs))
    if b is None and any(math.isnan(d) for d in diffs):
        out.diff = no_estimate(len(diffs))  # one role with a NaN (an overflowed probe): nothing to judge
    elif b is not None or sum(out.discordant) or test.threshold and test.kind != "exact":
        out.diff = estimate(finite) if finite else no_estimate(len(diffs))
    return out


PLATEAU_SHARE = 0.8  # an arm is on the plateau when at least this share of its seeds is (5 of 6: 0.83)
NAMED = {"greater": {WORSE: PASS, BETTER: FAIL}, "less": {BETTER: PASS, WORSE: FAIL},
         "nonzero": {BETTER: PASS, WORSE: PASS}, "equivalent": {EQUIVALENT: PASS, BETTER: FAIL, WORSE: FAIL}}


def decide(test: Test, verdict: str) -> str:
    """A comparison verdict (`training.stats.comparison_verdict`, reading the statistic a − b as a loss: "lower"
    is better) in the claim's words:

    - directional claims (`greater` / `less`): EQUIVALENT when the interval lies inside ±margin (a measured null:
      no effect of the size that matters), else PASS / FAIL when the difference is shown on the claimed / the
      other side, else INCONCLUSIVE;
    - `nonzero` claims (an effect of either sign): EQUIVALENT inside ±margin, PASS when the difference is shown;
    - `equivalent` claims (nothing changes; the "difference" p tests |effect| > margin): PASS when the 95%
      interval lies inside ±margin (TOST), FAIL when the effect is shown to exceed the margin, else
      INCONCLUSIVE.
    Seeds that diverged in one arm only enter the difference test as the worst value (`training.stats.
    p_values`), so an arm that diverges more is the larger loss; an equivalence claim then FAILs when the
    difference is shown."""
    return NAMED[test.kind].get(verdict, verdict)


def combine(verdicts: Sequence[str]) -> str:
    """A claim's verdict from its primaries': AT PLATEAU when any is on the plateau, PASS when all pass, FAIL when
    any fails, EQUIVALENT when all are, else INCONCLUSIVE (one primary: its own)."""
    if AT_PLATEAU in verdicts:
        return AT_PLATEAU
    if all(v == verdicts[0] for v in verdicts):
        return verdicts[0]
    return FAIL if FAIL in verdicts else INCONCLUSIVE


def _exact(o: Outcome) -> str:
    t = o.test
    return PASS if abs(o.a.mean - t.threshold) <= t.tolerance else FAIL


def judge_tests(outcomes: Sequence[Outcome]) -> None:
    """Judge one family (Holm across it) and set each outcome's judgement and verdicts."""
    judged = [o for o in outcomes if o.test.kind != "exact"]
    counts = {o.test.id: (o.samples_a, o.samples_b) for o in judged  # counts: exact tests on the totals
              if o.test.stat in COUNT_STATISTICS and o.samples_b is not None and not o.test.threshold}
    family = judge_family({o.test.id: o.judged for o in judged}, {o.test.id: o.test.margin for o in judged},
                          "lower", ALPHA, {o.test.id: o.discordant for o in judged},
                          {o.test.id: o.test.kind == "equivalent" for o in judged}, counts)
    for o in outcomes:
        if o.test.kind == "exact":
            o.verdict = _exact(o)
            continue
        o.judgement = j = family[o.test.id]
        o.verdict, o.verdict_perm = decide(o.test, j.verdict), decide(o.test, j.verdict_perm)


def judge_all(claims: Sequence[Claim], contexts: Sequence[Context]) -> list[tuple[str, list[Outcome]]]:
    """Every claim's verdict and its outcomes. Each claim is its own family: Holm across its primaries only, so
    its verdict does not depend on which other claims ran; every secondary test is judged alone. Across the
    claims, each primary also gets Benjamini–Hochberg q-values (`q`) and the verdict they give (`verdict_bh`):
    the scorecard's false-discovery view. Report rows get no verdict. Last, a judged test with an arm on the
    unigram plateau (`plateau_arms`) reads AT PLATEAU instead — its statistic measures the plateau, not the
    claim — and so does a claim with such a primary."""
    measured = [[measure(ctx, t) for t in claim.tests] for claim, ctx in zip(claims, contexts, strict=True)]
    for outs in measured:
        judge_tests([o for o in outs if o.test.tier == PRIMARY])
        for o in outs:  # secondary tests and mechanism checks: each alone
            if o.test.tier not in (PRIMARY, REPORT):
                judge_tests([o])
    bh_scorecard([o for outs in measured for o in outs if o.test.tier == PRIMARY and o.judgement is not None])
    judged = []
    for outs, ctx in zip(measured, contexts, strict=True):
        first = [o for o in outs if o.test.tier == PRIMARY]
        for o in first:
            if o.test.kind == "exact":
                o.verdict_bh = o.verdict
        mark_plateau(ctx, [o for o in outs if o.test.tier != REPORT])
        judged.append((combine([o.verdict for o in first]), outs))
    return judged


def mark_plateau(ctx: Context, outcomes: Sequence[Outcome]) -> None:
    """The plateau rule on judged outcomes (after `bh_scorecard`): a test with an arm on the plateau
    (`plateau_arms`) reads AT PLATEAU in every verdict."""
    for o in outcomes:
        if plateau_arms(ctx, o.test):
            o.verdict = o.verdict_perm = o.verdict_bh = AT_PLATEAU


def plateau_arms(ctx: Context, test: Test) -> list[str]:
    """The arms of `test` on the unigram plateau: those whose trained runs, at the LR the statistic reads, end
    "plateau" (`measure.outcome`: the held-out loss within `training.stats.PLATEAU_NATS` of the training data's
    unigram entropy) in at least PLATEAU_SHARE of the seeds. An arm is a role (`x@i`: one configuration) or a
    family name (`x`: every LR of a sweep, read at the family's best LR — on the plateau there, it never leaves
    it). At-init measurements are never on the plateau (nothing was trained)."""
    arms = []
    for arm in (test.a, test.b):
        try:
            role = ctx.resolve(arm) if arm in ctx.roles or arm.endswith("@-1") else \
                ctx.family(arm)[best_lr_index(ctx, arm)]
            runs = ctx.runs(role)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            continue  # no arm (a one-role test), or none of trained runs (a measurement of another kind)
        if trained(ctx.spec(role)) and runs and \
                sum(outcome(r) == "plateau" for r in runs) >= PLATEAU_SHARE * len(runs):
            arms.append(arm)
    return arms


def bh_scorecard(primaries: Sequence[Outcome]) -> None:
    """The scorecard's false-discovery view of judged primary outcomes, across claims: each gets its
    Benjamini–Hochberg q-values (`q`, of its difference and equivalence p-values) and the verdict they give at
    FDR α (`verdict_bh`)."""
    for key in ("difference", "equivalence"):
        for o, q in zip(primaries, benjamini_hochberg([o.p[key] for o in primaries]), strict=True):
            o.q[key] = q
    for o in primaries:
        bh = comparison_verdict(o.judgement.direction, o.q["difference"], o.q["equivalence"], "lower", ALPHA)
        o.verdict_bh = decide(o.test, bh)


def trained(spec: Job) -> bool:
    return isinstance(spec, Train)
