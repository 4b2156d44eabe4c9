"""Stateless pseudo-randomness: counter-based hashing and a keyed permutation of ``range(n)``.

Sampling must be a pure function of (seed, step, rank, ...), so nothing here keeps state: ``splitmix64`` is
the finalizer of Steele et al.'s SplitMix64 (a 64-bit bijective mixer), and ``permute`` is a 4-round Feistel
network over the smallest even-bit power of two ≥ n with cycle walking (Black & Rogaway, 2002), which gives
a bijection of ``range(n)`` in O(1) memory — a 10 B-token corpus has ~40 M windows, too many to shuffle
and keep in every data-loader worker.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_FEISTEL_ROUNDS = 4


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    """Mix 64-bit integers (element-wise, wrapping arithmetic)."""
    z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def derive_key(*parts: int) -> int:
    """One 64-bit key from a tuple of non-negative integers (seed, epoch, ...)."""
    key = _U64(0)
    for part in parts:
        key = splitmix64(key ^ splitmix64(_U64(part)))
    return int(key)


def unit_interval(indices: np.ndarray, key: int) -> np.ndarray:
    """A uniform float in [0, 1) for each index, fixed by ``key``."""
    bits = splitmix64(np.asarray(indices, dtype=_U64) ^ _U64(key)) >> _U64(11)
    return bits.astype(np.float64) / float(1 << 53)


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """Apply the permutation of ``range(n)`` selected by ``key`` to each element of ``indices``."""
    if n <= 1:
        return np.zeros_like(np.asarray(indices, dtype=np.int64))
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    round_keys = [derive_key(key, r) for r in range(_FEISTEL_ROUNDS)]
    y = _feistel(np.asarray(indices, dtype=_U64), half_bits, round_keys)
    # Cycle walking: the Feistel network permutes [0, 4^half_bits) ⊇ [0, n); re-applying it to values
    # outside [0, n) until they fall inside keeps a bijection on [0, n). Expected < 4 passes.
    while (outside := y >= _U64(n)).any():
        y[outside] = _feistel(y[outside], half_bits, round_keys)
    return y.astype(np.int64)


def _feistel(x: np.ndarray, half_bits: int, round_keys: list[int]) -> np.ndarray:
    mask = _U64((1 << half_bits) - 1)
    left, right = x >> _U64(half_bits), x & mask
    for k in round_keys:
        left, right = right, left ^ (splitmix64(right ^ _U64(k)) & mask)
    return (left << _U64(half_bits)) | right
