"""Tokenize documents with ``datasets.map`` and pack them into one flat token file per split.

Each document becomes its tokens followed by EOS (so documents are separated by EOS); empty documents are
dropped. Documents are assigned to the validation split by a keyed hash of their index, so the split is
deterministic and independent of ``num_proc``. A corpus of a single document (one ``.txt`` file) has nothing
to split by, so its last ``val_fraction`` of tokens becomes the validation split instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data import rng
from data.corpus import TEXT
from data.meta import SPLITS, split_file
from data.tokenizer import load_processor

logger = logging.getLogger(__name__)

IDS = "ids"
# Fixed so the split does not change with the seed of a training run.
VAL_SPLIT_KEY = rng.derive_key(0x5EED, 0xDA7A)


class Encoder:
    """Batched ``datasets.map`` function: text -> token ids + EOS. Picklable for ``num_proc > 1``."""

    def __init__(self, tokenizer_path: str, eos_id: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.eos_id = eos_id
        self._sp = None

    def __getstate__(self) -> dict[str, Any]:
        # Each worker loads its own processor; the C++ object does not pickle.
        return {**self.__dict__, "_sp": None}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._sp is None:
            self._sp = load_processor(self.tokenizer_path)
        # One thread per worker: parallelism comes from num_proc, and threads on top would oversubscribe.
        ids = self._sp.encode([text or "" for text in batch[TEXT]], num_threads=1)
        for doc in ids:
            doc.append(self.eos_id)
        return {IDS: ids}


def tokenize(
    ds: datasets.Dataset, tokenizer_path: Path, eos_id: int, dtype: np.dtype, num_proc: int, work_dir: Path,
    fingerprint: str,
) -> datasets.Dataset:
    """Token ids per document, in document order, cached under ``work_dir``."""
    features = datasets.Features({IDS: datasets.List(datasets.Value(dtype.name))})
    return ds.map(
        Encoder(str(tokenizer_path), eos_id), batched=True, num_proc=num_proc if num_proc > 1 else None,
        remove_columns=[TEXT], features=features, cache_file_name=str(work_dir / "tokens.arrow"),
        # datasets caps fingerprints at 64 characters including its "_00000_of_00002" shard suffix.
        load_from_cache_file=False, new_fingerprint=fingerprint[:32], desc="tokenize",
    )


def text_batches(ds: datasets.Dataset, batch_size: int = 10_000) -> Iterator[pa.ChunkedArray]:
    """The ``text`` column in Arrow batches (respecting any row selection the dataset carries)."""
    for table in ds.with_format("arrow").iter(batch_size=batch_size):
        yield table.column(TEXT)


def document_bytes(ds: datasets.Dataset) -> np.ndarray:
    """UTF-8 length of each document (0 for empty or missing text)."""
    lengths = [pc.binary_length(texts).fill_null(0).to_numpy() for texts in text_batches(ds)]
    return np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, dtype=np.int64)


def val_mask(doc_bytes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents go to the validation split: a keyed hash of the index below ``val_fraction``.

    With two or more documents and a positive fraction, both splits get at least one document.
    """
    mask = np.zeros(len(doc_bytes), dtype=bool)
    docs = np.flatnonzero(doc_bytes > 0)
    if val_fraction <= 0 or len(docs) < 2:
        return mask
    u = rng.unit_interval(docs, VAL_SPLIT_KEY)
    chosen = u < val_fraction
    if not chosen.any():
        chosen[np.argmin(u)] = True
    if chosen.all():
        chosen[np.argmax(u)] = False
    mask[docs[chosen]] = True
    return mask


def write_splits(
    tokens: datasets.Dataset, doc_bytes: np.ndarray, val_fraction: float, out_dir: Path, dtype: np.dtype,
    tokenizer_path: Path,
) -> tuple[dict[str, dict[str, Any]], str]:
    """Write ``train.bin`` / ``val.bin``; return their counts for ``meta.json`` and how val was split off."""
    is_val = val_mask(doc_bytes, val_fraction)
    masks = {"train": (doc_bytes > 0) & ~is_val, "val": is_val}
    splits = {
        s: {"file": split_file(s), "tokens": 0, "documents": int(m.sum()), "bytes": int(doc_bytes[m].sum())}
        for s, m in masks.items()
    }
    handles = {s: open(out_dir / split_file(s), "wb") for s in SPLITS}
    try:
        row = 0
        for batch in tokens.data.to_batches():
            for split in SPLITS:
                selected = masks[split][row : row + batch.num_rows]
                splits[split]["tokens"] += _write_tokens(batch.column(IDS), selected, dtype, handles[split])
            row += batch.num_rows
    finally:
        for handle in handles.values():
            handle.close()
    if val_fraction > 0 and splits["train"]["documents"] == 1:
        _split_tail(splits, out_dir, dtype, val_fraction, tokenizer_path)
        return splits, "tail"
    return splits, "documents"


def _write_tokens(ids: pa.Array, selected: np.ndarray, dtype: np.dtype, handle: BinaryIO) -> int:
    if not selected.any():
        return 0
    flat = pc.filter(ids, pa.array(selected)).flatten().to_numpy(zero_copy_only=False)
    handle.write(flat.astype(dtype, copy=False).tobytes())
    return len(flat)


def _split_tail(
    splits: dict[str, dict[str, Any]], out_dir: Path, dtype: np.dtype, val_fraction: float, tokenizer_path: Path
) -> None:
    """Move the last ``val_fraction`` of a single document's tokens to the validation split."""
    train_path, val_path = out_dir / split_file("train"), out_dir / split_file("val")
    tokens = np.fromfile(train_path, dtype=dtype)
    cut = len(tokens) - math.ceil(len(tokens) * val_fraction)
    tail = tokens[cut:]
    tail.tofile(val_path)
    with open(train_path, "r+b") as f:
        f.truncate(cut * dtype.itemsize)
    # Bytes of the tail, for bits-per-byte: decode it (a character cut at the boundary counts as U+FFFD).
    tail_bytes = len(load_processor(tokenizer_path).decode(tail.tolist()).encode("utf-8"))
    total_bytes = splits["train"]["bytes"]
    splits["val"].update(tokens=len(tail), documents=1, bytes=tail_bytes)
    splits["train"].update(tokens=cut, bytes=total_bytes - tail_bytes)
    logger.info("single document: its last %d tokens form the validation split", len(tail))
