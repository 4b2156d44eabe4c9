"""Run-level outcomes from a run's logged series, each defined once for the sweep's report and `normlab compare`
(and the study): the judged metric's reduction over its logged values, the number of loss spikes by the guard's
own z-score rule, and the peak of a logged series (the largest attention logit over training); with the exact
paired test that judges a count.

- `Reduction`: what one number of a logged metric is — its `final` value (the last logged), its `min` or `max`
  over the run, or `mean_last` K: the mean of its last K logged values.
- `loss_z`: the z-score of a step's loss against a window of earlier losses, (x − mean) / sd with the sample sd,
  0 with fewer than two earlier losses or an sd of 0. The non-finite guard (training/callbacks/guard.py) logs it
  every step as `guard/loss_z`; `count_spikes` replays it over a run's logged losses: a spike is a finite loss
  whose z-score exceeds the threshold, every finite loss entering the window of `window` earlier ones (as in the
  guard when it skips nothing).
- `series_peak`: the largest value of any of the given series; a non-finite value is +inf (the worst).
- `judge_counts`: paired counts judged by exact tests alone (never a t-test: a count's differences are small
  integers, often all equal, and a standard error of 0 says nothing): the sign-flip permutation test of the
  per-seed differences and the Poisson test on the totals (counts.py), both of which must reject; when neither
  arm counted anything — 0 spikes against 0 — there is nothing to test and no verdict.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.stats.estimates import ALPHA, estimate, no_estimate
from training.stats.verdicts import Judgement, assemble, count_p_values

REDUCTIONS = ("final", "min", "max", "mean_last")
Points = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class Reduction:
    """One number of a logged metric (`REDUCTIONS`); `k` is mean_last's K."""

    kind: str = "final"
    k: int = 1

    def __post_init__(self) -> None:
        if self.kind not in REDUCTIONS:
            raise ValueError(f"reduce {self.kind!r} is not one of final, min, max, mean_last: K")
        if self.kind == "mean_last" and not (isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 1):
            raise ValueError(f"reduce mean_last: {self.k!r} must be a whole number of logged values >= 1")

    @classmethod
    def parse(cls, raw: Any) -> Reduction:
        """`final`, `min`, `max` or `{mean_last: K}` (as a spec writes it); ValueError naming what is valid."""
        if isinstance(raw, dict) and list(raw) == ["mean_last"]:
            return cls("mean_last", raw["mean_last"])
        if isinstance(raw, str) and raw != "mean_last":
            return cls(raw)
        raise ValueError(f"reduce {raw!r} is not one of final, min, max, {{mean_last: K}}")

    def to_json(self) -> Any:
        return {"mean_last": self.k} if self.kind == "mean_last" else self.kind

    def describe(self, tag: str) -> str:
        return {"final": f"final {tag}", "min": f"min of {tag} over the run", "max": f"max of {tag} over the run",
                "mean_last": f"mean of the last {self.k} logged {tag}"}[self.kind]

    def __call__(self, points: Points) -> tuple[float, int | None]:
        """(the reduced value, the last step it reads) of a series in step order; (NaN, None) when empty. A
        non-finite value in what it reads makes the result non-finite."""
        if not points:
            return math.nan, None
        values = [v for _, v in points]
        if self.kind == "final":
            return values[-1], points[-1][0]
        if self.kind == "mean_last":
            tail = values[-self.k:]
            return sum(tail) / len(tail), points[-1][0]
        if not all(math.isfinite(v) for v in values):
            return math.inf if self.kind == "max" or any(math.isnan(v) for v in values) else -math.inf, points[-1][0]
        return (min if self.kind == "min" else max)(values), points[-1][0]


def mean_and_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 with fewer than two values): the guard's loss window."""
    mean = sum(values) / len(values) if values else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd


def loss_z(window: Sequence[float], loss: float) -> float:
    """The guard's loss z-score: `loss` against the earlier losses in `window` (0 with fewer than two of them, or
    when they do not vary)."""
    if len(window) < 2:
        return 0.0
    mean, sd = mean_and_sd(list(window))
    return (loss - mean) / sd if sd > 0 else 0.0


def count_spikes(losses: Iterable[float], window: int, threshold: float) -> int:
    """How many of `losses` (in step order) are spikes by the guard's rule: a finite loss whose `loss_z` against
    the previous `window` finite losses exceeds `threshold`."""
    if window < 2 or not threshold > 0:
        raise ValueError(f"a spike rule needs window >= 2 and threshold > 0, got window={window}, "
                         f"threshold={threshold}")
    recent: deque[float] = deque(maxlen=window)
    spikes = 0
    for loss in losses:
        if not math.isfinite(loss):
            continue
        spikes += loss_z(recent, loss) > threshold
        recent.append(loss)
    return spikes


def series_peak(series: Iterable[Points]) -> float:
    """The largest value over every series (NaN when there is none); a non-finite value counts as +inf."""
    values = [v for points in series for _, v in points]
    if not values:
        return math.nan
    return math.inf if not all(math.isfinite(v) for v in values) else max(values)


def judge_counts(counts: Mapping[str, tuple[Sequence[float], Sequence[float]]], margin: float | None,
                 discordant: Mapping[str, tuple[int, int]] | None = None, alpha: float = ALPHA) -> dict[str, Judgement]:
    """Each comparison's paired counts (per seed: the candidate's, the baseline's; lower is better) judged by exact
    tests alone (`training.stats.count_p_values`: the paired sign-flip test and the Poisson test on the totals,
    both must reject), Holm-adjusted across the family; equivalence within ±`margin` per seed. `discordant`:
    seeds whose run diverged in the candidate only / the baseline only, left out of `counts` (the worst count:
    the signed-rank form, as for any metric). Where both arms counted nothing at every seed there is nothing to
    test (NaN p: no verdict)."""
    diverged = {n: (discordant or {}).get(n, (0, 0)) for n in counts}
    ests = {}
    for n, (mine, base) in counts.items():
        xs = [float(a) - float(b) for a, b in zip(mine, base, strict=True)]
        ests[n] = estimate(xs) if xs else no_estimate()
    raw = {n: count_p_values(mine, base, margin, diverged[n]) for n, (mine, base) in counts.items()}
    return assemble(ests, dict.fromkeys(counts, margin), raw, "lower", alpha, diverged, exact_only=True)
