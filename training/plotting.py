"""What every normlab plot shares: matplotlib without a display and the atomic save.

Used by the study (training/study/plots.py), the sweep's report (training/sweep/plots.py), `normlab compare`
and `normlab coordcheck`, so every figure is written the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_write


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

