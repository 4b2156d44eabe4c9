#!/usr/bin/env python
"""What each `--trainer.strategy` costs on CPU: step time, peak memory, checkpoint save and load, in one run.

Trains the same model on the same global batch with `normlab fit` — one process, then 2 gloo ranks under DDP,
FSDP2, ZeRO-2 and ZeRO-3 (Lightning's launcher; one intra-op thread per rank) — and prints one markdown table with
each strategy's ratio to one process measured in the same run. Measured inside the ranks by `StrategyProbe` (a
callback this script attaches with `-c`):
- step: the median wall time from a batch's start to its end (forward, backward, optimizer step), the first two
  steps left out;
- memory: the largest resident set of any rank (`ru_maxrss`) grown over its RSS before the model was built
  (imports excluded): in training (the weights, gradients, optimizer state and activations), measured before the
  first checkpoint save, and at the end, when the saves and the load had their buffers too;
- save: the median time of normlab's checkpoint saves (every rank's shards, hashes, manifest);
- load: verifying the last complete checkpoint (its manifest's hashes, no code in any file) and reading its
  weights and optimizer state back into the live run, as a resume does.

    python scripts/bench_strategies.py                      # ~5 minutes on 2 cores
    python scripts/bench_strategies.py --dim 384 --steps 16 --strategies auto ddp fsdp2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat while dogs ran past the quick brown fox that jumps over lazy river stones "
         "near old trees and small houses under grey skies").split()
WARMUP_STEPS = 2


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class StrategyProbe(Callback):
    """Times each training batch and each checkpoint save, times a load of the last checkpoint at the end, and
    writes `bench-rank<r>.json` into the run directory (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.saves: list[float] = []
        self.start = 0.0
        self.rss_before_model = 0.0
        self.train_peak = 0.0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.rss_before_model = _rss_mb()  # (callbacks' setup runs before configure_model builds the model)
        for callback in trainer.callbacks:
            if type(callback).__name__ == "StepCheckpoint":
                callback.save = self._timed(callback.save)

    def _timed(self, save: Any) -> Any:
        def timed(*args: Any) -> Any:
            self.train_peak = self.train_peak or _peak_mb()  # (before the first save: training alone)
            start = time.perf_counter()
            out = save(*args)
            self.saves.append(time.perf_counter() - start)
            return out
        return timed

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from training.checkpointing.resume import check_resume
        from training.run.layout import complete_checkpoints
        from training.run.manifest import Manifest, load_path

        ckpt_dir = complete_checkpoints(trainer.default_root_dir)[-1]
        trainer.strategy.barrier("bench.load")
        start = time.perf_counter()
        check_resume(ckpt_dir, trainer, pl_module)
        manifest = Manifest.read(ckpt_dir)
        checkpoint = trainer.strategy.load_checkpoint(load_path(ckpt_dir))
        if not (manifest.deepspeed or manifest.dcp):  # (those loaders fill the model and optimizer themselves)
            trainer.strategy.load_model_state_dict(checkpoint)
            trainer.strategy.load_optimizer_state_dict(checkpoint)
        trainer.strategy.barrier("bench.loaded")
        load = time.perf_counter() - start
        out = {"steps": self.steps, "saves": self.saves, "load": load, "rss_before_model_mb": self.rss_before_model,
               "train_peak_mb": self.train_peak, "peak_mb": _peak_mb()}
        Path(trainer.default_root_dir, f"bench-rank{trainer.global_rank}.json").write_text(json.dumps(out))


def make_corpus(root: Path) -> Path:
    """A small prepared corpus (data's real `prepare`, a 320-piece vocabulary)."""
    from data.prepare import prepare

    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(3000))
    (root / "corpus.txt").write_text(text)
    return prepare([root / "corpus.txt"], output=root / "corpus", vocab_size=320)


def fit(args: argparse.Namespace, work: Path, strategy: str) -> dict[str, float]:
    """One `normlab fit` under `strategy` (2 ranks; `auto`: one process with both ranks' batch); its summary."""
    ranks = 1 if strategy == "auto" else 2
    probe = work / "probe.yaml"
    probe.write_text(json.dumps({"trainer": {"callbacks": [{"class_path": "bench_strategies.StrategyProbe"}]}}))
    cmd = [sys.executable, "-m", "training.cli", "fit", "-c", str(probe), "--data.path", str(work / "corpus"),
           "--runs_dir", str(work / "runs"), "--name", strategy, "--trainer.accelerator", "cpu",
           "--trainer.devices", str(ranks), "--trainer.strategy", strategy, "--trainer.max_steps", str(args.steps),
           "--trainer.val_check_interval", str(args.steps), "--trainer.log_every_n_steps", "1",
           "--trainer.enable_progress_bar", "false", "--checkpoint.every_n_steps", str(args.steps // 3),
           "--model.dim", str(args.dim), "--model.n_layers", str(args.layers), "--model.n_heads", str(args.heads),
           "--data.seq_len", str(args.seq), "--data.batch_size", str(args.batch * 2 // ranks),
           "--data.val_batches", "1", "--metrics.every_n_steps", "0"]  # (no health metrics: the strategy alone)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_strategies: normlab fit under {strategy} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    ranks_out = [json.loads((work / "runs" / strategy / f"bench-rank{r}.json").read_text()) for r in range(ranks)]
    per_step = [max(steps) for steps in zip(*(r["steps"] for r in ranks_out), strict=True)]  # the slowest rank
    return {"step_s": statistics.median(per_step[WARMUP_STEPS:]),
            "train_mb": max(r["train_peak_mb"] - r["rss_before_model_mb"] for r in ranks_out),
            "end_mb": max(r["peak_mb"] - r["rss_before_model_mb"] for r in ranks_out),
            "save_s": statistics.median(max(s) for s in zip(*(r["saves"] for r in ranks_out), strict=True)),
            "load_s": max(r["load"] for r in ranks_out)}


def table(results: dict[str, dict[str, float]]) -> str:
    """The markdown table: each value and, after it, its ratio to one process (`auto`)."""
    base = results["auto"]
    cols = [("step_s", "step (s)", 3), ("train_mb", "peak RSS, training (MB)", 0),
            ("end_mb", "peak RSS, with save + load (MB)", 0), ("save_s", "save (s)", 2), ("load_s", "load (s)", 2)]
    lines = ["| strategy | " + " | ".join(name for _, name, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for strategy, r in results.items():
        cells = [f"{r[k]:.{d}f} (×{r[k] / base[k]:.2f})" for k, _, d in cols]
        lines.append(f"| {'one process' if strategy == 'auto' else strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=["auto", "ddp", "fsdp2", "zero2", "zero3"])
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run (checkpoints every third)")
    # Defaults: ~28M parameters and a small batch, so that the state (16 B/parameter under Adam) outweighs the
    # activations, as at scale.
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step (one process: twice this)")
    args = ap.parse_args()
    strategies = ["auto", *(s for s in args.strategies if s != "auto")]
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        work = Path(tmp)
        make_corpus(work)
        results = {s: fit(args, work, s) for s in strategies}
    print(f"{args.layers} layers, dim {args.dim}, {args.seq} tokens x {args.batch * 2} sequences per step, "
          f"{args.steps} steps, fp32 on CPU (2 gloo ranks, one thread each; one process: one thread)")
    print(table(results))


if __name__ == "__main__":
    main()
