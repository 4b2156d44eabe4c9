"""The output directory of a prepare: refuse what may not be replaced, build aside, publish atomically.

Everything is written to a hidden temporary sibling of the output (same filesystem), ``meta.json`` last, and
the sibling is renamed into place, so an interrupted prepare leaves nothing that looks valid. A directory
without ``meta.json`` is never deleted, even with ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from data import meta as layout
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


@contextlib.contextmanager
def staging(output: Path) -> Iterator[Path]:
    """A hidden sibling of ``output`` (same filesystem, so the final rename is atomic), removed on failure."""
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    stage.chmod(0o755)  # mkdtemp makes it private; the published directory should read like any other
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # already gone after a successful publish


def publish(stage: Path, output: Path, fingerprint: str) -> None:
    """Rename the finished ``stage`` to ``output``, replacing what ``up_to_date`` allowed to be replaced."""
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
