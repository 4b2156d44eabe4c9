"""Inputs: local files, directories and globs, a Hugging Face dataset, or the default corpus.

Everything is read through Hugging Face ``datasets`` and returned as a ``Dataset`` with one string column,
``text``, one row per document: a ``.txt`` file is one document; each record of a ``.jsonl``/``.json``/
``.parquet`` file is one document (its ``--text-field``). ``datasets`` reads ``.txt`` files with universal
newlines, so their CR LF and lone CR become LF; JSON and Parquet strings arrive exactly as stored.

Files are checked before ``datasets`` sees them, so errors name the file: missing paths, empty files,
directories without usable files, and invalid UTF-8 (with the byte offset).
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import datasets

from data.errors import DataError

logger = logging.getLogger(__name__)

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT = "text"
_CHUNK = 1 << 20
# Seconds to wait for the Hub before declaring it unreachable: `datasets` itself retries for ~25 s.
HUB_PROBE_TIMEOUT = 3.0


@dataclass(frozen=True)
class SourceFile:
    """One input file and what the fingerprint records about it."""

    path: Path
    size: int
    sha256: str
    bad_utf8_offset: int | None  # byte offset of the first invalid UTF-8 byte, None if valid

    @property
    def format(self) -> str:
        return FORMATS[self.path.suffix.lower()]

    def describe(self) -> dict[str, object]:
        return {"path": str(self.path), "size": self.size, "sha256": self.sha256}


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand files, directories (recursively) and globs into a sorted-per-input, de-duplicated file list."""
    files: dict[Path, None] = {}
    for spec in inputs:
        for path in _expand(str(spec)):
            files[path] = None
    return list(files)


def _expand(spec: str) -> list[Path]:
    if glob.has_magic(spec):
        matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = [p for p in matches if p.is_file() and p.suffix.lower() in FORMATS and p.stat().st_size > 0]
        if not files:
            raise DataError(f"input glob '{spec}' matched no non-empty {_supported()} files")
        return files
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise DataError(f"input path '{spec}' does not exist")
    if path.is_dir():
        return _directory_files(path, spec)
    if path.suffix.lower() not in FORMATS:
        raise DataError(f"input file '{spec}' has an unsupported extension; use {_supported()} files")
    if path.stat().st_size == 0:
        raise DataError(f"input file '{spec}' is empty")
    return [path]


def _directory_files(root: Path, spec: str) -> list[Path]:
    candidates = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS)
    files = [p for p in candidates if p.stat().st_size > 0]
    if len(files) < len(candidates):
        logger.warning("skipping %d empty file(s) under %s", len(candidates) - len(files), spec)
    if not files:
        raise DataError(
            f"input directory '{spec}' contains no usable files (non-empty {_supported()}, searched recursively)"
        )
    return files


def _supported() -> str:
    return "/".join(f"*{ext}" for ext in FORMATS)


def inspect_files(paths: Sequence[Path], encoding_errors: str = "strict") -> list[SourceFile]:
    """Hash each file and check text formats for UTF-8; strict mode fails on the first bad byte."""
    sources = []
    for path in paths:
        source = _inspect(path, check_utf8=FORMATS[path.suffix.lower()] != "parquet")
        if source.bad_utf8_offset is not None:
            if encoding_errors == "strict":
                raise DataError(
                    f"input file '{path}' is not valid UTF-8: invalid byte at offset {source.bad_utf8_offset}; "
                    "fix the file, or pass --encoding-errors replace to replace invalid bytes with U+FFFD"
                )
            logger.warning("%s: invalid UTF-8 from byte %d replaced with U+FFFD", path, source.bad_utf8_offset)
        sources.append(source)
    return sources


def _inspect(path: Path, check_utf8: bool) -> SourceFile:
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bad_offset, position = None, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if check_utf8 and bad_offset is None:
                bad_offset = _first_bad_byte(decoder, chunk, position)
            position += len(chunk)
    if check_utf8 and bad_offset is None:
        bad_offset = _first_bad_byte(decoder, b"", position, final=True)
    return SourceFile(path=path, size=position, sha256=digest.hexdigest(), bad_utf8_offset=bad_offset)


def _first_bad_byte(decoder: codecs.IncrementalDecoder, chunk: bytes, position: int, final: bool = False) -> int | None:
    # The decoder keeps an incomplete trailing sequence between chunks; errors are reported relative to
    # (pending bytes + chunk), so subtract what was pending to get a file offset.
    pending = len(decoder.getstate()[0])
    try:
        decoder.decode(chunk, final)
    except UnicodeDecodeError as e:
        return position - pending + e.start
    return None


def load_files(sources: Sequence[SourceFile], text_field: str, work_dir: Path) -> datasets.Dataset:
    """Load local files into one ``text`` column, grouped by format (text, then json, then parquet)."""
    parts = []
    for fmt in ("text", "json", "parquet"):
        paths = [_readable_copy(s, work_dir) for s in sources if s.format == fmt]
        if paths:
            parts.append(_load_format(fmt, paths, text_field, work_dir / "hf_cache"))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _readable_copy(source: SourceFile, work_dir: Path) -> str:
    """The file itself, or (with --encoding-errors replace) a repaired UTF-8 copy in the work directory.

    A copy, rather than the loaders' own ``encoding_errors``, because the JSON loader ignores that option
    for UTF-8 input and pyarrow would then reject the bytes.
    """
    if source.bad_utf8_offset is None:
        return str(source.path)
    repaired = work_dir / "repaired" / f"{source.sha256[:16]}{source.path.suffix}"
    repaired.parent.mkdir(parents=True, exist_ok=True)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(source.path, "rb") as src, open(repaired, "w", encoding="utf-8") as dst:
        while chunk := src.read(_CHUNK):
            dst.write(decoder.decode(chunk))
        dst.write(decoder.decode(b"", final=True))
    return str(repaired)


def _load_format(fmt: str, paths: list[str], text_field: str, cache_dir: Path) -> datasets.Dataset:
    options = {"sample_by": "document"} if fmt == "text" else {}
    try:
        with _no_download_counter():
            ds = datasets.load_dataset(fmt, data_files=paths, split="train", cache_dir=str(cache_dir), **options)
    except Exception as e:  # datasets/pyarrow raise many types; the file list is what the user needs
        raise DataError(f"could not read {fmt} input(s) {_preview(paths)}: {e}") from e
    return _text_column(ds, text_field if fmt != "text" else TEXT, f"{fmt} input(s) {_preview(paths)}")


def _text_column(ds: datasets.Dataset, text_field: str, what: str) -> datasets.Dataset:
    if text_field not in ds.column_names:
        raise DataError(
            f"{what} have no field {text_field!r} (fields: {', '.join(ds.column_names)}); "
            "pass --text-field with the name of the text field"
        )
    dtype = ds.features[text_field]
    if getattr(dtype, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"field {text_field!r} of {what} holds {dtype}, not text; pass --text-field")
    ds = ds.select_columns([text_field])
    return ds.rename_column(text_field, TEXT) if text_field != TEXT else ds


def _preview(paths: Sequence[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


@contextlib.contextmanager
def _no_download_counter() -> Iterator[None]:
    # `load_dataset` on local files pings a download counter on S3 (3 s timeout) unless this is off; local
    # data should never touch the network.
    saved = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = saved


def load_documents(documents: Sequence[str], work_dir: Path) -> datasets.Dataset:
    """Load in-memory documents (the default corpus) through the same JSON path as user files."""
    path = work_dir / "documents.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({TEXT: doc}, ensure_ascii=False) + "\n")
    return _load_format("json", [str(path)], TEXT, work_dir / "hf_cache")


def load_hub(name: str, config: str | None, split: str, text_field: str) -> datasets.Dataset:
    """Load a Hugging Face Hub dataset; without network this fails within seconds instead of retrying."""
    offline = datasets.config.HF_HUB_OFFLINE
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not hub_reachable(endpoint, HUB_PROBE_TIMEOUT):
        raise DataError(
            f"cannot reach {endpoint} to download --hf-dataset {name!r} (no network?). If it is already in "
            "your Hugging Face cache, set HF_DATASETS_OFFLINE=1 and rerun; otherwise download it where there "
            "is network, or pass local files with --input"
        )
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline misses, unknown names, bad configs or splits all land here
        where = "in the local cache (offline mode)" if offline else "on the Hub"
        raise DataError(f"could not load --hf-dataset {name!r} (config {config}, split {split!r}) {where}: {e}") from e
    return _text_column(ds, text_field, f"records of {name!r}")


def hub_reachable(endpoint: str, timeout: float) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False
