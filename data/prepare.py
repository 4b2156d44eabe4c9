"""``normlab prepare``: inputs -> sentencepiece tokenizer -> packed token files + ``meta.json``.

A fingerprint of the sources and settings makes a repeated prepare a no-op and protects an existing directory
built from something else (replaced only with ``--overwrite``); the output appears atomically
(``data.output_dir``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from data import meta as layout
from data import output_dir
from data.corpus import TEXT, inspect_files, load_documents, load_files, load_hub, resolve_inputs
from data.default_corpus import default_corpus_fingerprint, gather_default_corpus
from data.errors import DataError
from data.packing import document_bytes, text_batches, tokenize, write_splits
from data.tokenizer import NORMALIZATION_NOTE, TRAINER_VERSION, TokenizerInfo, describe_tokenizer, train_tokenizer

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

# Loads the checked sources into a `text` dataset, given a work directory for its cache files.
SourceLoader = Callable[[Path], datasets.Dataset]


def prepare(
    inputs: Sequence[str | Path] = (), *, output: str | Path, hf_dataset: str | None = None,
    hf_config: str | None = None, split: str = "train", text_field: str = TEXT, vocab_size: int | None = None,
    tokenizer: str | Path | None = None, val_fraction: float | None = None, num_proc: int = 1,
    overwrite: bool = False, encoding_errors: str = "strict",
) -> Path:
    """Prepare ``output`` from files/dirs/globs, a Hub dataset, or (neither given) the default corpus.

    ``val_fraction`` defaults to 1% of the documents, 5% for the (small) default corpus.
    """
    if val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION if inputs or hf_dataset else DEFAULT_CORPUS_VAL_FRACTION
    _check_settings(inputs, hf_dataset, hf_config, vocab_size, val_fraction, num_proc, encoding_errors)
    output = Path(output)
    given = describe_tokenizer(tokenizer) if tokenizer is not None else None
    if given is not None and vocab_size is not None and vocab_size != given.vocab_size:
        raise DataError(
            f"--vocab-size {vocab_size} contradicts --tokenizer '{tokenizer}' ({given.vocab_size} pieces); drop one"
        )
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE

    description, load = _open_sources(inputs, hf_dataset, hf_config, split, text_field, encoding_errors)
    tokenizer_setting = {"sha256": given.sha256} if given else {"vocab_size": vocab_size, "trainer": TRAINER_VERSION}
    settings = {"val_fraction": val_fraction, "tokenizer": tokenizer_setting}
    fingerprint = _digest({"version": layout.VERSION, "sources": description, "settings": settings})
    if output_dir.up_to_date(output, fingerprint, given.sha256 if given else None, overwrite):
        logger.info("%s is up to date (fingerprint %s)", output, fingerprint[:12])
        return output
    settings.update(text_field=text_field, encoding_errors=encoding_errors)
    with output_dir.staging(output) as stage:
        _build(stage, load, tokenizer, vocab_size, val_fraction, num_proc, fingerprint, description, settings)
        output_dir.publish(stage, output, fingerprint)
    return output


def _open_sources(
    inputs: Sequence[str | Path], hf_dataset: str | None, hf_config: str | None, split: str, text_field: str,
    encoding_errors: str,
) -> tuple[dict[str, Any], SourceLoader]:
    """Check the sources and describe them for the fingerprint; loading (given a work dir) comes later."""
    if inputs:
        files = inspect_files(resolve_inputs(inputs), encoding_errors)
        description = {"kind": "files", "files": [f.describe() for f in files], "text_field": text_field,
                       "encoding_errors": encoding_errors}
        return description, lambda work: load_files(files, text_field, work)
    if hf_dataset:
        hub = load_hub(hf_dataset, hf_config, split, text_field)
        # `_fingerprint` is how `datasets` itself identifies a dataset's content (from its cache files).
        description = {"kind": "hf", "name": hf_dataset, "config": hf_config, "split": split,
                       "text_field": text_field, "dataset_fingerprint": hub._fingerprint}
        return description, lambda work: hub
    # The default corpus is described by what it is gathered from, so checking it costs no gathering.
    return default_corpus_fingerprint(), lambda work: load_documents(gather_default_corpus(), work)


def _build(
    stage: Path, load: SourceLoader, tokenizer: str | Path | None, vocab_size: int, val_fraction: float,
    num_proc: int, fingerprint: str, sources: dict[str, Any], settings: dict[str, Any],
) -> None:
    """Fill ``stage`` with the tokenizer, the token files and (last) ``meta.json``."""
    work = stage / "_work"
    ds = load(work)
    doc_bytes = document_bytes(ds)
    if doc_bytes.sum() == 0:
        raise DataError(f"the inputs hold no text ({len(doc_bytes)} empty documents)")
    tokenizer_path = stage / layout.TOKENIZER_FILE
    info = _install_tokenizer(tokenizer, tokenizer_path, ds, doc_bytes, vocab_size, num_proc)
    dtype = layout.token_dtype(info.vocab_size)
    tokens = tokenize(ds, tokenizer_path, info.eos_id, dtype, num_proc, work, fingerprint)
    splits, split_by = write_splits(tokens, doc_bytes, val_fraction, stage, dtype, tokenizer_path)
    del tokens, ds  # drop the memory maps of the work files before deleting them
    shutil.rmtree(work, ignore_errors=True)
    settings = {**settings, "val_split": split_by}
    layout.write_meta(stage, _meta(fingerprint, sources, settings, info, dtype, splits, tokenizer))


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
    val_fraction: float, num_proc: int, encoding_errors: str,
) -> None:
    if inputs and hf_dataset:
        raise DataError("give either --input or --hf-dataset, not both")
    if hf_config and not hf_dataset:
        raise DataError("--hf-config needs --hf-dataset")
    if vocab_size is not None and vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: byte fallback alone takes 256 pieces and the special "
            f"pieces 4 more; use at least {MIN_VOCAB_SIZE} (more for text with many distinct characters)"
        )
    if not 0 <= val_fraction <= 0.5:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 0.5")
    if num_proc < 1:
        raise DataError(f"--num-proc {num_proc} must be at least 1")
    if encoding_errors not in ENCODING_ERRORS:
        raise DataError(f"--encoding-errors {encoding_errors!r} must be one of {', '.join(ENCODING_ERRORS)}")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _install_tokenizer(
    given: str | Path | None, path: Path, ds: datasets.Dataset, doc_bytes: np.ndarray, vocab_size: int, num_proc: int
) -> TokenizerInfo:
    """Copy the given model into the prepared directory, or train one there."""
    if given is not None:
        shutil.copyfile(given, path)
        return describe_tokenizer(path)
    return train_tokenizer(_training_lines(ds, doc_bytes), vocab_size, path, num_threads=num_proc)


def _training_lines(ds: datasets.Dataset, doc_bytes: np.ndarray) -> Iterator[str]:
    """Non-empty lines of every k-th document, k chosen to keep the trainer's input under its byte cap."""
    stride = max(1, math.ceil(int(doc_bytes.sum()) / MAX_TOKENIZER_TRAIN_BYTES))
    fed, row = 0, 0
    for texts in text_batches(ds):
        for text in texts.to_pylist():
            if row % stride == 0 and text:
                for line in text.splitlines():
                    if line.strip():
                        yield line
                fed += len(text)
            row += 1
            if fed >= MAX_TOKENIZER_TRAIN_BYTES:
                return


def _meta(
    fingerprint: str, sources: dict[str, Any], settings: dict[str, Any], info: TokenizerInfo, dtype: np.dtype,
    splits: dict[str, dict[str, Any]], tokenizer_source: str | Path | None,
) -> dict[str, Any]:
    return {
        "format": layout.FORMAT, "version": layout.VERSION, "fingerprint": fingerprint,
        "created_by": f"normlab {_normlab_version()}", "sources": sources, "settings": settings,
        "tokenizer_path": layout.TOKENIZER_FILE, "tokenizer_sha256": info.sha256,
        "tokenizer_source": str(Path(tokenizer_source).resolve()) if tokenizer_source else "trained",
        "tokenizer_normalization": NORMALIZATION_NOTE, "vocab_size": info.vocab_size, "dtype": dtype.name,
        "unk_id": info.unk_id, "bos_id": info.bos_id, "eos_id": info.eos_id, "pad_id": info.pad_id,
        "splits": splits,
    }


def _normlab_version() -> str:
    try:
        return importlib.metadata.version("normlab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normlab prepare",
        description="Tokenize a corpus into memory-mapped token files. With no --input or --hf-dataset, "
        "builds the default corpus (English prose from the installed Python's documentation).",
    )
    add = parser.add_argument
    add("--input", nargs="+", action="extend", default=[], metavar="PATH",
        help="files, directories (searched recursively) or globs of *.txt, *.jsonl, *.json, *.parquet")
    add("--hf-dataset", metavar="NAME", help="a Hugging Face Hub dataset (needs network or a cached copy)")
    add("--hf-config", metavar="C", help="configuration of --hf-dataset")
    add("--split", default="train", help="split of --hf-dataset (default: train)")
    add("--text-field", default=TEXT, metavar="F", help="text field of json/parquet/Hub records (default: text)")
    add("--output", metavar="DIR", help=f"output directory (default without inputs: {DEFAULT_OUTPUT})")
    add("--vocab-size", type=int, metavar="N", help=f"train a tokenizer of N pieces (default: {DEFAULT_VOCAB_SIZE})")
    add("--tokenizer", metavar="FILE.model", help="use this sentencepiece model instead of training one")
    add("--val-fraction", type=float, metavar="F",
        help=f"fraction of documents for validation (default: {DEFAULT_VAL_FRACTION}; "
        f"{DEFAULT_CORPUS_VAL_FRACTION} for the default corpus)")
    add("--num-proc", type=int, default=1, metavar="N", help="tokenizer processes (default: 1)")
    add("--overwrite", action="store_true", help="replace an output built from other sources or settings")
    add("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
        help="invalid UTF-8: fail (strict, default) or replace bad bytes with U+FFFD")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    has_inputs = bool(args.input or args.hf_dataset)
    if args.output is None and has_inputs:
        parser.error("--output is required with --input or --hf-dataset")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        output = prepare(
            args.input, output=args.output or DEFAULT_OUTPUT, hf_dataset=args.hf_dataset, hf_config=args.hf_config,
            split=args.split, text_field=args.text_field, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
            val_fraction=args.val_fraction, num_proc=args.num_proc, overwrite=args.overwrite,
            encoding_errors=args.encoding_errors,
        )
    except DataError as e:
        print(f"normlab prepare: error: {e}", file=sys.stderr)
        return 1
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
