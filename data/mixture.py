"""A weighted mixture of prepared directories, sampled as a pure function of the global sample index.

Global sample ``s`` (see ``data.dataset``) comes from source ``i`` when a keyed hash of ``s`` in [0, 1) falls in
source ``i``'s share of the cumulative weights, so each source supplies its weight's share of the samples
(within sampling error). Inside source ``i`` the same ``s`` picks a window through that source's own
``WindowSampler`` (its own key): the windows a source supplies within any run of ``n_i`` consecutive global
samples (``n_i`` = its windows per epoch) are distinct. Nothing depends on what came before ``s``, so a batch
is still a pure function of (seed, start, micro-step, rank, world size): resume needs no replay and a new world
size continues at the same global sample, exactly as with one source. With document masking each window's
``position_ids`` come from its own source's document index (see ``data.dataset.window_positions``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data import rng
from data.dataset import WindowSampler, gather, sample_indices, window_positions
from data.errors import DataError

# Keys the source choice apart from the window order (which uses derive_key(seed, epoch)).
_MIX_TAG = 0x313C


@dataclass(frozen=True)
class MixtureSampler:
    """Maps global sample indices to (source, window start) for sources of ``n_tokens`` with ``weights``."""

    n_tokens: tuple[int, ...]
    weights: tuple[float, ...]
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        if len(self.n_tokens) != len(self.weights) or not self.weights:
            raise DataError("a data mixture needs one weight per source")
        if any(not w > 0 for w in self.weights):
            raise DataError(f"data mixture weights must be positive, got {list(self.weights)}")

    @property
    def samplers(self) -> list[WindowSampler]:
        return [WindowSampler(n, self.seq_len, rng.derive_key(self.seed, _MIX_TAG, i + 1))
                for i, n in enumerate(self.n_tokens)]

    def sources(self, samples: np.ndarray) -> np.ndarray:
        """The source of each global sample."""
        cumulative = np.cumsum(self.weights) / sum(self.weights)
        u = rng.unit_interval(np.asarray(samples, dtype=np.int64), rng.derive_key(self.seed, _MIX_TAG))
        return np.minimum(np.searchsorted(cumulative, u, side="right"), len(self.weights) - 1)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window start in that source's tokens) of each global sample."""
        samples = np.asarray(samples, dtype=np.int64)
        source = self.sources(samples)
        starts = np.zeros_like(samples)
        for i, sampler in enumerate(self.samplers):
            here = source == i
            if here.any():
                starts[here] = sampler.starts(samples[here])
        return source, starts


def _mixture_windows(
    tokens: Sequence[np.ndarray], sampler: MixtureSampler, samples: np.ndarray,
    document_starts: Sequence[np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(windows, their position_ids or None), both [len(samples), seq_len + 1], each from its own source."""
    source, starts = sampler.locate(samples)
    shape = (len(samples), sampler.seq_len + 1)
    out = np.empty(shape, dtype=np.int64)
    positions = np.empty(shape, dtype=np.int64) if document_starts is not None else None
    for i, array in enumerate(tokens):
        here = source == i
        if here.any():
            out[here] = gather(array, starts[here], sampler.seq_len + 1)
            if positions is not None:
                positions[here] = window_positions(document_starts[i], starts[here], sampler.seq_len + 1)
    return out, positions


class MixtureBatches(IterableDataset):
    """Endless training micro-batches from a mixture, after ``start_sample`` global samples (as ``TrainBatches``)."""

    def __init__(
        self, files: Sequence[tuple[Path, str, int]], weights: Sequence[float], *, seq_len: int, batch_size: int,
        seed: int, start_sample: int = 0, rank: int = 0, world_size: int = 1,
        document_starts: Sequence[np.ndarray] | None = None,
    ) -> None:
        self.files = [(Path(p), dtype, n) for p, dtype, n in files]
        self.sampler = MixtureSampler(tuple(n for _, _, n in files), tuple(weights), seq_len, seed)
        self.batch_size, self.start_sample, self.rank, self.world_size = batch_size, start_sample, rank, world_size
        self.document_starts = document_starts  # one index per source: batches carry position_ids

    def __iter__(self) -> Iterator[torch.Tensor | dict[str, torch.Tensor]]:
        tokens = [np.memmap(p, dtype=dtype, mode="r", shape=(n,)) for p, dtype, n in self.files]
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for step in itertools.count(worker, workers):
            samples = sample_indices(step, self.rank, self.world_size, self.batch_size, self.start_sample)
            windows, positions = _mixture_windows(tokens, self.sampler, samples, self.document_starts)
            if positions is None:
                yield torch.from_numpy(windows)
            else:
                yield {"tokens": torch.from_numpy(windows), "position_ids": torch.from_numpy(positions)}
