"""What every normlab plot shares: matplotlib without a display, the atomic save, and the band over seeds.

Used by the study (training/study/plots.py), the sweep's report (training/sweep/plots.py), `normlab compare`
and `normlab coordcheck`, so every figure is written the same way and a band means the same thing in each:
the mean over seeds, shaded from the lowest to the highest seed (`BAND`) — every seed inside it, with no
assumption about their distribution (the reports' intervals are the t-intervals).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_write

BAND = "mean over seeds, band from the lowest to the highest seed"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Write `fig` to `path` atomically (a reader never sees half an image) and close it; the format is the
    path's suffix (png by default)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    finally:
        pyplot().close(fig)



def seed_band(per_seed: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, lowest, highest) over seeds at each x of `per_seed` [seed][x]."""
    ys = np.asarray(per_seed, dtype=float).reshape(len(per_seed), -1)
    return ys.mean(0), ys.min(0), ys.max(0)


def band(ax: Any, x: Sequence[float], per_seed: Sequence[Sequence[float]], label: str, **kw: Any) -> Any:
    """Plot the mean over seeds with a band from the lowest to the highest seed; the label counts the seeds.
    With fewer than three x values (a run validated once or twice) a line and a band would be invisible or
    mislead: the means are markers and the range over seeds a vertical bar at each. Returns the mean's line."""
    mean, lo, hi = seed_band(per_seed)
    few = len(mean) < 3
    (line,) = ax.plot(x, mean, label=f"{label} (n={len(per_seed)})", **({"marker": "o", **kw} if few else kw))
    if len(per_seed) > 1 and few:
        ax.vlines(x, lo, hi, color=line.get_color(), alpha=0.5)
    elif len(per_seed) > 1:
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    return line
