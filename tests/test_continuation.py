"""A resume whose schedule length or fields changed: refused in one line by default, the checkpoint's schedule
held (then its final LR) with `optim.continuation: hold`, recomputed with `recompute` (optim/continuation.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

from training.errors import UserError, report_user_error
from training.optim import OptimConfig, build_optimizer, lr_factor
from training.optim.continuation import continue_schedule, schedule_record

COSINE = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10)


def lr_at(cfg: OptimConfig, total: float, step: int) -> float:
    """The LR the schedule `build_optimizer` makes gives optimizer step `step` (as a resume positions it)."""
    _, schedule = build_optimizer(torch.nn.Linear(2, 2), cfg, total)
    schedule.last_epoch = step - 1
    with warnings.catch_warnings():  # (stepping the schedule without an optimizer step: no update is made here)
        warnings.simplefilter("ignore")
        schedule.step()
    return schedule.get_last_lr()[0]


def test_a_longer_run_is_refused_in_one_line_naming_the_change_and_the_choices(capsys):
    saved = schedule_record(OptimConfig(**COSINE), 80)
    with pytest.raises(UserError) as err:
        continue_schedule(saved, OptimConfig(**COSINE), 100, "runs/x/checkpoints/step-00000080")
    assert report_user_error("fit", err.value) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "step-00000080" in line and "schedule length 80 → 100" in line
    assert "--optim.continuation hold" in line and "--optim.continuation recompute" in line
    # the same length (a stopped run resumed as it is) and an unrecorded checkpoint go on as configured
    assert continue_schedule(saved, OptimConfig(**COSINE), 80) == (OptimConfig(**COSINE), 80)
    assert continue_schedule(None, OptimConfig(**COSINE), 100) == (OptimConfig(**COSINE), 100)
    # a fixed decay_steps is not changed by a longer run
    fixed = OptimConfig(**COSINE, decay_steps=80)
    assert continue_schedule(schedule_record(fixed, 80), fixed, 100) == (fixed, 100)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "linear", "constant"])
def test_hold_keeps_the_checkpoints_schedule_then_its_final_lr(schedule):
    saved_cfg = OptimConfig(**COSINE, schedule=schedule)
    cfg, total = continue_schedule(schedule_record(saved_cfg, 80), OptimConfig(**COSINE, schedule=schedule,
                                                                                continuation="hold"), 100)
    assert total == 80
    final = 1e-3 * lr_factor(80, saved_cfg, 80)  # the LR the checkpoint's schedule ends with
    assert final == pytest.approx(1e-3 if schedule == "constant" else 1e-4)
    assert lr_at(cfg, total, 80) == pytest.approx(final) and lr_at(cfg, total, 90) == pytest.approx(final)
    assert lr_at(cfg, total, 40) == pytest.approx(1e-3 * lr_factor(40, saved_cfg, 80))  # unchanged before its end
    # recompute: the schedule over the new length, the jump the default refuses
    cfg, total = continue_schedule(schedule_record(saved_cfg, 80), OptimConfig(**COSINE, schedule=schedule,
                                                                                continuation="recompute"), 100)
    assert total == 100 and lr_at(cfg, total, 90) == pytest.approx(1e-3 * lr_factor(90, saved_cfg, 100))
    if schedule != "constant":  # the jump: back above the LR the run ended with
        assert lr_at(cfg, total, 90) > 1.2 * final


def test_hold_refuses_changed_schedule_fields():
    saved = schedule_record(OptimConfig(**COSINE), 80)
    with pytest.raises(UserError, match=r"optim.lr 0.001 → 0.002.*--optim.continuation recompute"):
        continue_schedule(saved, OptimConfig(**{**COSINE, "lr": 2e-3}, continuation="hold"), 100)
    with pytest.raises(ValueError, match="optim.continuation='keep' is not valid"):
        OptimConfig(continuation="keep")
