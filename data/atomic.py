"""Atomic file writes: a reader sees the old file or the whole new one, never half of one.

`atomic_write(path)` opens a temporary file in the destination's own directory (same filesystem, so the rename
is atomic), hands it to the caller, then flushes and fsyncs it, renames it over `path` and fsyncs the
directory, so a crash leaves either version but nothing in between. If the caller raises, the temporary file is
removed and `path` is untouched. The temporary name is unique per call (`.<name>.<random>.tmp`), so two
processes writing the same file never write into one temporary.

Every atomic write of normlab goes through here: reports, JSON records and plots (`write_text_atomic`,
`training.plotting.save_figure`), a checkpoint's sidecars and manifest, Lightning's `model.ckpt`
(`training.checkpointing.safe.SafeCheckpointIO`); the directories a checkpoint save renames into place are made
durable with `fsync_path`. It lives in `data/` because both `data/` and `training/` write files and `data/`
never imports `training/`.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _file_mode() -> int:
    """The mode an ordinary `open(path, "w")` would give a new file: 0o666 less the process umask (mkstemp
    would make it 0o600, private to its owner)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def fsync_path(path: str | Path) -> None:
    """Make a file's contents, or a directory's entries (a rename into it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """A file object (text for mode "w", bytes for "wb") whose contents replace `path` atomically when the
    block ends without an exception; the directory must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode {mode!r} must be 'w' or 'wb'")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically."""
    with atomic_write(path) as f:
        f.write(text)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_write(path, "wb") as f:
        f.write(data)
