"""The layout of a prepared directory and its ``meta.json``.

A prepared directory is self-contained::

    meta.json          written last; its presence marks the directory complete
    tokenizer.model    the sentencepiece model the tokens were made with (sha256 in meta.json)
    train.bin          flat token ids of the train split, documents separated by EOS (dtype in meta.json)
    val.bin            the same for the validation split
    train.idx, val.idx where each document starts in the split's tokens (int64 offsets, one per document)

``meta.json`` fields: ``format``, ``version``, ``fingerprint`` (hash of sources and settings), ``sources``,
``settings``, ``tokenizer_path``, ``tokenizer_sha256``, ``vocab_size``, ``dtype``, ``bos_id``, ``eos_id``,
``pad_id``, ``unk_id``, and ``splits.{train,val}.{file,index,tokens,documents,bytes}`` where ``bytes`` counts
the UTF-8 bytes of the split's text (for bits-per-byte). ``tokenizer_path`` is ``tokenizer.model``
(sentencepiece) or ``tokenizer.json`` (Hugging Face ``tokenizers``), ``tokenizer_kind`` says which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import write_text_atomic
from data.errors import DataError
from data.tokenizer import Tokenizer, open_tokenizer

FORMAT = "normlab-tokens"
VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"
SPLITS = ("train", "val")
IDX_DTYPE = np.dtype(np.int64)
# The largest vocabulary whose ids all fit in uint16, as the issue specifies.
UINT16_MAX_VOCAB = 65_535
# Token ids are checked against the vocabulary when a directory is opened: every id of a split up to this many
# tokens (a pass over the memory map: ~10 ms per 50 M cached tokens here), evenly spaced blocks of it beyond.
FULL_ID_CHECK_TOKENS = 1 << 30
_ID_CHECK_BLOCK = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when the vocabulary fits (≤ 65,535 pieces), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_MAX_VOCAB else np.uint32)


def split_file(split: str) -> str:
    return f"{split}.bin"


def index_file(split: str) -> str:
    return f"{split}.idx"


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    write_text_atomic(directory / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | Path) -> dict[str, Any] | None:
    """The parsed ``meta.json`` of ``directory``, or None if there is none."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"'{path}' is not valid JSON ({e}); re-run `normlab prepare` with --overwrite") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"'{path}' has format {meta.get('format')!r} version {meta.get('version')!r}, this normlab reads "
            f"{FORMAT!r} version {VERSION}; re-run `normlab prepare` with --overwrite"
        )
    return meta


def problems(directory: str | Path, meta: dict[str, Any]) -> list[str]:
    """Why ``directory`` does not match its ``meta.json`` (empty when it does)."""
    directory = Path(directory)
    found = []
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, info in meta["splits"].items():
        path = directory / info["file"]
        expected = info["tokens"] * itemsize
        if not path.is_file() or path.stat().st_size != expected:
            size = path.stat().st_size if path.is_file() else "missing"
            found.append(f"{path} should hold {expected} bytes ({split}), found {size}")
        else:
            found += _id_problems(path, open_tokens(directory, meta, split), meta["vocab_size"])
        index = info.get("index")
        if index is not None and not (directory / index).is_file():
            found.append(f"{directory / index} is missing ({split})")
        elif index is not None and (directory / index).stat().st_size != info["documents"] * IDX_DTYPE.itemsize:
            found.append(f"{directory / index} should hold {info['documents']} document starts ({split})")
        elif index is not None:
            found += _index_problems(directory / index, info["tokens"])
    if not (directory / meta["tokenizer_path"]).is_file():
        found.append(f"{directory / meta['tokenizer_path']} is missing")
    return found


def _id_problems(path: Path, tokens: np.ndarray, vocab_size: int) -> list[str]:
    """An id at or above the vocabulary (it has no embedding: an IndexError at the first step, a device-side assert
    on a GPU), found in every token or, past ``FULL_ID_CHECK_TOKENS``, in evenly spaced blocks."""
    n = len(tokens)
    if n <= FULL_ID_CHECK_TOKENS:
        blocks = range(0, n, 1 << 24)
        size = 1 << 24
    else:
        blocks = np.linspace(0, n - _ID_CHECK_BLOCK, FULL_ID_CHECK_TOKENS // _ID_CHECK_BLOCK, dtype=np.int64)
        size = _ID_CHECK_BLOCK
    for start in blocks:
        block = tokens[start:start + size]
        if block.size and int(block.max()) >= vocab_size:
            at = int(start) + int(np.argmax(block >= vocab_size))
            return [f"{path} holds token id {int(tokens[at])} at position {at}, outside the vocabulary of {vocab_size}"]
    return []


def _index_problems(path: Path, n_tokens: int) -> list[str]:
    """Document starts must rise from 0 and stay inside the split's tokens (every document holds at least its EOS)."""
    starts = np.fromfile(path, dtype=IDX_DTYPE)
    if starts.size and (starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= n_tokens):
        return [f"{path} holds document starts that do not rise from 0 within the {n_tokens} tokens"]
    return []


def open_tokens(directory: str | Path, meta: dict[str, Any], split: str) -> np.ndarray:
    """A read-only memory map of one split's tokens (an empty array for an empty split)."""
    info = meta["splits"][split]
    if info["tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(Path(directory) / info["file"], dtype=meta["dtype"], mode="r", shape=(info["tokens"],))


def document_starts(directory: str | Path, split: str = "train", meta: dict[str, Any] | None = None) -> np.ndarray:
    """Where each document of ``split`` starts, as int64 token offsets into its token file (ascending; document
    ``i`` spans ``[starts[i], starts[i + 1])``, the last one runs to the end; each ends with EOS).

    Read from ``<split>.idx``; directories prepared before the index existed are recovered from the EOS
    positions (one pass over the tokens).
    """
    meta = meta if meta is not None else read_meta(directory)
    if meta is None:
        raise DataError(f"no prepared data at '{directory}' (no {META_FILE})")
    info = meta["splits"][split]
    if info.get("index"):
        return np.fromfile(Path(directory) / info["index"], dtype=IDX_DTYPE)
    tokens = open_tokens(directory, meta, split)
    ends = np.flatnonzero(tokens == meta["eos_id"])
    return np.concatenate([[0], ends[:-1] + 1]).astype(IDX_DTYPE) if len(ends) else np.zeros(0, dtype=IDX_DTYPE)


def document_lengths(directory: str | Path, split: str = "train", meta: dict[str, Any] | None = None) -> np.ndarray:
    """Tokens of each document of ``split``, its EOS included (see :func:`document_starts`)."""
    meta = meta if meta is not None else read_meta(directory)
    starts = document_starts(directory, split, meta)
    return np.diff(np.append(starts, meta["splits"][split]["tokens"]))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Open a tokenizer file; inside a prepared directory, with the special ids its ``meta.json`` records (a
    ``tokenizer.json``'s EOS may have been given by flag when it was prepared)."""
    path = Path(path)
    meta = read_meta(path.parent) if path.is_file() and (path.parent / META_FILE).is_file() else None
    if meta is not None and meta.get("tokenizer_path") == path.name and meta.get("tokenizer_kind") == "tokenizers":
        ids = {"eos_id": meta["eos_id"], **({"bos_id": meta["bos_id"]} if meta["bos_id"] >= 0 else {})}
        return open_tokenizer(path, **ids)
    return open_tokenizer(path)
