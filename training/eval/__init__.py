"""Evaluation: held-out loss, perplexity and bits per byte of checkpoints (heldout.py, history.py), their one
metric vocabulary (metrics.py), and lm-evaluation-harness tasks (tasks.py, harness.py: the optional `[eval]`
extra, checked by `require_harness` before either is imported)."""
from __future__ import annotations

import importlib.util

from training.errors import UserError


def require_harness(what: str) -> None:
    """lm-evaluation-harness is installed, or one UserError saying that `what` (a flag) needs it and how to
    install it."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f'{what} needs lm-evaluation-harness, which is not installed: pip install -e ".[eval]"')
