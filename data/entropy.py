"""The unigram entropy of a prepared directory's training tokens: the loss (nats per token) of a model that has
learned only how often each token occurs, and nothing of its context.

A run whose final loss is still near it has learned the token frequencies and no more (the plateau rule:
`training.stats.on_plateau`), so the study and the sweeps need it for every dataset they train on. It is one
pass of `np.bincount` over the memory-mapped train split; the counts are cached beside the split
(`COUNTS_FILE`, keyed by the split's size and modification time) so a large directory is counted once. A
mixture's entropy is that of the weighted mixture of its sources' unigram distributions — the distribution its
batches are drawn from.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data import layout
from data.atomic import write_text_atomic

ENTROPY_TAG = "data/unigram_entropy"  # the scalar a run logs it as (training/callbacks/summary.py)
COUNTS_FILE = "unigram_counts.json"  # the cache: the train split's token counts and what they were counted from
CHUNK = 1 << 24  # tokens per bincount call: bounds the int64 copy of a memory-mapped uint16 split


def entropy_of_counts(counts: np.ndarray) -> float:
    """−Σ p log p (nats) of the distribution the counts give; tokens never seen contribute nothing."""
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("the unigram entropy of no tokens is undefined")
    p = counts[counts > 0].astype(np.float64) / total
    return float(-(p * np.log(p)).sum())


def _key(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def token_counts(directory: str | Path) -> np.ndarray:
    """How often each id (0..vocab_size−1) occurs in the directory's train split, read from the cache when it
    was counted from this very file, else counted (one pass) and cached — a read-only directory is counted
    again each time rather than refused."""
    directory = Path(directory)
    meta = layout.read_meta(directory)
    if meta is None:
        raise FileNotFoundError(f"no prepared data at '{directory}' (no {layout.META_FILE})")
    split = directory / meta["splits"]["train"]["file"]
    key, cache = _key(split), directory / COUNTS_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key and len(cached.get("counts", ())) == int(meta["vocab_size"]):
            return np.asarray(cached["counts"], dtype=np.int64)
    except (OSError, ValueError, AttributeError):
        pass  # no cache yet, or one from an older split: count again
    tokens = layout.open_tokens(directory, meta, "train")
    counts = np.zeros(int(meta["vocab_size"]), dtype=np.int64)
    for start in range(0, len(tokens), CHUNK):
        counts += np.bincount(tokens[start:start + CHUNK], minlength=len(counts))[:len(counts)]
    try:
        write_text_atomic(cache, json.dumps({"key": key, "counts": counts.tolist()}))
    except OSError:
        pass  # a read-only data directory: the entropy is still right, only not cached
    return counts


def unigram_entropy(sources: Sequence[tuple[str | Path, float]]) -> float:
    """The unigram entropy (nats) of the training tokens of one directory [(path, 1.0)] or of a weighted
    mixture [(path, weight), ...]: each source's unigram distribution weighted by its share of the batches."""
    mixed: np.ndarray | None = None
    weights = sum(w for _, w in sources)
    for path, weight in sources:
        counts = token_counts(path).astype(np.float64)
        p = counts / counts.sum() * (weight / weights)
        mixed = p if mixed is None else mixed + p
    if mixed is None or not math.isfinite(float(mixed.sum())):
        raise ValueError("unigram_entropy needs at least one source with tokens")
    return entropy_of_counts(mixed)
