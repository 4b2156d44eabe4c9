"""`normlab sweep SPEC --plan`: before the runs, how many seeds the spec's question needs.

For each comparison of the question's family (the cells, or LR groups, judged against the baseline) it prints,
at the level the verdict will use (α/k for a family of k, Holm's first step): the power of the spec's seeds to
detect a true difference of one margin, the minimum detectable effect, and the seeds needed for 80% power —
to show the difference, and to show equivalence within the margin at a true difference of 0. The spread of
the per-seed differences comes from a pilot: the finished runs of a sweep with the same cells (`--pilot DIR`,
default the spec's own sweep directory), typically fewer seeds; or from `--sd`.
"""
from __future__ import annotations

import math
from pathlib import Path

from training.errors import UserError
from training.stats import ALPHA, Estimate, min_detectable, power_at, seeds_needed
from training.sweep.analysis import Comparison, cells_of, compare_groups, compare_to_baseline, lr_groups
from training.sweep.report import check, load_sweep, read_results
from training.sweep.spec import Spec

POWER = 0.8


def _family(spec: Spec, pilot: Path) -> list[Comparison]:
    """The question's comparisons, computed on the pilot's runs with the spec's baseline, margin and family."""
    sweep = load_sweep(pilot)
    results = read_results(pilot, sweep)
    check(results, {**sweep, "metric": spec.metric, "baseline": spec.baseline}, str(pilot))
    cells = cells_of(results)
    wanted = {c for c, _ in spec.cells()}
    missing = sorted(wanted - {c.name for c in cells})
    if missing:
        raise UserError(f"--pilot '{pilot}' has no runs of the spec's cell(s) {', '.join(missing[:4])}: run a pilot "
                        "of the same grid (fewer seeds or steps), or give --sd")
    if spec.question == "cells":
        return compare_to_baseline(cells, spec.baseline, spec.margin, spec.mode, family=spec.compare)
    groups = lr_groups(cells, spec.lr_key, spec.axes, spec.mode)
    return compare_groups(groups, spec.lr_group(spec.baseline), spec.margin, spec.mode, spec.question,
                          family=spec.compare)


def _row(name: str, sd: float, n_pilot: int | str, n: int, margin: float, level: float) -> str:
    e = Estimate(0.0, sd, n, 0.0, 0.0, sd / math.sqrt(n), n - 1)
    power, mde = power_at(e, margin, level), min_detectable(e, level)
    need = seeds_needed(sd, margin, level, POWER)
    need_eq = seeds_needed(sd, margin, level, POWER, equivalence=True)
    return (f"| {name} | {sd:.4g} ({n_pilot}) | {power:.0%} | {mde:.4g} | {need or '> 1000'} | "
            f"{need_eq or '> 1000'} |")


def seeds_needed_table(spec: Spec, pilot: Path | None = None, sd: float | None = None) -> str:
    """The plan's text (a Markdown table and a recommendation)."""
    if spec.baseline is None or spec.margin is None:
        raise UserError(f"--plan: the spec '{spec.path}' needs a baseline and a margin (the smallest difference that "
                        "matters): the plan sizes the seeds to see one margin")
    if sd is not None and not sd > 0:
        raise UserError(f"--sd {sd}: must be > 0 (the standard deviation of the per-seed differences)")
    n = len(spec.seeds)
    if n < 2:
        raise UserError(f"--plan: the spec '{spec.path}' has {n} seed; a paired interval needs at least 2")
    if sd is not None:
        k = len(spec.compare) if spec.compare else (len(spec.cells()) - 1 if spec.question == "cells"
                                                    else len(spec.lr_groups()) - 1)
        names, sds, pilots = ["every comparison"], [sd], ["given"]
    else:
        family = _family(spec, Path(pilot) if pilot is not None else spec.sweep_dir)
        usable = [c for c in family if c.judgement.difference.n > 1 and c.judgement.difference.sd > 0]
        if not usable:
            raise UserError("--plan: the pilot has no comparison with two seeds or more on both sides; run more "
                            "pilot seeds, or give --sd")
        k = len(family)
        names = [c.cell for c in usable]
        sds = [c.judgement.difference.sd for c in usable]
        pilots = [f"n={c.judgement.difference.n}" for c in usable]
    level = ALPHA / max(1, k)
    rows = [f"Question `{spec.question}`: {k} comparison(s) against `{spec.baseline}`, judged at α/k = {level:.3g} "
            f"(Holm's first step); margin ±{spec.margin:g}; the spec has {n} seeds.", "",
            f"| comparison | sd of the per-seed differences (pilot) | power at ±margin, {n} seeds | MDE, {n} seeds | "
            f"seeds for {POWER:.0%} power to show ±margin | seeds for {POWER:.0%} power to show equivalence |",
            "|---|---|---|---|---|---|"]
    rows += [_row(name, s, p, n, spec.margin, level) for name, s, p in zip(names, sds, pilots, strict=True)]
    need = [seeds_needed(s, spec.margin, level, POWER) for s in sds]
    worst = max((x for x in need if x is not None), default=None)
    rows += ["", f"Seeds for {POWER:.0%} power on every comparison of the question: "
             + (f"{worst} (the spec has {n})." if worst is not None else "more than 1000: widen the margin, or "
                "reduce the noise (more steps, more validation batches).")]
    return "\n".join(rows) + "\n"
