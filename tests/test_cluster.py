"""training/cluster/ without a cluster: the requeue bound, the `cluster.*` settings, the lost-rank line and the
launcher's rank. (What they do on a real two-node Slurm: tests/test_slurm_cluster.py.)"""
from __future__ import annotations

import json
import logging
import re

import pytest

from training.cluster.config import ClusterConfig
from training.cluster.requeue import requeue
from training.run.layout import REQUEUES_FILE


def history(*steps: int) -> str:
    return json.dumps([{"job": "7", "restart": i, "step": s, "reason": "warned by SIGUSR1", "time": 0.0}
                       for i, s in enumerate(steps)])


def test_a_run_requeued_max_requeues_times_without_progress_is_not_requeued_again(tmp_path, monkeypatch, caplog):
    """Three requeues in a row that all resumed from step 8 and got no further: a fourth is refused in one line
    naming the run and the step, and nothing is asked of Slurm (the record stays as it was)."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    record = tmp_path / REQUEUES_FILE
    record.write_text(history(4, 8, 8, 8))
    with caplog.at_level(logging.ERROR, logger="training.cluster"):
        assert not requeue(tmp_path, 8, "warned by SIGUSR1", max_requeues=3)
    assert record.read_text() == history(4, 8, 8, 8)
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: requeued 3 times in a row without getting past step 8; not requeued again (the run's log "
        "says why; cluster.max_requeues allows more)"]


def test_progress_resets_the_count(tmp_path, monkeypatch, caplog):
    """The same history, but the run got past step 8 since: the requeue is recorded and asked of Slurm (here
    there is no `scontrol`: the call says so in one line and returns False)."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(tmp_path))  # (no scontrol there)
    record = tmp_path / REQUEUES_FILE
    record.write_text(history(4, 8, 8, 8))
    with caplog.at_level(logging.ERROR, logger="training.cluster"):
        assert not requeue(tmp_path, 12, "warned by SIGUSR1", max_requeues=3)
    assert [r["step"] for r in json.loads(record.read_text())] == [4, 8, 8, 8, 12]
    assert [r.getMessage() for r in caplog.records] == [
        "scontrol is not on the PATH: job 7 not requeued (resume with --ckpt_path last)"]


@pytest.mark.parametrize("garbled", [b"[{bad", b"\xff\xfe[]", b'{"step": 8}', b"[1, 2]", b'[{"step": "8"}]'])
def test_a_garbled_requeue_record_counts_afresh_and_is_rewritten_whole(garbled, tmp_path, monkeypatch, caplog):
    """A `requeues.json` that is not JSON, not UTF-8, not a list, or whose entries are not requeues: the warned
    job is still requeued (here, no `scontrol`: the attempt says so) — one warning naming the file, no
    traceback — and the record is replaced by this one requeue, with no temporary file left beside it."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # (no scontrol there)
    record = tmp_path / REQUEUES_FILE
    record.write_bytes(garbled)
    with caplog.at_level(logging.WARNING, logger="training.cluster"):
        assert not requeue(tmp_path, 8, "warned by SIGUSR1", max_requeues=3)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"'{record}'" in warned[0] and "counting this run's requeues afresh" in warned[0]
    assert [(r["job"], r["step"]) for r in json.loads(record.read_text())] == [("7", 8)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [REQUEUES_FILE]


def test_outside_slurm_nothing_is_requeued(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not requeue(tmp_path, 5, "warned by SIGUSR1", max_requeues=3)
    assert not (tmp_path / REQUEUES_FILE).exists()


@pytest.mark.parametrize("field, value, message", [
    ("signal", "TERM", "cluster.signal='TERM': choose one of USR1, USR2"),
    ("timeout_s", 0, "cluster.timeout_s=0 must be between 1 and 604800 seconds (7 days)"),
    ("timeout_s", 1e-4, "cluster.timeout_s=0.0001 must be between 1 and 604800"),
    ("timeout_s", 1e300, "cluster.timeout_s=1e+300 must be between 1 and 604800"),
    ("timeout_s", float("nan"), "cluster.timeout_s=nan must be between"),
    ("max_requeues", -1, "cluster.max_requeues=-1 must be >= 0"),
])
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClusterConfig(**{field: value})


def test_the_lost_rank_line_names_the_stop_signal_all_reduce_by_its_code(monkeypatch):
    """A peer lost while the ranks' stop flags travel: the line names that all-reduce, found by the function's code
    (not by a file name that a move would silently break)."""
    from types import SimpleNamespace

    from training.cluster.failure import collective_failure
    from training.cluster.signals import StopSignals

    def lost() -> None:
        raise RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:41337")

    flags = StopSignals()
    flags._work = SimpleNamespace(wait=lost)  # the previous boundary's all-reduce, whose peer is gone
    with pytest.raises(RuntimeError) as err:
        flags.agreed(world_size=2)
    monkeypatch.setenv("RANK", "1")
    line = collective_failure(err.value)
    assert line.startswith("rank 1: the stop-signal all_reduce lost its connection to a peer: another rank"), line
    assert collective_failure(ValueError("Connection closed by peer")) is None  # no collective's error


@pytest.mark.parametrize("env, rank", [
    ({}, 0), ({"RANK": "3", "LOCAL_RANK": "1"}, 3), ({"SLURM_PROCID": "2"}, 2), ({"JSM_NAMESPACE_RANK": "5"}, 5),
    ({"RANK": "0", "SLURM_PROCID": "0", "LOCAL_RANK": "1"}, 1),  # any non-zero variable: not the first rank
])
def test_the_launcher_rank_is_read_from_one_list_of_variables(env, rank, monkeypatch):
    from training.cluster.rank import RANK_VARS, launcher_rank

    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert launcher_rank() == rank
