"""Pack tokenized documents into one flat token file per split, appended in bounded memory.

Each document becomes its tokens followed by EOS (so documents are separated by EOS); empty documents are
dropped. ``<split>.idx`` records where each document starts (int64 token offsets into ``<split>.bin``, see
:func:`data.layout.document_starts`).

A document goes to the validation split when a keyed hash of its index in the input stream falls below
``val_fraction``: decided per document, without seeing the rest of the corpus, and independent of
``num_proc``. Two end-of-stream rules keep both splits usable: with two or more documents and a positive
fraction, a split that came out empty takes the other split's document nearest the threshold; and a corpus of a
single document (one ``.txt`` file) has nothing to split by, so its last ``val_fraction`` of tokens becomes the
validation split instead.

Tokenization runs in ``num_proc`` worker processes (each loads the tokenizer once) on batches of documents; at
most ``2 * num_proc`` batches are in flight, so memory does not grow with the corpus.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data import rng
from data.errors import DataError
from data.layout import IDX_DTYPE, SPLITS, index_file, split_file
from data.tokenizer import Tokenizer, open_tokenizer

logger = logging.getLogger(__name__)

# Fixed so the split does not change with the seed of a training run.
VAL_SPLIT_KEY = rng.derive_key(0x5EED, 0xDA7A)
# A batch of documents handed to one worker: large enough to amortize the hand-off, small enough that
# 2 * num_proc of them in flight stay a few MB.
BATCH_BYTES = 1 << 20
BATCH_DOCUMENTS = 1024


def val_scores(indices: np.ndarray) -> np.ndarray:
    """The keyed hash in [0, 1) of each document index; below ``val_fraction`` means validation."""
    return rng.unit_interval(np.asarray(indices, dtype=np.int64), VAL_SPLIT_KEY)


def batches(documents: Iterable[tuple[int, str | None]]) -> Iterator[list[tuple[int, str]]]:
    """Group ``(index, text)`` pairs into batches of about ``BATCH_BYTES``; empty documents are dropped."""
    batch: list[tuple[int, str]] = []
    size = 0
    for index, text in documents:
        if text:
            batch.append((index, text))
            size += len(text)
        if batch and (size >= BATCH_BYTES or len(batch) >= BATCH_DOCUMENTS):
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- parallel encoding -----------------------------------------------------------------------------------
_worker_tokenizer: Tokenizer | None = None  # one per worker process, loaded by its initializer


def _init_worker(path: str, bos_id: int | None, eos_id: int | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = open_tokenizer(path, bos_id=bos_id, eos_id=eos_id)


def _encode(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(texts)


def encode_batches(
    stream: Iterable[list[tuple[int, str]]], tokenizer: Tokenizer, spec: tuple[str, int | None, int | None],
    num_proc: int,
) -> Iterator[tuple[list[tuple[int, str]], list[list[int]]]]:
    """``(batch, token ids per document)`` in input order; ``spec`` = (path, bos, eos) reopens the tokenizer
    in each worker process."""
    if num_proc == 1:
        for batch in stream:
            yield batch, tokenizer.encode_batch([text for _, text in batch])
        return
    # spawn, not fork: the caller may hold threads (Lightning, torch) that a fork would copy mid-lock.
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=spec) as pool:
        pending: deque[tuple[list[tuple[int, str]], cf.Future]] = deque()
        for batch in stream:
            pending.append((batch, pool.submit(_encode, [text for _, text in batch])))
            if len(pending) >= 2 * num_proc:  # back-pressure: read no further ahead than this
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


# --- the split files -------------------------------------------------------------------------------------
@dataclass
class SplitCounts:
    tokens: int = 0
    documents: int = 0
    bytes: int = 0


@dataclass
class PackState:
    """Everything needed to continue appending after an interruption (saved as JSON in the staging dir)."""

    next_document: int = 0  # input documents consumed (empty ones included)
    counts: dict[str, SplitCounts] = field(default_factory=lambda: {s: SplitCounts() for s in SPLITS})
    # The train document with the lowest score and the val document with the highest: (score, ordinal).
    edge: dict[str, list[float] | None] = field(default_factory=lambda: {"train": None, "val": None})

    def to_json(self) -> dict[str, Any]:
        return {"next_document": self.next_document, "counts": {s: asdict(c) for s, c in self.counts.items()},
                "edge": self.edge}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PackState:
        return cls(next_document=raw["next_document"],
                   counts={s: SplitCounts(**c) for s, c in raw["counts"].items()}, edge=raw["edge"])

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.counts.values())


class SplitWriter:
    """Appends documents to ``<split>.bin`` and their starts to ``<split>.idx`` in ``directory``."""

    def __init__(self, directory: Path, dtype: np.dtype, eos_id: int, val_fraction: float, state: PackState) -> None:
        self.directory, self.dtype, self.eos_id, self.val_fraction = directory, dtype, eos_id, val_fraction
        self.state = state
        self._files = {}
        for split in SPLITS:
            counts = state.counts[split]
            for name, length in ((split_file(split), counts.tokens * dtype.itemsize),
                                 (index_file(split), counts.documents * IDX_DTYPE.itemsize)):
                path = directory / name
                path.touch()
                if path.stat().st_size < length:
                    raise DataError(f"--resume: '{path}' is shorter than its saved progress (the disk lost writes?); "
                                    "rerun without --resume to start over")
                with open(path, "r+b") as f:  # drop what was written after the last saved progress
                    f.truncate(length)
                self._files[name] = open(path, "ab")

    def write(self, batch: list[tuple[int, str]], ids: list[list[int]], max_tokens: int | None = None) -> bool:
        """Append one encoded batch (documents in input order); True once ``max_tokens`` tokens are written (the
        document that reaches it is the last one)."""
        scores = val_scores(np.array([index for index, _ in batch]))
        out: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        starts: dict[str, list[int]] = {s: [] for s in SPLITS}
        reached = False
        for (index, text), doc, score in zip(batch, ids, scores, strict=False):
            split = "val" if score < self.val_fraction else "train"
            counts = self.state.counts[split]
            self._track_edge(split, float(score), counts.documents)
            starts[split].append(counts.tokens)
            tokens = np.empty(len(doc) + 1, dtype=self.dtype)
            tokens[:-1], tokens[-1] = doc, self.eos_id
            out[split].append(tokens)
            counts.tokens += len(tokens)
            counts.documents += 1
            counts.bytes += len(text.encode("utf-8"))
            self.state.next_document = index + 1
            if max_tokens is not None and self.state.tokens >= max_tokens:
                reached = True
                break
        for split in SPLITS:
            if out[split]:
                self._files[split_file(split)].write(np.concatenate(out[split]).tobytes())
                self._files[index_file(split)].write(np.asarray(starts[split], dtype=IDX_DTYPE).tobytes())
        return reached

    def _track_edge(self, split: str, score: float, ordinal: int) -> None:
        edge = self.state.edge[split]
        if edge is None or (score < edge[0] if split == "train" else score > edge[0]):
            self.state.edge[split] = [score, ordinal]

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()


# --- end-of-stream rules ---------------------------------------------------------------------------------
def finish_splits(
    directory: Path, state: PackState, dtype: np.dtype, val_fraction: float, tokenizer: Tokenizer
) -> tuple[dict[str, dict[str, Any]], str]:
    """Apply the end-of-stream rules; return the splits for ``meta.json`` and how val was split off."""
    counts = state.counts
    documents = counts["train"].documents + counts["val"].documents
    split_by = "documents"
    if val_fraction > 0 and documents == 1:
        _split_tail(directory, counts, dtype, val_fraction, tokenizer)
        split_by = "tail"
    elif val_fraction > 0 and documents >= 2:
        for empty, other in (("val", "train"), ("train", "val")):
            if counts[empty].documents == 0:
                _move_document(directory, counts, dtype, int(state.edge[other][1]), other, empty, tokenizer)
    splits = {s: {"file": split_file(s), "index": index_file(s), **asdict(counts[s])} for s in SPLITS}
    return splits, split_by


def _move_document(
    directory: Path, counts: dict[str, SplitCounts], dtype: np.dtype, ordinal: int, source: str, target: str,
    tokenizer: Tokenizer,
) -> None:
    """Move document ``ordinal`` of split ``source`` into the empty split ``target`` (small corpora only)."""
    starts = np.fromfile(directory / index_file(source), dtype=IDX_DTYPE)
    tokens = np.fromfile(directory / split_file(source), dtype=dtype)
    begin = int(starts[ordinal])
    end = int(starts[ordinal + 1]) if ordinal + 1 < len(starts) else len(tokens)
    moved = tokens[begin:end]
    moved.tofile(directory / split_file(target))
    np.zeros(1, dtype=IDX_DTYPE).tofile(directory / index_file(target))
    np.concatenate([tokens[:begin], tokens[end:]]).tofile(directory / split_file(source))
    kept = np.concatenate([starts[:ordinal], starts[ordinal + 1:] - (end - begin)]).astype(IDX_DTYPE)
    kept.tofile(directory / index_file(source))
    nbytes = len(tokenizer.decode(moved[:-1].tolist()).encode("utf-8"))
    counts[target] = SplitCounts(tokens=len(moved), documents=1, bytes=nbytes)
    src = counts[source]
    counts[source] = SplitCounts(tokens=src.tokens - len(moved), documents=src.documents - 1,
                                 bytes=src.bytes - nbytes)


def _split_tail(
    directory: Path, counts: dict[str, SplitCounts], dtype: np.dtype, val_fraction: float, tokenizer: Tokenizer
) -> None:
    """Move the last ``val_fraction`` of a single document's tokens to the validation split."""
    source = "train" if counts["train"].documents else "val"
    if source == "val":  # the one document hashed into val: it becomes train, then gives up its tail
        for name in (split_file, index_file):
            shutil.move(directory / name("val"), directory / name("train"))
            (directory / name("val")).touch()
        counts["train"], counts["val"] = counts["val"], SplitCounts()
    train_path, val_path = directory / split_file("train"), directory / split_file("val")
    tokens = np.fromfile(train_path, dtype=dtype)
    cut = len(tokens) - math.ceil(len(tokens) * val_fraction)
    tail = tokens[cut:]
    tail.tofile(val_path)
    np.zeros(1, dtype=IDX_DTYPE).tofile(directory / index_file("val"))
    with open(train_path, "r+b") as f:
        f.truncate(cut * dtype.itemsize)
    # Bytes of the tail, for bits-per-byte: decode it (a character cut at the boundary counts as U+FFFD).
    tail_bytes = len(tokenizer.decode(tail[:-1].tolist()).encode("utf-8"))  # without the closing EOS
    total_bytes = counts["train"].bytes
    counts["val"] = SplitCounts(tokens=len(tail), documents=1, bytes=tail_bytes)
    counts["train"] = SplitCounts(tokens=cut, documents=1, bytes=total_bytes - tail_bytes)
    logger.info("single document: its last %d tokens form the validation split", len(tail))
