#!/usr/bin/env python
"""Cost of the manifest's content hashes: sha256 of a checkpoint right after it is written, vs the write itself.

A checkpoint here is what one save of an AdamW run writes: fp32 weights plus the two moments (12 bytes per
parameter), one `torch.save` (a Lightning file, or one rank's shard). `StepCheckpoint` hashes each file on the
rank that wrote it, right after the write, while it is still in the page cache — so the hash is a read from
memory, not a second read from disk. Printed per size: the save time, the hash time, their ratio, and the load
side (verifying the hash before a weights-only load, vs the load).

    python scripts/bench_hash.py                      # the default model (~7.4M params) and a ~100M-param state
    python scripts/bench_hash.py --params 7.4e6 --repeats 5

`--resume`: what a 2-rank DeepSpeed resume spends on integrity checks, on a real ~1 GB ZeRO-2 checkpoint (written
first by a 2-rank `normlab fit` of a wide model, one step). Per round, both ranks at once (a thread each, as two
processes would; sha256 releases the GIL): every rank verifying every file of the manifest (as before each rank
verified only what it reads) against each rank verifying the files it reads (`resume.rank_files`). Then the whole
resume (`normlab fit --ckpt_path`, 2 ranks, up to the saved step: load, then stop), run with this checkout and
with each `--before` checkout (e.g. `git archive <commit> | tar -x -C DIR`), alternating.

    python scripts/bench_hash.py --resume --gb 1 --rounds 3 --before /tmp/normlab-before
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from training.checkpointing.resume import rank_files  # noqa: E402
from training.checkpointing.safe import safe_torch_load  # noqa: E402
from training.run.manifest import HASH, Manifest, hash_file, verify_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


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


def _normlab(code: Path, root: Path, *args: str) -> float:
    """Seconds of `normlab <args>` run from the checkout `code` in `root` (raises with the output on failure)."""
    env = {**os.environ, "PYTHONPATH": str(code), "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "training.cli", *args], cwd=root, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"normlab {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.perf_counter() - start


def _fit_args(root: Path, dim: int, *extra: str) -> list[str]:
    """A 2-rank ZeRO-2 run of one step whose checkpoint is ~16 bytes per parameter (weights, Adam's fp32 state)."""
    return ["fit", "--data.path", str(root / "corpus"), "--runs_dir", str(root / "runs"), "--name", "big",
            "--model.dim", str(dim), "--model.n_layers", "4", "--model.n_heads", str(dim // 64),
            "--data.seq_len", "16", "--data.batch_size", "1", "--data.val_batches", "1", "--trainer.accelerator",
            "cpu", "--trainer.strategy", "zero2", "--trainer.devices", "2", "--trainer.max_steps", "1",
            "--trainer.val_check_interval", "1000", "--checkpoint.every_n_steps", "1", "--metrics.every_n_steps",
            "0", "--trainer.enable_progress_bar", "false", *extra]


def bench_resume(gb: float, rounds: int, before: list[Path], root: Path) -> None:
    from data.prepare import prepare

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(2000)]
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choices(words, k=60)) for _ in range(400)))
    prepare([root / "corpus.txt"], output=root / "corpus", vocab_size=320)
    dim = 64 * round((gb * 2**30 / 16 / (4 * 12.7)) ** 0.5 / 64)  # 4 layers of ~12.7·dim² parameters
    _normlab(REPO, root, *_fit_args(root, dim))
    ckpt = root / "runs" / "big" / "checkpoints" / "step-00000001"
    manifest = Manifest.read(ckpt)
    size = sum(manifest.files.values()) / 2**30
    print(f"# 2-rank ZeRO-2 checkpoint, dim {dim}, {size:.2f} GiB in {len(manifest.files)} files; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    def both_ranks(restrict: bool) -> float:
        with ThreadPoolExecutor(2) as pool:
            start = time.perf_counter()
            list(pool.map(lambda r: verify_files(ckpt, rank_files(manifest, r, 2) if restrict else manifest), (0, 1)))
            return time.perf_counter() - start

    checks = {False: [], True: []}
    for r in range(rounds + 1):
        for restrict in (r % 2 == 0, r % 2 == 1):
            checks[restrict].append(both_ranks(restrict))
    all_files, own = (statistics.median(checks[k][1:]) for k in (False, True))
    read = [sum(rank_files(manifest, r, 2).files.values()) / 2**30 for r in (0, 1)]
    print(f"integrity check, both ranks at once: every file on every rank {all_files:.2f} s ({size:.2f} GiB per rank) "
          f"→ the files each rank reads {own:.2f} s ({read[0]:.2f} / {read[1]:.2f} GiB); medians of {rounds}")
    resumes: dict[Path, list[float]] = {code: [] for code in [*before, REPO]}
    for r in range(rounds):
        for code in (list(resumes) if r % 2 else list(resumes)[::-1]):
            resumes[code].append(_normlab(code, root, *_fit_args(root, dim, "--ckpt_path", str(ckpt))))
    for code, times in resumes.items():
        print(f"whole resume (2 ranks, load then stop) with {code}: median {statistics.median(times):.1f} s "
              f"(runs {', '.join(f'{t:.1f}' for t in times)})")
    print(f"# load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="+", default=[7.4e6, 1e8], help="parameter counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--resume", action="store_true", help="time a 2-rank DeepSpeed resume's integrity checks")
    ap.add_argument("--gb", type=float, default=1.0, help="--resume: checkpoint size")
    ap.add_argument("--rounds", type=int, default=3, help="--resume: rounds")
    ap.add_argument("--before", type=Path, nargs="*", default=[], help="--resume: other checkouts to resume with")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        if args.resume:
            bench_resume(args.gb, args.rounds, [p.resolve() for p in args.before], Path(root))
            return
        for params in args.params:
            bench(int(params), args.repeats, Path(root))


if __name__ == "__main__":
    main()
