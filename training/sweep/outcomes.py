"""The judged metric and the stability outcomes a sweep spec (or `normlab compare --group_by`) fixes before the runs,
and each run's value of them, read from its logged series by training/stats/'s one definition of each.

    metric: {tag: val/loss, reduce: final}        # reduce: final | min | max | {mean_last: K}; a bare tag is final
    outcomes:
      spikes: {window: 50, threshold: 6.0, margin: 1}   # loss spikes by the guard's z-score rule (counts)
      max_logit_peak: {margin: 5.0}                      # the largest attention logit over training (logit units)
      lr_reach: {delta: 0.1, margin: 0.25}               # LR reach within δ of each group's best (decades of LR)

Each outcome is judged as its own family against its own margin (null: no equivalence test), the cells (or LR
groups, for the reach) against the baseline, paired over seeds. How a run that diverged counts, per outcome:
- spikes: the worst count — more than any run that trained (its seed's comparison is decided on signed ranks);
- max_logit_peak: the worst peak — larger than any;
- lr_reach: at its LR, its seed's loss at initialization (the cap), as in every LR statistic.
"""
from __future__ import annotations

import math
from typing import Any

from training import health_tags as T
from training.run.dir import Points
from training.stats import Reduction, count_spikes, series_peak

OUTCOMES = ("spikes", "max_logit_peak", "lr_reach")
KEYS = {"spikes": ("window", "threshold", "margin"), "max_logit_peak": ("margin",), "lr_reach": ("delta", "margin")}
REQUIRED = {"spikes": ("window", "threshold"), "max_logit_peak": (), "lr_reach": ("delta",)}
SPIKE_TAG = "train/loss"  # the series spikes are counted on
UNITS = {"spikes": "spikes", "max_logit_peak": "logit", "lr_reach": "decades of LR"}


def parse_metric(raw: Any) -> tuple[str, Reduction]:
    """`metric` as a spec writes it: a tag, or {tag: TAG, reduce: ...}; ValueError naming what is wrong."""
    if raw is None:
        return "val/loss", Reduction()
    if isinstance(raw, str) and raw:
        return raw, Reduction()
    if isinstance(raw, dict) and isinstance(raw.get("tag"), str) and set(raw) <= {"tag", "reduce"}:
        return raw["tag"], Reduction.parse(raw.get("reduce", "final"))
    raise ValueError(f"metric {raw!r} must be a scalar tag such as val/loss, or {{tag: TAG, reduce: final | min | "
                     "max | {mean_last: K}}")


def _number(where: str, value: Any, positive: bool = True, integer: bool = False) -> float | int:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (value > 0 if positive else value >= 0) \
            or not math.isfinite(value):
        what = "a whole number" if integer else "a number"
        raise ValueError(f"{where} {value!r} must be {what} > 0 (YAML reads 3e-3 as a string: write 3.0e-3)")
    return value


def parse_outcomes(raw: Any) -> dict[str, dict[str, Any]]:
    """The `outcomes` mapping, validated and completed (an absent margin: null); ValueError naming the field and the
    valid ones."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"outcomes must map outcome names ({', '.join(OUTCOMES)}) to their settings, got {raw!r}")
    out = {}
    for name, settings in raw.items():
        if name not in OUTCOMES:
            raise ValueError(f"outcomes key {name!r} is not an outcome; choose from {', '.join(OUTCOMES)}")
        settings = {} if settings is None else settings
        if not isinstance(settings, dict) or set(settings) - set(KEYS[name]):
            raise ValueError(f"outcomes.{name} takes {', '.join(KEYS[name])}, got {settings!r}")
        for key in REQUIRED[name]:
            if key not in settings:
                raise ValueError(f"outcomes.{name} needs {key} (fixed before the runs); it takes "
                                 f"{', '.join(KEYS[name])}")
        rule = {"margin": None, **settings}
        if rule["margin"] is not None:
            _number(f"outcomes.{name}.margin", rule["margin"])
        if name == "spikes":
            if _number("outcomes.spikes.window", rule["window"], integer=True) < 2:
                raise ValueError(f"outcomes.spikes.window {rule['window']} must be >= 2 (earlier losses)")
            _number("outcomes.spikes.threshold", rule["threshold"])
        if name == "lr_reach":
            _number("outcomes.lr_reach.delta", rule["delta"])
        out[name] = rule
    return out


def run_outcomes(scalars: dict[str, Points], rules: dict[str, dict[str, Any]]) -> dict[str, float]:
    """A run's value of each per-run outcome among `rules` (NaN where its series was never logged): spikes on
    `train/loss` as logged, the peak over every layer's worst-head exact max logit."""
    out = {}
    if "spikes" in rules:
        losses = [v for _, v in scalars.get(SPIKE_TAG, [])]
        rule = rules["spikes"]
        out["spikes"] = float(count_spikes(losses, rule["window"], rule["threshold"])) if losses else math.nan
    if "max_logit_peak" in rules:
        exact = [scalars[tag] for _, tag in T.by_layer(scalars, T.ATTN_MAX_LOGIT_EXACT + T.WORST)]
        out["max_logit_peak"] = series_peak(exact)
    return out


def logged_every(points: Points) -> int | None:
    """The smallest step gap of a series past its first two points (the step-1 loss at initialization is logged
    whatever the interval): how often it was logged."""
    steps = [s for s, _ in points][1:]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return min(gaps) if gaps else None
