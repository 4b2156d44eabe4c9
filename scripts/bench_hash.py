#!/usr/bin/env python
"""Cost of the manifest's content hashes: sha256 of a checkpoint right after it is written, vs the write itself.

A checkpoint here is what one save of an AdamW run writes: fp32 weights plus the two moments (12 bytes per
parameter), one `torch.save` (a Lightning file, or one rank's shard). `StepCheckpoint` hashes each file on the
rank that wrote it, right after the write, while it is still in the page cache — so the hash is a read from
memory, not a second read from disk. Printed per size: the save time, the hash time, their ratio, and the load
side (verifying the hash before a weights-only load, vs the load).

    python scripts/bench_hash.py                      # the default model (~7.4M params) and a ~100M-param state
    python scripts/bench_hash.py --params 7.4e6 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from training.checkpointing.manifest import HASH, hash_file  # noqa: E402
from training.checkpointing.safe import safe_torch_load  # noqa: E402


def state_of(params: int) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments of `params` parameters, in layer-sized fp32 tensors (256x1024 per matrix)."""
    n, size = params // (256 * 1024) or 1, (256, 1024)
    return {f"{kind}.{i}": torch.randn(size) for kind in ("weight", "exp_avg", "exp_avg_sq") for i in range(n)}


def timed(fn: callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(params: int, repeats: int, root: Path) -> None:
    state = state_of(params)
    path = root / "shard.pt"
    save, digest, load, verify = [], [], [], []
    for _ in range(repeats):  # interleaved, so the box's load drifts over all four alike
        save.append(timed(lambda: torch.save(state, path)))
        digest.append(timed(lambda: hash_file(path)))
        load.append(timed(lambda: safe_torch_load(path)))
        verify.append(timed(lambda: hash_file(path)))
    mb = path.stat().st_size / 2**20
    s, h, l, v = (statistics.median(x) for x in (save, digest, load, verify))
    print(f"{params / 1e6:7.1f}M params ({mb:7.0f} MiB): save {s:6.3f} s, {HASH} {h:6.3f} s → "
          f"hash/save {h / s:5.2f}; load {l:6.3f} s, verify {v:6.3f} s → verify/load {v / l:5.2f}")
    path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="+", default=[7.4e6, 1e8], help="parameter counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for params in args.params:
            bench(int(params), args.repeats, Path(root))


if __name__ == "__main__":
    main()
