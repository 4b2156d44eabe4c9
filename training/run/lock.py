"""File locks: one writer per run directory (`acquire`), and the flock a sweep's processes take in turn (`locked`).

`normlab fit | validate | test` hold `<run dir>/.lock` while they run.

A second process on the same run directory is refused with one line naming the holder (pid, host, command,
start time) — two fits on one `--name` would otherwise move each other's in-flight saves aside and purge each
other's checkpoints. The lock is an `flock` on the file, so the kernel drops it when its holder dies, even by
`kill -9`: a stale lock file never blocks anyone. The file is removed when its holder ends normally. Anything at
that path but a regular file of one link (a symbolic or hard link, a directory, a FIFO) is refused in one line,
never followed: the holder truncates and rewrites the file.

Which process holds it: the job's first rank (training/cluster/rank.py, from the launcher's environment, before any
process group exists). The ranks of one job are one writer — they write disjoint shards and rank 0 alone decides
about the directory — so a lock per rank would refuse a job's own ranks; every job has a first rank, which tries
the same file, so one is enough to keep a second job out. A multi-node run on a shared filesystem needs that
filesystem to implement `flock` across hosts: NFS does (the client maps it to NFS locks); Lustre only when mounted
with `-o flock` (`localflock` locks per node). Where the filesystem refuses locks altogether, the run goes on
without one, with a warning that says so.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import UserError
from training.run.layout import LOCK_FILE

log = logging.getLogger(__name__)

_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # a filesystem without flock


@dataclass
class RunLock:
    """A held lock; `release()` ends it (removes the file, and the directories made only to hold it if they
    stayed empty: a command refused after taking the lock leaves nothing behind)."""

    path: Path
    fd: int  # -1: not held (a filesystem without locks)
    made: list[Path] = field(default_factory=list)  # directories created for the lock, deepest first

    def release(self) -> None:
        try:
            os.unlink(self.path)  # while still held: a process that opened this file retries on the new one
        except OSError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _remove_empty(self.made)


def _remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()  # only if empty
        except OSError:
            return


def acquire(run_dir: str | Path, command: str) -> RunLock:
    """Hold `<run_dir>/.lock` for `command` (e.g. "normlab fit"), or raise a UserError naming the process that
    holds it. On a filesystem without locks, a RunLock that holds nothing (warned)."""
    run_dir = Path(run_dir)
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    while True:
        try:
            fd = open_lock_file(path)
        except UserError:
            _remove_empty(made)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            _remove_empty(made)
            raise UserError(f"{run_dir} is in use by another normlab process ({holder}): one process writes a run "
                            "at a time — wait for it to end (or stop it), or use another --name") from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKS:
                raise
            log.warning("cannot lock %s (%s): this filesystem does not support file locks; make sure no other "
                        "process writes %s meanwhile", path, os.strerror(err.errno), run_dir)
            return RunLock(path, -1, made)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file after we opened it: lock the new one
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunLock(path, fd, made)


def open_lock_file(path: Path) -> int:
    """Open (or create) the lock file `path` for reading and writing — only a regular file of one link, or a
    UserError naming it. The lock file is truncated and rewritten: opened through a symlink or as a hard link it
    would overwrite the file it shares, so links are never followed; a directory or FIFO there (O_NONBLOCK: a
    FIFO's open would otherwise wait for a writer) is refused in the same line instead of a traceback."""
    fix = f"remove it (`rm -r {path}`) and run the command again: normlab creates its own lock file there"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            what = "a symbolic link" if os.path.islink(path) else _kind(path)
            raise UserError(f"{path} is {what}, not normlab's lock file: {fix}") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = _kind(path) if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
        raise UserError(f"{path} is {what}, not normlab's lock file (writing it would change another file): {fix}")
    return fd


def _kind(path: Path) -> str:
    """What is at `path`, in words (for a refusal)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "unreadable"
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {record['pid']} on {record['host']}, {record['command']}, since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it is starting"


@contextmanager
def locked(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` for the block — a sweep's directory, its state file, its trackers' shared
    experiment — released by the kernel if the holder dies, even by kill -9; yields whether it was taken (always
    True when blocking). The file stays: many processes take it in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
