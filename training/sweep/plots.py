"""The report's plots (matplotlib, Agg), each written atomically: the curves of every cell against tokens with
a band over its seeds, and the final metric against the learning rate per group."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from training.plotting import BAND, band, pyplot, save_figure
from training.sweep.analysis import Cell, LrGroup
from training.sweep.results import TRAIN_LOSS, RunResult


def _aligned(runs: Sequence[RunResult], tag: str) -> tuple[np.ndarray, list[list[float]]]:
    """(tokens, [run][step] values) at every step that all of the runs logged."""
    series = [dict(r.curves.get(tag, [])) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    tokens = np.array(steps, dtype=float) * runs[0].tokens_per_step if runs else np.array([])
    return tokens, [[s[step] for step in steps] for s in series]


def curves(cells: Sequence[Cell], tags: Sequence[str], out: Path) -> None:
    """One panel per tag: each cell's band over the seeds that did not diverge (`training.plotting.band`); a
    diverged run's own curve dotted, ending where it stopped logging."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tags), figsize=(6.5 * len(tags), 4.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, tag in zip(axes[0], tags, strict=True):
        shown: list[float] = []  # the values of the runs that did not diverge: the y range (a diverged run's
        for i, cell in enumerate(cells):  # loss would otherwise flatten every other curve)
            colour = colours[i % len(colours)]
            kept = [r for r in cell.included if r.outcome != "diverged" and r.curves.get(tag)]
            if kept:
                x, per_seed = _aligned(kept, tag)
                if len(x):
                    band(ax, x, per_seed, cell.name, color=colour)
                    shown += [v for seed in per_seed for v in seed]
            label = f"{cell.name}: diverged (dotted)"
            for r in cell.included:
                if r.outcome == "diverged" and r.curves.get(tag):
                    steps, values = zip(*[(s, v) for s, v in r.curves[tag] if math.isfinite(v)] or [(0, math.nan)],
                                        strict=True)
                    ax.plot(np.array(steps) * r.tokens_per_step, values, ":", color=colour, linewidth=1, label=label)
                    label = None  # one legend entry per cell
        if shown and math.isfinite(span := max(shown) - min(shown)):
            ax.set_ylim(min(shown) - 0.05 * span - 1e-6, max(shown) + 0.05 * span + 1e-6)
        ax.set_xlabel("tokens")
        ax.set_ylabel(tag)
        ax.set_title(f"{tag}: {BAND} (dotted: diverged)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out)


def lr_curves(groups: Sequence[LrGroup], metric: str, out: Path) -> None:
    """Per group: the score per LR (the mean final metric, diverged runs at the cap) as a line, each seed's
    final metric as a dot, each diverged run as an × at the cap; log-scaled LR axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, group in enumerate(groups):
        colour = colours[i % len(colours)]
        lrs = sorted(lr for lr, score in group.scores.items() if math.isfinite(score))
        ax.plot(lrs, [group.scores[lr] for lr in lrs], "-", color=colour, label=group.name)
        for lr, cell in group.cells.items():
            finals = [r.final for r in cell.numbers]
            ax.plot([lr] * len(finals), finals, "o", color=colour, markersize=4, alpha=0.6)
            caps = [group.caps[r.seed] for r in cell.included if r.outcome == "diverged"]
            caps = [c for c in caps if math.isfinite(c)]
            if caps:
                ax.plot([lr] * len(caps), caps, "x", color=colour, markersize=8)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"final {metric}")
    ax.set_title("line: mean over seeds (diverged = its seed's loss at init, ×); dots: seeds", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)


def curve_tags(metric: str) -> list[str]:
    return [TRAIN_LOSS] if metric == TRAIN_LOSS else [TRAIN_LOSS, metric]
