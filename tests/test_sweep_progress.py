"""The sweep's ETA and standing (training/sweep/progress.py), on runs whose times are given: each expected value
is worked out by hand in the comment beside it."""
from __future__ import annotations

from training.run.dir import STATUSES
from training.sweep.progress import STATUS_ORDER, RunView, counts, duration, eta, footer

NOW = 1000.0


def run(status: str, seconds: float | None = None, step: int = 0, up: float | None = None) -> RunView:
    """A run of 8 steps whose last attempt started `seconds` ago (and, unless running, ended now)."""
    started = None if seconds is None else NOW - seconds
    return RunView(f"c/s{id(object())}", status, step, 8, started, None if status == "running" else NOW, up)


def test_eta_schedules_what_is_left_on_the_slots():
    views = [run("finished", 10), run("finished", 10), run("running", 5, step=4, up=1), *[run("pending")] * 3]
    # The running run projects 1 s of start-up + 4 s for half its steps → 9 s in all, 4 s left. Slots free at
    # [4, 0]; each pending run takes the finished runs' mean, 10 s: at 0 → 10, at 4 → 14, at 10 → 20.
    assert eta(views, slots=2, now=NOW) == 20.0
    assert footer(views, 2, NOW) == "2/6 done (2 finished, 1 running, 3 pending), ETA 20s"


def test_before_any_run_ends_the_running_runs_steps_are_the_estimate():
    views = [run("running", 30, step=2, up=10), run("running", 30, step=4, up=10), run("pending")]
    # Projected: 10 + 20 / (2/8) = 90 s (60 left) and 10 + 20 / (4/8) = 50 s (20 left); the pending run takes their
    # mean, 70 s, from 20 s: done at max(60, 90) = 90 s.
    assert eta(views, slots=2, now=NOW) == 90.0
    assert eta([run("running", 30, step=0), run("pending")], slots=2, now=NOW) is None  # nothing to go by
    assert footer([run("running", 30, step=0)], 1, NOW) == "0/1 done (1 running), ETA ?"


def test_a_finished_sweep_has_no_eta_and_durations_read_as_one_word():
    assert footer([run("finished", 10), run("diverged", 3)], 2, NOW) == "2/2 done (1 finished, 1 diverged)"
    assert [duration(s) for s in (None, 4.4, 65, 3725)] == ["?", "4s", "1m05s", "1h02m"]


def test_the_counts_keep_one_order_whatever_order_the_runs_reached_it():
    views = [run("pending"), run("running", 5), run("failed", 2), run("finished", 10), run("diverged", 3)]
    expected = "1 finished, 1 diverged, 1 failed, 1 running, 1 pending"
    assert counts(views) == counts(views[::-1]) == expected
    assert sorted(STATUS_ORDER) == sorted(STATUSES)  # the run directory's states, each with its place
