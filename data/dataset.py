"""Fixed-length windows over a flat token array, and the pure sampling function.

A sample is a window of ``seq_len + 1`` tokens (inputs and shifted targets). Windows start on a grid of
stride ``seq_len`` shifted by a per-epoch offset, and each epoch visits the grid in a keyed random order.

Position is counted in *global samples*: windows consumed by all ranks together. A run that starts (or resumes)
after ``start`` samples reads, on ``rank`` of ``world_size`` at its micro-step ``m`` (micro-batches this rank has
read since the start), the global samples ``start + [(m * world_size + rank) * batch_size, ... + batch_size)``;
global sample ``s`` is window ``permute(s mod n)`` of epoch ``s div n``. So a batch is a pure function of (seed,
start, micro-step, rank, world size): resuming needs no replay, and ranks never share a window within an epoch.
Resuming with ``start`` = samples consumed so far reproduces the straight run when world size and batch size are
unchanged, and continues exactly where it stopped (no sample skipped or read twice) when they change.

With document masking (``document_starts`` given) a batch is a dict ``{"tokens": [B, seq_len + 1],
"position_ids": [B, seq_len + 1]}``: each token's offset from the start of its document inside the window
(:func:`window_positions`), the same pure function of the window starts and the split's document index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data import rng
from data.errors import DataError


@dataclass(frozen=True)
class WindowSampler:
    """Maps global sample indices to window start offsets in a token array of ``n_tokens``."""

    n_tokens: int
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        check_enough_tokens(self.n_tokens, self.seq_len, "the train split")

    @property
    def n_windows(self) -> int:
        """Windows per epoch: the grid leaves up to ``seq_len`` tokens of slack for the epoch offset."""
        return max(1, (self.n_tokens - 1) // self.seq_len - 1)

    @property
    def max_offset(self) -> int:
        return min(self.seq_len - 1, self.n_tokens - 1 - self.n_windows * self.seq_len)

    def starts(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.n_windows)
        starts = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            key = rng.derive_key(self.seed, int(epoch))
            offset = rng.derive_key(self.seed, int(epoch), 1) % (self.max_offset + 1)
            starts[here] = offset + rng.permute(positions[here], self.n_windows, key) * self.seq_len
        return starts


def check_enough_tokens(n_tokens: int, seq_len: int, what: str) -> None:
    if n_tokens < seq_len + 1:
        raise DataError(
            f"corpus too small: {what} has {n_tokens} tokens, but one sequence of seq_len {seq_len} needs "
            f"{seq_len + 1} (seq_len + 1); lower seq_len or prepare more text"
        )


def micro_step(global_step: int, micro_batch: int = 0, accumulate: int = 1) -> int:
    """Micro-batches a rank has consumed before ``micro_batch`` of optimizer step ``global_step``."""
    return global_step * accumulate + micro_batch


def sample_indices(step: int, rank: int, world_size: int, batch_size: int, start: int = 0) -> np.ndarray:
    """Global sample indices of the micro-batch ``rank`` reads at micro-step ``step`` of a run that began after
    ``start`` samples."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    first = start + (step * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


def gather(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """Stack ``tokens[start : start + length]`` for each start into an int64 array [len(starts), length]."""
    return tokens[starts[:, None] + np.arange(length)].astype(np.int64)


def window_positions(document_starts: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """Position of each token of the windows ``tokens[start : start + length]`` within its document, int64
    [len(starts), length]: 0 at every document start and at the window start (a document cut by the window
    begins there, as the model cannot see its earlier part), counting up by one per token.

    ``document_starts``: ascending token offsets where documents begin (``data.layout.document_starts``).
    """
    bounds = np.asarray(document_starts, dtype=np.int64)  # (no copy of the split's index, on every batch)
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)  # [N, length]
    k = np.searchsorted(bounds, index, side="right") - 1  # the last document start at or before each token
    first = np.where(k >= 0, bounds[np.maximum(k, 0)], 0) if bounds.size else np.zeros_like(index)  # (none: 0)
    return index - np.maximum(first, index[:, :1])


def window_batch(tokens: np.ndarray, starts: np.ndarray, length: int,
                 document_starts: np.ndarray | None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The batch of windows at ``starts``: the token tensor [N, length], or with ``document_starts`` the dict
    ``{"tokens", "position_ids"}`` of two such tensors (see the module docstring)."""
    batch = torch.from_numpy(gather(tokens, starts, length))
    if document_starts is None:
        return batch
    return {"tokens": batch, "position_ids": torch.from_numpy(window_positions(document_starts, starts, length))}


def train_batch(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int, step: int, rank: int = 0, world_size: int = 1,
    start: int = 0,
) -> np.ndarray:
    """The training micro-batch [batch_size, seq_len + 1] at micro-step ``step`` (see module docstring)."""
    sampler = WindowSampler(len(tokens), seq_len, seed)
    return gather(tokens, sampler.starts(sample_indices(step, rank, world_size, batch_size, start)), seq_len + 1)


def val_starts(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """``n_windows`` fixed window starts spread evenly over the split (repeating only if it is too short)."""
    check_enough_tokens(n_tokens, seq_len, "the validation split")
    available = (n_tokens - 1) // seq_len
    j = np.arange(n_windows, dtype=np.int64)
    grid = j * available // n_windows if n_windows <= available else j % available
    return grid * seq_len


def rank_val_batches(val_batches: int, rank: int, world_size: int) -> list[int]:
    """The validation batches ``rank`` evaluates: every world_size-th, wrapping so all ranks run equally many
    (unequal counts would deadlock collectives inside validation)."""
    per_rank = math.ceil(val_batches / world_size)
    return [(rank + i * world_size) % val_batches for i in range(per_rank)]


class _TokenFile(IterableDataset):
    """Yields whole batches from a memory-mapped token file; opened lazily in each loader worker."""

    def __init__(self, path: Path, dtype: str, n_tokens: int) -> None:
        self.path, self.dtype, self.n_tokens = Path(path), dtype, n_tokens

    def _tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    @staticmethod
    def _worker_share() -> tuple[int, int]:
        # The DataLoader takes batches from its workers round-robin, so worker w producing items w, w+k, ...
        # keeps the loader's output in sequence order.
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)


class TrainBatches(_TokenFile):
    """Endless training micro-batches after ``start_sample`` global samples; training stops at ``max_steps``."""

    def __init__(
        self, path: Path, dtype: str, n_tokens: int, *, seq_len: int, batch_size: int, seed: int,
        start_sample: int = 0, rank: int = 0, world_size: int = 1, document_starts: np.ndarray | None = None,
    ) -> None:
        super().__init__(path, dtype, n_tokens)
        self.sampler = WindowSampler(n_tokens, seq_len, seed)
        self.batch_size, self.start_sample, self.rank, self.world_size = batch_size, start_sample, rank, world_size
        self.document_starts = document_starts  # given: batches carry position_ids (document masking)

    def __iter__(self) -> Iterator[torch.Tensor | dict[str, torch.Tensor]]:
        tokens = self._tokens()
        worker, workers = self._worker_share()
        for step in itertools.count(worker, workers):
            samples = sample_indices(step, self.rank, self.world_size, self.batch_size, self.start_sample)
            starts = self.sampler.starts(samples)
            yield window_batch(tokens, starts, self.sampler.seq_len + 1, self.document_starts)


class ValBatches(_TokenFile):
    """This rank's share of a fixed set of ``val_batches`` validation batches."""

    def __init__(
        self, path: Path, dtype: str, n_tokens: int, *, seq_len: int, batch_size: int, val_batches: int,
        rank: int = 0, world_size: int = 1, document_starts: np.ndarray | None = None,
    ) -> None:
        super().__init__(path, dtype, n_tokens)
        self.starts = val_starts(n_tokens, seq_len, val_batches * batch_size).reshape(val_batches, batch_size)
        self.seq_len = seq_len
        self.batches = rank_val_batches(val_batches, rank, world_size)
        self.document_starts = document_starts

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[torch.Tensor | dict[str, torch.Tensor]]:
        tokens = self._tokens()
        worker, workers = self._worker_share()
        for b in self.batches[worker::workers]:
            yield window_batch(tokens, self.starts[b], self.seq_len + 1, self.document_starts)
