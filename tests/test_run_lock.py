"""One writer per run directory (training/run/lock.py): a second `normlab fit | validate | test` on a run another
process is writing is refused in one line naming that process, and the lock dies with its holder."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler at import)
import pytest

from tests.helpers.multiproc import REPO, cpu_env
from tests.helpers.runs import read_manifest
from training.checkpointing import resume
from training.cli import main
from training.cluster.rank import is_first_rank
from training.errors import DEBUG_ENV, CheckpointError, UserError
from training.run import layout
from training.run.lock import LOCK_FILE, acquire, locked

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

TINY = ["-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--trainer.logger", "false",
        "--metrics.every_n_steps", "0"]


def fit_argv(workdir: Path, runs: Path, *extra: str) -> list[str]:
    return ["fit", *TINY, "--data.path", str(workdir / "tiny"), "--runs_dir", str(runs), *extra]


def wait_for_holder(run: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    """The lock's record, once the holding fit is training (it has written its config.yaml, and with checkpoints
    and the logger off writes nothing more)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if (run / layout.CONFIG_FILE).is_file():
                return json.loads((run / LOCK_FILE).read_text())
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{run} never named its holder")


def test_a_second_process_on_a_run_is_refused_until_the_holder_dies(workdir, tmp_path, capsys, monkeypatch):
    """A real `normlab fit` holds the run (checkpoints off: it writes none while it trains); `fit --ckpt_path last`
    and `validate` on the same run are refused in one line naming its pid and host, and write nothing. After a
    `kill -9` of the holder the same fit runs: the kernel dropped the lock."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    runs = tmp_path / "runs"
    holder = subprocess.Popen([sys.executable, "-m", "training.cli", *fit_argv(workdir, runs, "--name", "busy",
                               "--trainer.max_steps", "100000", "--checkpoint.every_n_steps", "0")],
                              cwd=tmp_path, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        record = wait_for_holder(runs / "busy", holder)
        assert (record["pid"], record["host"], record["command"]) == (holder.pid, socket.gethostname(), "normlab fit")
        before = sorted(runs.rglob("*"))
        for argv in (fit_argv(workdir, runs, "--name", "busy", "--ckpt_path", "last"),
                     ["validate", *fit_argv(workdir, runs, "--name", "busy")[1:]]):
            assert main(argv) == 2
            out, err = capsys.readouterr()
            lines = err.strip().splitlines()
            expected = (f"normlab {argv[0]}: error: {runs / 'busy'} is in use by another normlab process (pid "
                        f"{holder.pid} on {socket.gethostname()}, normlab fit, since ")
            assert lines[-1].startswith(expected), err
            assert "--name" in lines[-1] and "Traceback" not in err
        assert sorted(runs.rglob("*")) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    assert (runs / "busy" / LOCK_FILE).is_file()  # left by the killed holder: it blocks no one
    assert main(fit_argv(workdir, runs, "--name", "busy", "--ckpt_path", "last", "--trainer.max_steps", "2",
                         "--checkpoint.every_n_steps", "2")) == 0
    assert read_manifest(runs / "busy" / "checkpoints" / "step-00000002")["step"] == 2
    assert not (runs / "busy" / LOCK_FILE).exists()  # removed by a holder that ends normally


def test_a_refused_start_leaves_no_directory_and_a_released_lock_is_free(tmp_path):
    """The directories made to hold the lock go again when the command ends with them empty; a released lock
    is taken at once by the next process (here, the next holder in this process)."""
    run = tmp_path / "runs" / "sweep" / "cell"
    lock = acquire(run, "normlab fit")
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    acquire(run, "normlab test").release()
    assert list(tmp_path.iterdir()) == [tmp_path / "runs"] and not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("env, first", [
    ({}, True),
    ({"RANK": "0", "LOCAL_RANK": "0"}, True),  # torchrun / DeepSpeed, rank 0
    ({"RANK": "3", "LOCAL_RANK": "1"}, False),
    ({"LOCAL_RANK": "1", "SLURM_PROCID": "0"}, False),  # Lightning's launcher inside a one-task Slurm step
    ({"NODE_RANK": "1"}, False),  # Lightning's launcher on the second node
    ({"SLURM_PROCID": "2"}, False),  # srun
])
def test_only_the_first_rank_of_a_job_takes_the_lock(env, first, monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert is_first_rank() is first


@pytest.mark.parametrize("shape, what", [("symlink", "a symbolic link"), ("hardlink", "a file with 2 hard links"),
                                         ("directory", "a directory"), ("fifo", "a FIFO")])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_and_nothing_it_reaches_changes(shape, what, tmp_path):
    """`runs/<name>/.lock` as a link to another file, a directory or a FIFO: one UserError naming the path and
    the fix (remove it), without following it — the file it links to keeps its bytes — and without blocking on the
    FIFO. `locked` (a sweep's flock) refuses the same shapes."""
    run, other = tmp_path / "runs" / "linked", tmp_path / "precious.txt"
    run.mkdir(parents=True)
    other.write_text("keep me\n")
    lock = run / LOCK_FILE
    {"symlink": lambda: lock.symlink_to(other), "hardlink": lambda: os.link(other, lock),
     "directory": lambda: lock.mkdir(), "fifo": lambda: os.mkfifo(lock)}[shape]()
    for take in (lambda: acquire(run, "normlab fit"), lambda: locked(lock).__enter__()):
        with pytest.raises(UserError) as err:
            take()
        assert str(err.value).startswith(f"{lock} is {what}, not normlab's lock file"), err.value
        assert f"remove it (`rm -r {lock}`)" in str(err.value) and "\n" not in str(err.value)
    assert other.read_text() == "keep me\n"
    assert os.path.lexists(lock) and run.is_dir()


@pytest.mark.parametrize("damage", ["train.bin", "val.bin"])
def test_a_start_refused_for_damaged_data_leaves_nothing_that_blocks_the_retry(damage, workdir, tmp_path, capsys,
                                                                               monkeypatch):
    """A train split whose size is no multiple of its token size, or a missing split: `normlab fit` is refused in
    one line naming the damage before anything is written into the run directory — no TensorBoard events, no
    config.yaml — so the corrected start is not refused as "already holds a run"."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    data, runs = tmp_path / "damaged", tmp_path / "runs"
    shutil.copytree(workdir / "tiny", data)
    if damage == "train.bin":
        with open(data / damage, "ab") as f:
            f.write(b"\0")
    else:
        (data / damage).unlink()
    capsys.readouterr()
    argv = fit_argv(workdir, runs, "--name", "retry", "--trainer.max_steps", "1")
    argv[argv.index("--trainer.logger") + 1] = "true"  # the default TensorBoard logger, which writes on start
    assert main([*argv, "--data.path", str(data)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"normlab fit: error: '{data}' is damaged (") and str(data / damage) in line, line
    resume.check_no_logged_run(runs / "retry")  # what refuses a start on a run that logged
    assert not (runs / "retry").exists()


def test_the_empty_files_of_a_start_on_a_full_disk_do_not_block_the_retry(tmp_path):
    """A start on a full disk leaves at most empty files (config.yaml, an events file that got no bytes): nothing
    was logged, so the retry is not refused as "already holds a run"; one byte of either is a run's record."""
    run = tmp_path / "full"
    run.mkdir()
    config, events = run / "config.yaml", run / "events.out.tfevents.1.host.1.0"
    config.touch()
    events.touch()
    resume.check_no_logged_run(run)
    for path in (config, events):
        path.write_bytes(b"x")
        with pytest.raises(CheckpointError, match="already holds a run"):
            resume.check_no_logged_run(run)
        path.write_bytes(b"")
