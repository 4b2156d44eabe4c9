"""Every fit that ends normally leaves a checkpoint of its last step: at max_steps off the interval, and on
SIGTERM (a real signal to a real `normlab fit` process), from which the resumed run equals the straight one."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers.faults import signal_when_waiting
from tests.helpers.multiproc import REPO, run_here
from tests.helpers.runs import consolidated_state_dict, scalars

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


def fit_args(root: Path, name: str, *extra: str) -> list[str]:
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(HELPERS / "probe.yaml"), "--data.path",
            str(root / "tiny"), "--runs_dir", str(root / "runs"), "--name", name, *extra]


def fit_here(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """`normlab <args>` in this process: what it wrote to stderr (its log)."""
    capsys.readouterr()
    run_here(args)
    return capsys.readouterr().err


def steps_saved(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_max_steps_off_the_interval_saves_the_last_step_once(workdir, capsys):
    run = workdir / "runs" / "six"
    out = fit_here(fit_args(workdir, "six", "--trainer.max_steps", "6"), capsys)
    assert steps_saved(run) == ["step-00000004", "step-00000006"]  # every 4, and the end
    assert json.loads((run / "checkpoints" / "step-00000006" / "manifest.json").read_text())["step"] == 6
    assert f"final checkpoint (step 6): {run / 'checkpoints' / 'step-00000006'}" in out
    # Resuming a finished run trains nothing and saves nothing: step 6 exists already.
    again = fit_here(fit_args(workdir, "six", "--trainer.max_steps", "6", "--ckpt_path", "last"), capsys)
    assert steps_saved(run) == ["step-00000004", "step-00000006"] and "final checkpoint" not in again
    # The closing advice, run as printed, trains on to 12 steps with the schedule the run had: its 6-step cosine,
    # then the LR it ended with (optim.min_lr), not a schedule recomputed over 12 steps (a jump back up).
    advice = next(line for line in out.splitlines() if "train on:" in line).split("train on:", 1)[1]
    assert shlex.split(advice)[:2] == ["normlab", "fit"] and "--optim.continuation hold" in advice
    before = scalars(run, "train/lr")
    run_here(shlex.split(advice)[1:])
    lrs = scalars(run, "train/lr")
    assert max(lrs) == 12 and all(lrs[s] == before[s] for s in before)
    assert all(lrs[s] == pytest.approx(1e-4) for s in range(7, 13))  # optim.min_lr: the cosine's end
    assert json.loads((run / "checkpoints" / "step-00000012" / "manifest.json").read_text())["schedule"]["steps"] == 6


def test_a_callback_stopping_the_fit_saves_the_step_it_stopped_at(workdir, tmp_path, capsys):
    (tmp_path / "stop.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.helpers.callbacks.RequestStop\n      init_args: {step: 5}\n")
    out = fit_here([*fit_args(workdir, "early"), "-c", str(tmp_path / "stop.yaml")], capsys)
    run = workdir / "runs" / "early"
    assert steps_saved(run) == ["step-00000004", "step-00000005"]
    assert f"stop checkpoint (step 5): {run / 'checkpoints' / 'step-00000005'}" in out
    assert "final checkpoint" not in out  # (8 steps asked for: not the end)


def test_sigterm_mid_run_saves_then_resume_equals_the_straight_run(workdir, tmp_path):
    straight = workdir / "runs" / "straight"
    run_here(fit_args(workdir, "straight"))

    # SIGTERM while update 6 runs (the waiter holds its first micro-batch until the signal is sent).
    marker = tmp_path / "waiting"
    (tmp_path / "wait.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.helpers.callbacks.RNGProbe\n"
        "    - class_path: tests.helpers.callbacks.WaitForSignal\n"
        f"      init_args: {{step: 5, marker: '{marker}'}}\n")
    args = [*fit_args(workdir, "stopped"), "-c", str(tmp_path / "wait.yaml")]
    assert signal_when_waiting(args, workdir, marker, tmp_path / "out.txt") == 0, (tmp_path / "out.txt").read_text()
    output = (tmp_path / "out.txt").read_text()
    stopped = workdir / "runs" / "stopped"
    assert "stopping after step 6 on SIGTERM" in output
    assert f"stop checkpoint (step 6): {stopped / 'checkpoints' / 'step-00000006'}" in output
    assert "resume with --ckpt_path last" in output and "final checkpoint" not in output
    assert steps_saved(stopped) == ["step-00000004", "step-00000006"]
    assert max(scalars(stopped, "train/loss")) == 6

    run_here(fit_args(workdir, "stopped", "--ckpt_path", "last"))
    # from step 6: a run that started over would have superseded 4 and 6 (moved aside into incomplete/)
    assert steps_saved(stopped) == ["step-00000004", "step-00000006", "step-00000008"]
    for tag in ("train/loss", "train/lr", "val/loss", "probe/rng"):
        assert scalars(stopped, tag) == scalars(straight, tag), tag
    final = [consolidated_state_dict(run / "checkpoints" / "step-00000008", tmp_path) for run in (straight, stopped)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
