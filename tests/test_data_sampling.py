"""The pure sampling function: determinism, disjoint ranks, exact resume, epochs, and the fixed validation set."""

from __future__ import annotations

import numpy as np
import pytest

from data import rng
from data.dataset import (
    WindowSampler,
    micro_step,
    rank_val_batches,
    sample_indices,
    train_batch,
    val_starts,
)
from data.errors import DataError

SEQ, BATCH = 16, 4
TOKENS = np.random.default_rng(0).integers(0, 60_000, size=10_000).astype(np.uint16)


def batch(step: int, seed: int = 1234, rank: int = 0, world: int = 1) -> np.ndarray:
    return train_batch(TOKENS, seq_len=SEQ, batch_size=BATCH, seed=seed, step=step, rank=rank, world_size=world)


def test_same_seed_and_step_give_the_same_batch() -> None:
    assert np.array_equal(batch(7), batch(7))
    assert not np.array_equal(batch(7), batch(8))
    assert not np.array_equal(batch(7, seed=1), batch(7, seed=2))
    assert batch(7).shape == (BATCH, SEQ + 1) and batch(7).dtype == np.int64


def test_rows_are_windows_of_the_token_stream() -> None:
    rows = batch(3, world=2, rank=1)
    for row in rows:
        starts = np.flatnonzero(TOKENS == row[0])
        assert any(np.array_equal(TOKENS[s : s + SEQ + 1], row) for s in starts)


def test_ranks_read_disjoint_windows() -> None:
    sampler = WindowSampler(len(TOKENS), SEQ, seed=5)
    world, steps = 4, sampler.n_windows // (4 * BATCH)  # stay inside the first epoch
    seen: dict[int, set[int]] = {r: set() for r in range(world)}
    for step in range(steps):
        for rank in range(world):
            seen[rank].update(sampler.starts(sample_indices(step, rank, world, BATCH)).tolist())
    for a in range(world):
        assert len(seen[a]) == steps * BATCH
        for b in range(a + 1, world):
            assert not seen[a] & seen[b]


def test_resume_at_step_k_continues_the_straight_run() -> None:
    """A run resumed at optimizer step k (gradient accumulation 3) reads exactly what the straight run read."""
    accumulate, k = 3, 5
    straight = [batch(micro_step(step, m, accumulate), rank=1, world=2) for step in range(8) for m in range(accumulate)]
    resumed = [batch(micro_step(k, 0, accumulate) + i, rank=1, world=2) for i in range((8 - k) * accumulate)]
    assert all(np.array_equal(a, b) for a, b in zip(straight[k * accumulate :], resumed, strict=True))


def test_a_resume_on_another_world_size_continues_the_sample_stream() -> None:
    """Two ranks read 5 micro-steps; the run resumes on three ranks after the samples consumed: together they read
    every global sample once, in order — none skipped, none read twice."""
    read = [sample_indices(m, r, 2, BATCH) for m in range(5) for r in range(2)]
    start = 5 * 2 * BATCH
    read += [sample_indices(m, r, 3, BATCH, start=start) for m in range(4) for r in range(3)]
    assert np.array_equal(np.concatenate(read), np.arange(start + 4 * 3 * BATCH))
    resumed = train_batch(TOKENS, seq_len=SEQ, batch_size=BATCH, seed=1234, step=0, rank=0, world_size=3, start=start)
    assert np.array_equal(resumed, batch(start // BATCH))  # the single-rank run's micro-batch at that point


def test_an_epoch_visits_every_window_once_and_epochs_differ() -> None:
    sampler = WindowSampler(len(TOKENS), SEQ, seed=9)
    n = sampler.n_windows
    epoch0 = sampler.starts(np.arange(n))
    epoch1 = sampler.starts(np.arange(n, 2 * n))
    assert len(set(epoch0.tolist())) == n
    assert len(set(((epoch0 - epoch0.min()) // SEQ).tolist())) == n  # one window per grid cell
    assert epoch0.min() >= 0 and (epoch0 + SEQ + 1).max() <= len(TOKENS)
    assert (epoch1 + SEQ + 1).max() <= len(TOKENS)
    assert not np.array_equal(epoch0, epoch1)


@pytest.mark.parametrize("n_tokens", [SEQ + 1, SEQ + 2, 2 * SEQ, 2 * SEQ + 1, 3 * SEQ + 5])
def test_windows_stay_in_bounds_for_tiny_corpora(n_tokens: int) -> None:
    sampler = WindowSampler(n_tokens, SEQ, seed=3)
    starts = sampler.starts(np.arange(50))
    assert starts.min() >= 0 and (starts + SEQ + 1).max() <= n_tokens


def test_corpus_too_small_for_one_sequence() -> None:
    message = r"corpus too small: the train split has 16 tokens, but one sequence of seq_len 16 needs 17"
    with pytest.raises(DataError, match=message):
        WindowSampler(SEQ, SEQ, seed=0)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_permute_is_a_bijection(n: int) -> None:
    out = rng.permute(np.arange(n), n, key=rng.derive_key(42, n))
    assert sorted(out.tolist()) == list(range(n))


def test_permute_depends_on_the_key() -> None:
    a = rng.permute(np.arange(100), 100, key=1)
    assert not np.array_equal(a, rng.permute(np.arange(100), 100, key=2))
    assert not np.array_equal(a, np.arange(100))


def test_validation_windows_are_fixed_and_spread() -> None:
    starts = val_starts(1000, SEQ, 20)
    assert np.array_equal(starts, val_starts(1000, SEQ, 20))
    assert len(set(starts.tolist())) == 20 and starts.max() + SEQ + 1 <= 1000
    assert starts.max() > 800  # spread over the split, not bunched at its start
    short = val_starts(3 * SEQ + 1, SEQ, 5)  # only 3 windows exist: repeat them
    assert short.tolist() == [0, SEQ, 2 * SEQ, 0, SEQ]


def test_validation_batches_are_shared_out_across_ranks() -> None:
    assert sorted(rank_val_batches(8, 0, 2) + rank_val_batches(8, 1, 2)) == list(range(8))
    uneven = [rank_val_batches(7, r, 3) for r in range(3)]
    assert {len(u) for u in uneven} == {3}  # equal counts, so no rank waits on another
    assert set(sum(uneven, [])) == set(range(7))
