"""Inputs: local files, directories and globs, a Hugging Face dataset, or the default corpus.

Documents are read as a stream, file by file and record batch by record batch, so memory does not grow with
the corpus: a ``.txt`` file is one document; each record of a ``.jsonl``/``.json``/``.parquet`` file is one
document (its ``--text_field``). ``.txt`` files are read with universal newlines, so their CR LF and lone CR
become LF; JSON and Parquet strings arrive exactly as stored. A Hub dataset is read through ``datasets``
(``streaming=True`` downloads records as they are read).

Files are checked before they are read, so errors name the file: missing paths, empty files,
directories without usable files, and invalid UTF-8 (with the byte offset).
"""

from __future__ import annotations

import codecs
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

from data.errors import DataError

logger = logging.getLogger(__name__)

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT = "text"
_CHUNK = 1 << 20
# The largest document normlab tokenizes. A document is encoded whole: sentencepiece's encoder took ~45 bytes of RAM
# per character of one long line here (16 MB of text: 0.75 GB peak), so a 1 GB document aborted the process with
# std::bad_alloc. 64 MiB keeps one encode under ~3 GB.
MAX_DOCUMENT_BYTES = 64 << 20
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
    """Hash each file and check text formats for UTF-8; strict mode fails on the first bad byte. A ``.txt`` file
    (one document) over ``MAX_DOCUMENT_BYTES`` is refused before anything is read."""
    sources = []
    for path in paths:
        if FORMATS[path.suffix.lower()] == "text" and path.stat().st_size > MAX_DOCUMENT_BYTES:
            raise DataError(_too_long(f"input file '{path}' (one .txt file is one document)", path.stat().st_size))
        source = _inspect(path, check_utf8=FORMATS[path.suffix.lower()] != "parquet")
        if source.bad_utf8_offset is not None:
            if encoding_errors == "strict":
                raise DataError(
                    f"input file '{path}' is not valid UTF-8: invalid byte at offset {source.bad_utf8_offset}; "
                    "fix the file, or pass --encoding_errors replace to replace invalid bytes with U+FFFD"
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


def file_documents(source: SourceFile, text_field: str, encoding_errors: str = "strict") -> Iterator[str | None]:
    """The documents of one input file, read as a stream (a JSON-lines or Parquet file never whole).

    A ``.txt`` file is one document (read with universal newlines); each record of a ``.jsonl``/``.json``/
    ``.parquet`` file is one document, its ``text_field`` (None where a record lacks it).
    """
    errors = "replace" if source.bad_utf8_offset is not None and encoding_errors == "replace" else "strict"
    if source.format == "text":
        with open(source.path, encoding="utf-8", errors=errors) as f:
            yield f.read()
    elif source.format == "json":
        yield from _json_documents(source.path, text_field, errors)
    else:
        yield from _parquet_documents(source.path, text_field)


def _json_documents(path: Path, text_field: str, errors: str) -> Iterator[str | None]:
    with open(path, encoding="utf-8", errors=errors) as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array of records: there is no way to stream it, read it whole
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"could not read json input '{path}': {e}") from e
            lines: Iterator[tuple[int, object]] = enumerate(records, 1)
        else:
            lines = ((n, _json_line(line, path, n)) for n, line in enumerate(f, 1) if line.strip())
        for n, record in lines:
            yield _record_text(record, text_field, path, n)


def _json_line(line: str, path: Path, n: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"could not read json input '{path}': line {n} is not valid JSON ({e})") from e


def _too_long(what: str, size: int) -> str:
    return (f"{what} holds {size:,} bytes, more than the {MAX_DOCUMENT_BYTES:,} bytes (64 MiB) normlab tokenizes as "
            "one document; split it into smaller documents (files, or JSON-lines records)")


def checked_document(text: str | None, where: str) -> str | None:
    """``text``, or a DataError naming ``where`` when its UTF-8 form is longer than ``MAX_DOCUMENT_BYTES`` (encoded
    to count only when its length in characters leaves it in doubt: a character takes 1 to 4 bytes)."""
    if text is not None and 4 * len(text) > MAX_DOCUMENT_BYTES:
        size = len(text.encode("utf-8"))
        if size > MAX_DOCUMENT_BYTES:
            raise DataError(_too_long(where, size))
    return text


def _record_text(record: object, text_field: str, path: Path, n: int) -> str | None:
    if not isinstance(record, dict):
        raise DataError(f"json input '{path}': record {n} is not an object")
    value = record.get(text_field)
    if value is None and n == 1 and text_field not in record:
        raise DataError(
            f"json input(s) '{path}' have no field {text_field!r} (fields: {', '.join(record)}); "
            "pass --text_field with the name of the text field"
        )
    if value is not None and not isinstance(value, str):
        raise DataError(f"field {text_field!r} of json input '{path}' (record {n}) holds "
                        f"{type(value).__name__}, not text; pass --text_field")
    return checked_document(value, f"record {n} of json input '{path}'")


def _parquet_documents(path: Path, text_field: str, batch_rows: int = 1024) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"could not read parquet input '{path}': {e}") from e
    schema = reader.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"parquet input(s) '{path}' have no field {text_field!r} (fields: {', '.join(schema.names)}); "
            "pass --text_field with the name of the text field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"field {text_field!r} of parquet input '{path}' holds {kind}, not text; pass --text_field")
    n = 0
    for batch in reader.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            n += 1
            yield checked_document(text, f"record {n} of parquet input '{path}'")


def local_documents(sources: Sequence[SourceFile], text_field: str, encoding_errors: str) -> Iterator[str | None]:
    """Every document of the local inputs: text files first, then json records, then parquet records (the order
    normlab has always used, so prepared tokens stay the same)."""
    for fmt in ("text", "json", "parquet"):
        for source in sources:
            if source.format == fmt:
                yield from file_documents(source, text_field, encoding_errors)


def text_bytes_bound(sources: Sequence[SourceFile]) -> int:
    """An upper bound of the text bytes in the local inputs (their sizes), known without reading them."""
    return sum(s.size for s in sources)


def load_hub(name: str, config: str | None, split: str, text_field: str, streaming: bool = False):
    """Load a Hugging Face Hub dataset (``streaming``: an ``IterableDataset`` that downloads records as they are
    read); without network this fails within seconds instead of retrying."""
    import datasets  # here, not at the top: prepare's tokenizer workers import this module and need no `datasets`

    offline = datasets.config.HF_HUB_OFFLINE
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not hub_reachable(endpoint, HUB_PROBE_TIMEOUT):
        raise DataError(
            f"cannot reach {endpoint} to download --hf_dataset {name!r} (no network?). If it is already in "
            "your Hugging Face cache, set HF_DATASETS_OFFLINE=1 and rerun; otherwise download it where there "
            "is network, or pass local files with --input"
        )
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
        columns = ds.column_names if not streaming else list((ds.features or {}) or next(iter(ds), {}))
    except Exception as e:  # offline misses, unknown names, bad configs or splits all land here
        where = "in the local cache (offline mode)" if offline else "on the Hub"
        raise DataError(f"could not load --hf_dataset {name!r} (config {config}, split {split!r}) {where}: {e}") from e
    if text_field not in columns:
        raise DataError(
            f"records of {name!r} have no field {text_field!r} (fields: {', '.join(columns)}); "
            "pass --text_field with the name of the text field"
        )
    return ds.select_columns([text_field])


def hub_documents(ds, text_field: str, skip: int = 0, batch_rows: int = 1024) -> Iterator[str | None]:
    """The text of each record of a (streaming or not) Hub dataset, from record ``skip`` on."""
    if hasattr(ds, "__len__"):  # a downloaded `datasets.Dataset`; a streamed one has no length
        for first in range(skip, len(ds), batch_rows):
            for n, text in enumerate(ds[first:first + batch_rows][text_field], start=first + 1):
                yield checked_document(text, f"record {n} of the --hf_dataset")
        return
    for n, record in enumerate(ds.skip(skip) if skip else ds, start=skip + 1):
        value = record.get(text_field)
        if value is not None and not isinstance(value, str):
            raise DataError(f"field {text_field!r} of the --hf_dataset records holds {type(value).__name__}, not "
                            "text; pass --text_field")
        yield checked_document(value, f"record {n} of the --hf_dataset")


def hub_reachable(endpoint: str, timeout: float) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False
