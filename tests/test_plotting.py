"""One band convention for every plot (training/plotting.py): the mean over seeds, shaded from the lowest to the
highest seed — the study's plots and the sweep report's draw it with the same function."""
from __future__ import annotations

import numpy as np

from training.plotting import band, pyplot


def test_the_band_spans_the_lowest_and_highest_seed_around_the_mean():
    per_seed = [[1.0, 2.0, 3.0], [2.0, 2.5, 2.0], [4.0, 1.0, 2.5]]
    fig, ax = pyplot().subplots()
    line = band(ax, [0, 1, 2], per_seed, "arm")
    assert np.allclose(line.get_ydata(), np.mean(per_seed, axis=0))
    assert line.get_label() == "arm (n=3)"
    (fill,) = ax.collections
    ys = fill.get_paths()[0].vertices[:, 1]
    assert np.isclose(ys.min(), 1.0) and np.isclose(ys.max(), 4.0)  # min and max over seeds, not ±1 sd
    for x, lo, hi in zip([0, 1, 2], np.min(per_seed, 0), np.max(per_seed, 0), strict=True):
        at_x = fill.get_paths()[0].vertices[np.isclose(fill.get_paths()[0].vertices[:, 0], x), 1]
        assert np.isclose(at_x.min(), lo) and np.isclose(at_x.max(), hi)
    pyplot().close(fig)


def test_the_study_and_the_sweep_draw_the_same_band():
    import training.plotting
    import training.study.plots
    import training.sweep.plots

    assert training.study.plots.band is training.sweep.plots.band is training.plotting.band


def test_one_validation_per_run_is_a_marker_with_its_range_not_an_empty_panel():
    fig, ax = pyplot().subplots()
    line = band(ax, [300], [[5.9], [6.1], [6.0]], "arm")
    assert line.get_marker() == "o" and np.allclose(line.get_ydata(), [6.0])
    (bar,) = ax.collections  # the range over seeds as a vertical bar
    assert np.allclose(sorted(bar.get_segments()[0][:, 1]), [5.9, 6.1])
    pyplot().close(fig)
