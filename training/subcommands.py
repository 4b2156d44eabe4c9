"""The `normlab` subcommands that LightningCLI runs.

Read by the dispatcher (training/cli.py) and by NormlabCLI (training/lightning_cli.py, which gives each one the
default config), so that neither module imports the other: the dispatcher imports NormlabCLI only to run it.
"""
from __future__ import annotations

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test")
