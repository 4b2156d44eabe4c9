"""The output directory of a prepare: refuse what may not be replaced, build aside, publish atomically.

Everything is written to a hidden sibling of the output, ``.<name>.partial`` (same filesystem), ``meta.json``
last, and the sibling is renamed into place, so an interrupted prepare leaves nothing that looks valid. The
sibling keeps the progress of an interrupted prepare (``progress.json``) so that ``--resume`` can continue it;
without ``--resume`` a leftover one is discarded. A lock file beside it (``.<name>.lock``, held with ``flock``)
keeps two processes out of one partial directory: a second concurrent prepare (another node's
``prepare_data``) builds in a private temporary sibling instead and publishes only if nobody did first. A
directory without ``meta.json`` is never deleted, even with ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data import layout
from data.atomic import write_text_atomic
from data.errors import DataError

logger = logging.getLogger(__name__)


def up_to_date(output: Path, fingerprint: str, tokenizer_sha256: str | None, overwrite: bool) -> bool:
    """True if ``output`` already holds this exact result; raise if it holds something we may not replace."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return False
    if not output.is_dir():
        raise DataError(f"--output '{output}' is a file; give a directory path")
    existing = layout.read_meta(output)
    if existing is None:
        raise DataError(
            f"--output '{output}' exists and is not a prepared directory (no {layout.META_FILE}); normlab will not "
            "delete it, even with --overwrite: choose another --output"
        )
    damage = layout.problems(output, existing)
    if existing["fingerprint"] == fingerprint and not damage:
        return True
    if overwrite:
        return False
    if damage:
        raise DataError(f"'{output}' is damaged ({'; '.join(damage)}); pass --overwrite to rebuild it")
    if tokenizer_sha256 is not None and existing["tokenizer_sha256"] != tokenizer_sha256:
        raise DataError(
            f"'{output}' was prepared with a different tokenizer (sha256 {existing['tokenizer_sha256'][:12]}…) "
            f"than the one given ({tokenizer_sha256[:12]}…); pass --overwrite to re-tokenize, or choose another "
            "--output"
        )
    raise DataError(
        f"'{output}' holds data prepared from different sources or settings (fingerprint "
        f"{existing['fingerprint'][:12]}…, now {fingerprint[:12]}…); pass --overwrite to replace it, or choose "
        "another --output"
    )


PROGRESS_FILE = "progress.json"


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


@contextlib.contextmanager
def staging(output: Path, resume: bool = False) -> Iterator[Path]:
    """The directory to build ``output`` in: ``.<name>.partial`` (continued if ``resume`` and it holds progress,
    kept on failure if it does), or a private temporary one while another process holds the partial one."""
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = _try_lock(output.parent / f".{output.name}.lock")
    if lock is None:
        logger.info("another prepare is writing %s; building in a private directory", partial_dir(output))
        with _private_staging(output) as stage:
            yield stage
        return
    stage = partial_dir(output)
    try:
        if stage.exists() and not (resume and (stage / PROGRESS_FILE).is_file()):
            if (stage / PROGRESS_FILE).is_file():
                logger.info("discarding the interrupted prepare in %s (pass --resume to continue it)", stage)
            shutil.rmtree(stage)
        stage.mkdir(exist_ok=True)
        stage.chmod(0o755)
        try:
            yield stage
            shutil.rmtree(stage, ignore_errors=True)  # already gone after a successful publish
        except BaseException:
            if (stage / PROGRESS_FILE).is_file():
                logger.warning("prepare interrupted: its progress is kept in %s; run the same command with "
                               "--resume to continue, or delete that directory", stage)
            else:
                shutil.rmtree(stage, ignore_errors=True)
            raise
    finally:
        Path(lock.name).unlink(missing_ok=True)  # while still held: a waiting process re-checks the inode
        lock.close()


def _try_lock(path: Path):
    """An open, exclusively ``flock``-ed file at ``path``, or None if another process holds it."""
    while True:
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        try:  # the holder before us may have unlinked the file after we opened it: lock the current one
            if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                return handle
        except FileNotFoundError:
            pass
        handle.close()


@contextlib.contextmanager
def _private_staging(output: Path) -> Iterator[Path]:
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    stage.chmod(0o755)  # mkdtemp makes it private; the published directory should read like any other
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # already gone after a successful publish


def publish(stage: Path, output: Path, fingerprint: str) -> None:
    """Rename the finished ``stage`` to ``output``, replacing what ``up_to_date`` allowed to be replaced."""
    (stage / PROGRESS_FILE).unlink(missing_ok=True)
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        output.replace(old)  # replacing an empty directory is allowed on POSIX
        stage.rename(output)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        stage.rename(output)
    except OSError:
        # Another process (another node's prepare_data) published first: fine if it built the same thing.
        existing = layout.read_meta(output)
        if existing is None or existing["fingerprint"] != fingerprint:
            raise
        logger.info("%s was prepared concurrently by another process", output)


def read_progress(stage: Path, fingerprint: str) -> dict[str, Any] | None:
    """The saved progress of an interrupted prepare in ``stage`` (None if there is none); refuses another
    prepare's progress."""
    path = stage / PROGRESS_FILE
    if not path.is_file():
        return None
    progress = json.loads(path.read_text(encoding="utf-8"))
    if progress.get("fingerprint") != fingerprint:
        raise DataError(
            f"--resume: the interrupted prepare in '{stage}' was for other sources or settings (fingerprint "
            f"{progress.get('fingerprint', '?')[:12]}…, now {fingerprint[:12]}…); rerun without --resume to discard it"
        )
    return progress


def save_progress(stage: Path, progress: dict[str, Any]) -> None:
    """Atomically replace ``progress.json`` (written only after the token files are flushed)."""
    path = stage / PROGRESS_FILE
    write_text_atomic(path, json.dumps(progress))
