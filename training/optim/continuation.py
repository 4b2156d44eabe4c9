"""What a resumed run's LR schedule is when its length or its schedule fields changed since the checkpoint.

`schedule.py` computes the LR over the run's total steps (or `optim.decay_steps`): given a longer `max_steps`, a
resume would recompute the whole schedule over the new length, and the LR would jump (an 80-step cosine run
extended to 100 goes from 1.01e-4 at step 80 back up to 1.54e-4 at step 90). So every checkpoint records the
schedule it was trained with (`schedule_record`, in its manifest), and a resume whose schedule differs follows
`optim.continuation`:

- `refuse` (the default): one error line naming what changed and the two ways to ask for it;
- `hold`: the checkpoint's schedule goes on unchanged — over its own length, then at the LR it ends with
  (`min_lr` for cosine, linear and wsd, `lr` for constant) for every added step. Changed schedule fields (lr,
  warmup, shape…) are refused: holding a schedule means keeping it;
- `recompute`: the new fields and length define the schedule from step 0, the jump included (asked for, e.g.
  to stretch a run that has not started decaying).

A checkpoint written before the record existed is not checked (the schedule is computed as configured).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from training.errors import UserError
from training.optim.config import CONTINUATIONS, OptimConfig

__all__ = ["CONTINUATIONS", "SCHEDULE_FIELDS", "continue_schedule", "schedule_record"]
# The OptimConfig fields that shape the LR factor (lr_factor); decay_steps is folded into the record's `steps`.
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "schedule", "decay_fraction", "decay_shape")


def schedule_record(cfg: OptimConfig, total_steps: float) -> dict[str, Any]:
    """The schedule as `build_optimizer(model, cfg, total_steps)` computes it: its fields and `steps`, the step
    its decay ends at (decay_steps, else the run's total steps)."""
    steps = cfg.decay_steps or total_steps
    return {**{name: getattr(cfg, name) for name in SCHEDULE_FIELDS},
            "steps": int(steps) if math.isfinite(steps) else None}  # (None: build_optimizer refuses it)


def _changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    names = [*SCHEDULE_FIELDS, "steps"]
    return [f"{'schedule length' if k == 'steps' else 'optim.' + k} {saved.get(k)!r} → {now[k]!r}"
            for k in names if k in saved and saved[k] != now[k]]


def continue_schedule(saved: dict[str, Any] | None, cfg: OptimConfig, total_steps: float,
                      where: str = "the checkpoint") -> tuple[OptimConfig, int]:
    """The (config, total steps) to build the resumed run's schedule from, given the checkpoint's `saved` record
    (None: not recorded) and this run's `cfg` and `total_steps` — or a UserError (one line) that says what would
    change and how to ask for it, per `cfg.continuation` (the module docstring)."""
    now = schedule_record(cfg, total_steps)
    changes = [] if saved is None else _changes(saved, now)
    if not changes or cfg.continuation == "recompute":
        return cfg, total_steps
    fields_changed = [c for c in changes if not c.startswith("schedule length")]
    if cfg.continuation == "hold" and not fields_changed and saved.get("steps"):
        return dataclasses.replace(cfg, decay_steps=None), int(saved["steps"])
    if cfg.continuation == "hold":
        raise UserError(f"cannot hold the LR schedule of {where}: its fields changed ({', '.join(fields_changed)}); "
                        "resume with the checkpoint's optim settings, or recompute the schedule over the new "
                        "settings with --optim.continuation recompute (the LR jumps)")
    raise UserError(f"resuming {where} would change its LR schedule ({', '.join(changes)}) and make the LR jump: "
                    "add --optim.continuation hold (keep its schedule, then its final LR for the added steps) or "
                    "--optim.continuation recompute (the new schedule from step 0)")
