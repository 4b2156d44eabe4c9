"""``normlab prepare``: inputs -> tokenizer -> packed token files + ``meta.json``, streamed in bounded memory.

Documents are read as a stream (file by file, record batch by record batch, or record by record from a
streamed Hub dataset), tokenized in ``num_proc`` worker processes and appended to the split files, so memory
does not grow with the corpus (``data.packing``). A fingerprint of the sources and settings makes a repeated
prepare a no-op and protects an existing directory built from something else (replaced only with
``--overwrite``); the output appears atomically, and an interrupted prepare continues with ``--resume``
(``data.output_dir``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import itertools
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data import layout, output_dir
from data.corpus import (
    TEXT,
    hub_documents,
    inspect_files,
    load_hub,
    local_documents,
    resolve_inputs,
    text_bytes_bound,
)
from data.default_corpus import default_corpus_fingerprint, gather_default_corpus
from data.errors import DataError
from data.packing import PackState, SplitWriter, batches, encode_batches, finish_splits
from data.tokenizer import (
    HF_TOKENIZER_FILE,
    MAX_TRAINING_LINE_BYTES,
    NORMALIZATION_NOTE,
    TOKENIZER_MODEL,
    TRAINER_VERSION,
    Tokenizer,
    open_tokenizer,
    reopen_args,
    train_tokenizer,
)

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = "data_cache/default"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.01
# The default corpus is small (~6 MB); 5% gives the default job enough distinct validation windows.
DEFAULT_CORPUS_VAL_FRACTION = 0.05
ENCODING_ERRORS = ("strict", "replace")
# 256 byte-fallback pieces + 4 special pieces; the corpus' own characters come on top.
MIN_VOCAB_SIZE = 261
# sentencepiece needs ~20x its input in RAM; beyond this, train on an evenly strided subset of documents.
MAX_TOKENIZER_TRAIN_BYTES = 100_000_000
# How often the progress of a long prepare is saved (for --resume) and logged.
PROGRESS_SECONDS = 10.0


@dataclass
class Source:
    """Where the documents come from: a description for the fingerprint, and a reader from any document on."""

    description: dict[str, Any]
    documents: Callable[[int], Iterator[str | None]]  # documents from index n on
    size_hint: int | None  # text bytes (an upper bound), to stride the tokenizer's sample; None: unknown


def prepare(
    inputs: Sequence[str | Path] = (), *, output: str | Path, hf_dataset: str | None = None,
    hf_config: str | None = None, split: str = "train", text_field: str = TEXT, vocab_size: int | None = None,
    tokenizer: str | Path | None = None, val_fraction: float | None = None, num_proc: int = 1,
    overwrite: bool = False, encoding_errors: str = "strict", streaming: bool = False,
    max_tokens: int | None = None, resume: bool = False, bos_id: int | None = None, eos_id: int | None = None,
) -> Path:
    """Prepare ``output`` from files/dirs/globs, a Hub dataset, or (neither given) the default corpus.

    ``val_fraction`` defaults to 1% of the documents, 5% for the (small) default corpus. ``tokenizer`` is a
    sentencepiece ``.model``, a Hugging Face ``tokenizer.json`` or a directory holding one (``bos_id``/``eos_id``
    override what a ``tokenizer.json`` names); without it a sentencepiece model is trained.
    """
    if val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION if inputs or hf_dataset else DEFAULT_CORPUS_VAL_FRACTION
    _check_settings(inputs, hf_dataset, hf_config, vocab_size, val_fraction, num_proc, encoding_errors, streaming,
                    max_tokens)
    output = Path(output)
    given = open_tokenizer(tokenizer, bos_id=bos_id, eos_id=eos_id) if tokenizer is not None else None
    if given is not None and vocab_size is not None and vocab_size != given.vocab_size:
        raise DataError(
            f"--vocab_size {vocab_size} contradicts --tokenizer '{tokenizer}' ({given.vocab_size} pieces); drop one"
        )
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE

    source = _open_source(inputs, hf_dataset, hf_config, split, text_field, encoding_errors, streaming)
    tokenizer_setting = ({"sha256": given.sha256, **_special_overrides(bos_id, eos_id)} if given
                         else {"vocab_size": vocab_size, "trainer": TRAINER_VERSION})
    settings: dict[str, Any] = {"val_fraction": val_fraction, "tokenizer": tokenizer_setting}
    if max_tokens is not None:
        settings["max_tokens"] = max_tokens
    fingerprint = _digest({"version": layout.VERSION, "sources": source.description, "settings": settings})
    if output_dir.up_to_date(output, fingerprint, given.sha256 if given else None, overwrite):
        logger.info("%s is up to date (fingerprint %s)", output, fingerprint[:12])
        return output
    settings.update(text_field=text_field, encoding_errors=encoding_errors)
    with output_dir.staging(output, resume=resume) as stage:
        _build(stage, source, given, vocab_size, val_fraction, num_proc, max_tokens, fingerprint, settings)
        output_dir.publish(stage, output, fingerprint)
    return output


def _open_source(
    inputs: Sequence[str | Path], hf_dataset: str | None, hf_config: str | None, split: str, text_field: str,
    encoding_errors: str, streaming: bool,
) -> Source:
    """Check the sources and describe them for the fingerprint; reading comes later."""
    if inputs:
        files = inspect_files(resolve_inputs(inputs), encoding_errors)
        description = {"kind": "files", "files": [f.describe() for f in files], "text_field": text_field,
                       "encoding_errors": encoding_errors}
        return Source(description, lambda skip: itertools.islice(
            local_documents(files, text_field, encoding_errors), skip, None), text_bytes_bound(files))
    if hf_dataset:
        hub = load_hub(hf_dataset, hf_config, split, text_field, streaming=streaming)
        description = {"kind": "hf", "name": hf_dataset, "config": hf_config, "split": split, "text_field": text_field}
        if streaming:  # nothing is downloaded ahead, so there is no content hash: name, config and split it is
            description["streaming"] = True
        else:  # `_fingerprint` is how `datasets` itself identifies a dataset's content (from its cache files)
            description["dataset_fingerprint"] = hub._fingerprint
        return Source(description, lambda skip: hub_documents(hub, text_field, skip),
                      None if streaming else int(hub.info.dataset_size or 0) or None)
    # The default corpus is described by what it is gathered from, so checking it costs no gathering.
    documents: list[str] = []

    def default(skip: int) -> Iterator[str | None]:
        if not documents:
            documents.extend(gather_default_corpus())
        return iter(documents[skip:])

    return Source(default_corpus_fingerprint(), default, None)


def _build(
    stage: Path, source: Source, given: Tokenizer | None, vocab_size: int, val_fraction: float, num_proc: int,
    max_tokens: int | None, fingerprint: str, settings: dict[str, Any],
) -> None:
    """Fill ``stage`` with the tokenizer, the token files and (last) ``meta.json``; continue saved progress."""
    progress = output_dir.read_progress(stage, fingerprint)
    if progress is None:
        name = HF_TOKENIZER_FILE if given is not None and given.kind == "tokenizers" else TOKENIZER_MODEL
        if given is not None:
            shutil.copyfile(given.path, stage / name)
        else:
            _train_tokenizer(source, vocab_size, stage / name, num_proc)
        progress = {"fingerprint": fingerprint, "tokenizer": name, "pack": PackState().to_json()}
        output_dir.save_progress(stage, progress)
    path = stage / progress["tokenizer"]
    tokenizer = open_tokenizer(path, **(reopen_args(given) if given else {}))
    state = PackState.from_json(progress["pack"])
    if state.next_document:
        logger.info("resuming after %d documents (%d tokens)", state.next_document, state.tokens)
    dtype = layout.token_dtype(tokenizer.vocab_size)
    _pack(stage, source, tokenizer, dtype, val_fraction, num_proc, max_tokens, state, progress)
    splits, split_by = finish_splits(stage, state, dtype, val_fraction, tokenizer)
    if splits["train"]["documents"] + splits["val"]["documents"] == 0:
        raise DataError(f"the inputs hold no text ({state.next_document} empty documents)")
    settings = {**settings, "val_split": split_by}
    (stage / output_dir.PROGRESS_FILE).unlink()
    layout.write_meta(stage, _meta(fingerprint, source.description, settings, tokenizer, dtype, splits, given))


def _pack(
    stage: Path, source: Source, tokenizer: Tokenizer, dtype: np.dtype, val_fraction: float, num_proc: int,
    max_tokens: int | None, state: PackState, progress: dict[str, Any],
) -> None:
    """Tokenize the documents from ``state.next_document`` on and append them, saving progress now and then."""
    writer = SplitWriter(stage, dtype, tokenizer.eos_id, val_fraction, state)
    special = reopen_args(tokenizer)
    spec = (str(tokenizer.path), special.get("bos_id"), special.get("eos_id"))
    documents = enumerate(source.documents(state.next_document), start=state.next_document)
    start, saved, done_bytes = time.perf_counter(), time.perf_counter(), 0
    try:
        for batch, ids in encode_batches(batches(documents), tokenizer, spec, num_proc):
            reached = writer.write(batch, ids, max_tokens)
            done_bytes += sum(len(text) for _, text in batch)
            if reached:
                logger.info("stopping at %d tokens (--max_tokens %d)", state.tokens, max_tokens)
                break
            if time.perf_counter() - saved > PROGRESS_SECONDS:
                writer.flush()
                progress["pack"] = state.to_json()
                output_dir.save_progress(stage, progress)
                saved = time.perf_counter()
                logger.info("%d documents, %d tokens, %.2f MB/s", state.next_document, state.tokens,
                            done_bytes / 1e6 / (saved - start))
    finally:
        writer.close()


def _special_overrides(bos_id: int | None, eos_id: int | None) -> dict[str, int]:
    return {k: v for k, v in (("bos_id", bos_id), ("eos_id", eos_id)) if v is not None}


def ensure_default_corpus(output_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Make sure ``output_dir`` holds the current default corpus; return at once if it already does.

    An outdated default corpus there (other installed versions) is rebuilt; a corpus prepared from other
    sources is never replaced.
    """
    output_dir = Path(output_dir)
    existing = layout.read_meta(output_dir) if output_dir.is_dir() else None
    if existing is not None and existing["sources"].get("kind") != "default":
        raise DataError(
            f"'{output_dir}' holds a corpus prepared from other sources, not the default corpus; pass its path "
            "as the data path, or move it away to let normlab build the default corpus there"
        )
    return prepare(output=output_dir, vocab_size=vocab_size, overwrite=existing is not None)


def _check_settings(
    inputs: Sequence[str | Path], hf_dataset: str | None, hf_config: str | None, vocab_size: int | None,
    val_fraction: float, num_proc: int, encoding_errors: str, streaming: bool, max_tokens: int | None,
) -> None:
    if inputs and hf_dataset:
        raise DataError("give either --input or --hf_dataset, not both")
    if hf_config and not hf_dataset:
        raise DataError("--hf_config needs --hf_dataset")
    if vocab_size is not None and vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab_size {vocab_size} is too small: byte fallback alone takes 256 pieces and the special "
            f"pieces 4 more; use at least {MIN_VOCAB_SIZE} (more for text with many distinct characters)"
        )
    if not 0 <= val_fraction <= 0.5:
        raise DataError(f"--val_fraction {val_fraction} must be between 0 and 0.5")
    if num_proc < 1:
        raise DataError(f"--num_proc {num_proc} must be at least 1")
    if streaming and not hf_dataset:
        raise DataError("--streaming applies to --hf_dataset (local inputs are always read as a stream)")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"--max_tokens {max_tokens} must be at least 1")
    if encoding_errors not in ENCODING_ERRORS:
        raise DataError(f"--encoding_errors {encoding_errors!r} must be one of {', '.join(ENCODING_ERRORS)}")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _train_tokenizer(source: Source, vocab_size: int, output: Path, num_proc: int) -> None:
    """Train the tokenizer on ``_training_lines``, naming the lines sentencepiece cannot take (it would drop them
    without a word, and a corpus of only such lines failed with an empty reason)."""
    long_lines: list[int] = []
    try:
        train_tokenizer(_training_lines(source, long_lines), vocab_size, output, num_threads=num_proc)
    except DataError as e:
        if long_lines:
            raise DataError(f"{e} ({_left_out(long_lines)})") from e
        raise
    if long_lines:
        logger.warning("the tokenizer was trained without %s", _left_out(long_lines).removesuffix(" out"))


def _left_out(long_lines: list[int]) -> str:
    return (f"{len(long_lines):,} line(s) longer than sentencepiece's {MAX_TRAINING_LINE_BYTES:,}-byte bound on a "
            f"training line, the longest {max(long_lines):,} bytes, were left out")


def _training_lines(source: Source, long_lines: list[int]) -> Iterator[str]:
    """Non-empty lines of every k-th document, k chosen to keep the trainer's input under its byte cap (a source
    of unknown size gives its first ``MAX_TOKENIZER_TRAIN_BYTES``). Lines over sentencepiece's bound are not fed
    (it drops them itself); their byte lengths go to ``long_lines``."""
    stride = max(1, math.ceil((source.size_hint or 0) / MAX_TOKENIZER_TRAIN_BYTES))
    fed = 0
    for row, text in enumerate(source.documents(0)):
        if row % stride == 0 and text:
            for line in text.splitlines():
                if not line.strip():
                    continue
                size = len(line) if len(line) * 4 <= MAX_TRAINING_LINE_BYTES else len(line.encode("utf-8"))
                if size > MAX_TRAINING_LINE_BYTES:
                    long_lines.append(size)
                else:
                    yield line
            fed += len(text)
        if fed >= MAX_TOKENIZER_TRAIN_BYTES:
            return


def _meta(
    fingerprint: str, sources: dict[str, Any], settings: dict[str, Any], tokenizer: Tokenizer, dtype: np.dtype,
    splits: dict[str, dict[str, Any]], given: Tokenizer | None,
) -> dict[str, Any]:
    return {
        "format": layout.FORMAT, "version": layout.VERSION, "fingerprint": fingerprint,
        "created_by": f"normlab {_normlab_version()}", "sources": sources, "settings": settings,
        "tokenizer_path": tokenizer.path.name, "tokenizer_kind": tokenizer.kind, "tokenizer_sha256": tokenizer.sha256,
        "tokenizer_source": str(given.path.resolve()) if given else "trained",
        "tokenizer_normalization": NORMALIZATION_NOTE if tokenizer.kind == "sentencepiece" else "as the tokenizer's",
        "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "unk_id": tokenizer.unk_id,
        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id, "splits": splits,
    }


def _normlab_version() -> str:
    try:
        return importlib.metadata.version("normlab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normlab prepare",
        description="Tokenize a corpus into memory-mapped token files. With no --input or --hf_dataset, "
        "builds the default corpus (English prose from the installed Python's documentation).",
    )
    add = parser.add_argument
    add("--input", nargs="+", action="extend", default=[], metavar="PATH",
        help="files, directories (searched recursively) or globs of *.txt, *.jsonl, *.json, *.parquet")
    add("--hf_dataset", metavar="NAME", help="a Hugging Face Hub dataset (needs network or a cached copy)")
    add("--hf_config", metavar="C", help="configuration of --hf_dataset")
    add("--split", default="train", help="split of --hf_dataset (default: train)")
    add("--text_field", default=TEXT, metavar="F", help="text field of json/parquet/Hub records (default: text)")
    add("--output", metavar="DIR", help=f"output directory (default without inputs: {DEFAULT_OUTPUT})")
    add("--vocab_size", type=int, metavar="N", help=f"train a tokenizer of N pieces (default: {DEFAULT_VOCAB_SIZE})")
    add("--tokenizer", metavar="PATH",
        help="use this tokenizer instead of training one: a sentencepiece .model, a Hugging Face tokenizer.json, "
        "or a directory holding one")
    add("--bos_id", type=int, metavar="ID", help="BOS id of a tokenizer.json (default: from tokenizer_config.json "
        "or a known token name)")
    add("--eos_id", type=int, metavar="ID", help="EOS id (the document separator) of a tokenizer.json (default: "
        "from tokenizer_config.json or a known token name such as <|endoftext|>)")
    add("--val_fraction", type=float, metavar="F",
        help=f"fraction of documents for validation (default: {DEFAULT_VAL_FRACTION}; "
        f"{DEFAULT_CORPUS_VAL_FRACTION} for the default corpus)")
    add("--num_proc", type=int, default=1, metavar="N", help="tokenizer processes (default: 1)")
    add("--streaming", action="store_true", help="read --hf_dataset record by record as it downloads (no full copy)")
    add("--max_tokens", type=int, metavar="N", help="stop at the first document boundary at or after N tokens")
    add("--resume", action="store_true", help="continue an interrupted prepare of the same sources and settings")
    add("--overwrite", action="store_true", help="replace an output built from other sources or settings")
    add("--encoding_errors", choices=ENCODING_ERRORS, default="strict",
        help="invalid UTF-8: fail (strict, default) or replace bad bytes with U+FFFD")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    has_inputs = bool(args.input or args.hf_dataset)
    if args.output is None and has_inputs:
        parser.error("--output is required with --input or --hf_dataset")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        output = prepare(
            args.input, output=args.output or DEFAULT_OUTPUT, hf_dataset=args.hf_dataset, hf_config=args.hf_config,
            split=args.split, text_field=args.text_field, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
            val_fraction=args.val_fraction, num_proc=args.num_proc, overwrite=args.overwrite,
            encoding_errors=args.encoding_errors, streaming=args.streaming, max_tokens=args.max_tokens,
            resume=args.resume, bos_id=args.bos_id, eos_id=args.eos_id,
        )
    except DataError as e:
        print(f"normlab prepare: error: {e}", file=sys.stderr)
        return 2  # bad input, as every normlab command (and argparse) reports it
    _print_summary(output, time.perf_counter() - start)
    return 0


def _print_summary(output: Path, seconds: float) -> None:
    meta = layout.read_meta(output)
    assert meta is not None
    print(f"{output}: vocab {meta['vocab_size']} ({meta['dtype']}), {seconds:.1f} s")
    for name, split in meta["splits"].items():
        print(f"  {name}: {split['tokens']:,} tokens, {split['documents']:,} documents, {split['bytes']:,} bytes")


if __name__ == "__main__":
    sys.exit(main())
