"""Sweeps: a grid of configs × seeds trained as ordinary `normlab fit` runs, locally or as a Slurm job array.

spec.py (the YAML spec and its runs), state.py (what each run reached, sweep.json), launch.py (one run's fit
process and record), runner.py (what to train), local.py and slurm.py (the executors), cli.py (`normlab sweep`).
"""
