"""`normlab study`: test the normalization literature's claims on a grid of small models, with seeds.

The study is an experiment, not the library: `claims` holds each claim's source, setup and tests as data
(thresholds fixed before the runs), `grid` the configurations, `measure` and `timing` what one job measures,
`runner` runs the grid (optionally in parallel processes), `stats` and `evaluate` turn per-seed numbers into
PASS / FAIL / INCONCLUSIVE, and `plots` and `report` write docs-ready output. See `main` for the command.
"""
from training.study.cli import main, run_study

__all__ = ["main", "run_study"]
