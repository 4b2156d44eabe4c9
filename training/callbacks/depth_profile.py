"""The depth-profile figure of the training-health metrics: per-layer values against layer index, for TensorBoard's
Images tab.

TensorBoard's scalar charts show each layer over steps; the question about normalization is usually the profile
over depth at one step. `render` draws four panels — stream RMS entering each block (`resid/rms/L{l}`), the
attention and MLP update ratios (`resid/update_ratio/{attn,mlp}/L{l}`), the max attention logit
(`attn/max_logit/L{l}`) and the sink mass (`attn/sink_mass/L{l}`) — for this step (solid) beside step 0
(dashed), and returns the image as an [H, W, 3] uint8 array. Drawn with matplotlib's object API on an Agg
canvas (no pyplot, no global backend switch), so it works headless and in any thread.
"""
from __future__ import annotations

import re

import numpy as np

from training import health_tags as T

# Panel title → the tag stems drawn in it (one line each). Linear axes: at the depths normlab trains, the
# profiles span about a decade, where a log axis would be left with one or no labelled tick.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("stream RMS entering block", (T.RESID_RMS,)),
    ("update RMS / stream RMS", tuple(f"{T.UPDATE_RATIO}/{s}" for s in T.SUBLAYERS)),
    ("max attention logit", (T.ATTN_MAX_LOGIT,)),
    ("sink mass (key 0)", (T.SINK_MASS,)),
)
STEMS = tuple(stem for _, stems in PANELS for stem in stems)
_LAYER_TAG = re.compile(r"^(.*)/L(\d+)$")


def profile_values(values: dict[str, float]) -> dict[str, float]:
    """The subset of a metrics step's {tag: value} that the figure draws (what is kept of step 0)."""
    out = {}
    for tag, value in values.items():
        m = _LAYER_TAG.match(tag)
        if m and m.group(1) in STEMS:
            out[tag] = float(value)
    return out


def _series(values: dict[str, float], stem: str) -> tuple[list[int], list[float]]:
    pairs = sorted((int(m.group(2)), v) for t, v in values.items() if (m := _LAYER_TAG.match(t)) and m.group(1) == stem)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def render(values: dict[str, float], step: int, initial: dict[str, float] | None,
           initial_note: str = "step 0 not available") -> np.ndarray:
    """The figure for `values` at `step` beside `initial` (step 0's `profile_values`; None: `initial_note` in
    the title instead), as an [H, W, 3] uint8 RGB image (about 880 × 220 pixels)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.75), dpi=80)
    canvas = FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    for ax, (title, stems) in zip(axes, PANELS, strict=True):
        for i, stem in enumerate(stems):
            label = stem.rsplit("/", 1)[-1] if len(stems) > 1 else None
            color = f"C{i}"
            x, y = _series(values, stem)
            if x:
                ax.plot(x, y, marker="o", ms=3, color=color, label=label and f"{label}, step {step}")
            if initial and step != 0:
                x0, y0 = _series(initial, stem)
                if x0:
                    ax.plot(x0, y0, ls="--", marker=".", color=color, alpha=0.6, label=label and f"{label}, step 0")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if len(stems) > 1 and ax.has_data():
            ax.legend(fontsize=6)
    when = "solid: this step, dashed: step 0" if initial and step != 0 else initial_note if step else "step 0"
    fig.suptitle(f"depth profile at step {step} ({when})", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.2, top=0.8, wspace=0.35)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
