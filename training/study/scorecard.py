"""What the scorecard prints beside each verdict: which null decided it (and so which p and q to print), whether
the test could have seen an effect of one margin at all, and which tests measure one quantity twice.

- The deciding null: a directional claim is PASS or FAIL by rejecting "no difference" and EQUIVALENT by
  rejecting "an effect of at least one margin" (TOST); an equivalence claim PASSes by TOST and FAILs by showing
  the effect exceeds the margin. Printing the other null's p beside a verdict would show a number that decided
  nothing.
- Uninformative: power at the margin below 50% — the test was more likely to miss an effect of the size that
  matters than to see it; a PASS it gives overstates the effect's size (type M error).
- Mirrored tests: two tests whose per-seed values are equal, or the negative of each other, on every common seed
  are one measurement counted twice (e.g. a − b and b − a of the same runs)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from training.stats import EQUIVALENT, FAIL, PASS
from training.study.claims import PRIMARY, SECONDARY
from training.study.judge import Outcome

UNINFORMATIVE = 0.5  # power at the margin below this: the test rarely sees an effect of the size that matters
MIRROR_R, MIRROR_SLOPE, MIRROR_SEEDS = 0.99, 0.05, 4


def deciding_null(o: Outcome) -> str | None:
    """"difference" or "equivalence": the null whose test decides `o`'s verdict (None for an unjudged test)."""
    if o.judgement is None:
        return None
    if o.test.kind == "equivalent":
        return "difference" if o.verdict == FAIL else "equivalence"
    return "equivalence" if o.verdict == EQUIVALENT else "difference"


def low_power(power: float | None) -> bool:
    """Under UNINFORMATIVE power at the margin (None or NaN: no power was computed, so not low)."""
    return power is not None and math.isfinite(power) and power < UNINFORMATIVE


def uninformative(o: Outcome) -> bool:
    return low_power(o.power)


def power_cell(o: Outcome) -> str:
    """The power column: the power, with the marker when the test is uninformative."""
    if math.isnan(o.power):
        return "—"
    text = f"{o.power:.0%}"
    if uninformative(o):
        text += " (uninformative" + ("; effect size may be exaggerated (type M)" if o.verdict == PASS else "") + ")"
    return text


def per_seed(o: Outcome) -> list[float]:
    """The test's per-seed values: a − b for two roles, a for one (seed index order)."""
    if o.samples_b is None:
        return list(o.samples_a)
    return [x - y for x, y in zip(o.samples_a, o.samples_b, strict=False)]


def mirror(x: list[float], y: list[float]) -> tuple[float, float, int] | None:
    """(r, slope of y on x, seeds) when y = ±x on ≥ 4 common finite seeds (|r| > 0.99, slope within 0.05 of ±1)."""
    pairs = [(a, b) for a, b in zip(x, y, strict=False) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < MIRROR_SEEDS:
        return None
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    if statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    r = statistics.correlation(xs, ys)
    slope = statistics.linear_regression(xs, ys).slope
    if abs(r) > MIRROR_R and abs(slope - math.copysign(1.0, r)) <= MIRROR_SLOPE:
        return r, slope, len(pairs)
    return None


def mirrored(outcomes: Sequence[Outcome]) -> list[tuple[str, str, float, float, int]]:
    """Every pair of a primary with another primary or a secondary whose per-seed values are ± each other."""
    primaries = [o for o in outcomes if o.test.tier == PRIMARY]
    others = [o for o in outcomes if o.test.tier == SECONDARY]
    found = []
    for i, p in enumerate(primaries):
        for q in primaries[i + 1:] + others:
            m = mirror(per_seed(p), per_seed(q))
            if m is not None:
                found.append((p.test.id, q.test.id, *m))
    return found


def mirror_lines(outcomes: Sequence[Outcome]) -> list[str]:
    """The report's warning lines, one per mirrored pair."""
    return [f"Warning: {a} and {b} have per-seed values {'equal to' if r > 0 else 'the negative of'} each other "
            f"(r = {r:.3f}, slope {s:.3f} over {n} seeds): one measurement counted twice, not two pieces of "
            "evidence." for a, b, r, s, n in mirrored(outcomes)]
