"""`normlab evaluate --checkpoint runs/NAME`: every complete checkpoint of a run, in step order.

Results go to the run directory, next to its TensorBoard events:

    runs/NAME/eval/<set>/step-XXXXXXXX.json   one file per step (the numbers and the settings they depend on)
    runs/NAME/eval/<set>.csv                  one row per step, rebuilt from those files

and to TensorBoard as `eval/<set>/loss|ppl|bpb` at each step, beside the run's `val/loss`. A step whose file
holds the same settings (data directory, split, sequence length, windows, tokenizer) is skipped without loading
its weights, so re-running after more training evaluates only the new checkpoints. Each file is written
atomically, once its step is scored: an interrupted evaluation resumes where it stopped.
"""
from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import torch

from data.atomic import write_text_atomic
from training.checkpointing.load import load_checkpoint
from training.errors import CheckpointError
from training.eval.heldout import log_to_tensorboard, parse_sets, plan_sets, score, split_line
from training.eval.metrics import METRICS
from training.run.dir import RunDir, model_config, step_config
from training.run.layout import MANIFEST, checkpoints_dir
from training.run.manifest import Manifest

log = logging.getLogger(__name__)

CSV_FIELDS = ("step", "tokens_seen", *METRICS, "tokens", "bytes", "split", "data", "checkpoint")


def scored_with(path: Path, settings: dict[str, Any]) -> bool:
    """Whether `path` holds results computed with these settings (the step need not be scored again)."""
    try:
        return json.loads(path.read_text()).get("settings") == settings
    except (OSError, ValueError):
        return False


def evaluate_run(run_dir: str | Path, data: list[str] | None = None, split: str = "val",
                 max_tokens: int | None = None, batch_size: int = 8, device: str | None = None) -> list[dict[str, Any]]:
    """Score every complete checkpoint of `run_dir` not yet scored with the same settings; returns the new results."""
    run = RunDir(run_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoints = run.checkpoints()
    if not checkpoints:
        raise CheckpointError(f"'{run_dir}' holds no complete checkpoint (none in {checkpoints_dir(run_dir)} has a "
                              f"{MANIFEST}); train it first, or pass one checkpoint directory")
    specs = parse_sets(data)
    new: list[dict[str, Any]] = []
    for ckpt in checkpoints:
        manifest = Manifest.read(ckpt)
        sets = plan_sets(specs, step_config(ckpt), int(model_config(ckpt)["max_seq_len"]), manifest.tokenizer_hash,
                         str(ckpt), split, max_tokens)
        todo = [held for held in sets if not scored_with(run.eval_file(held.name, manifest.step), held.settings())]
        if not todo:
            log.info("%s: already evaluated with these settings, skipped", ckpt.name)
            continue
        loaded = load_checkpoint(ckpt, device=device)
        for held in todo:
            result = {"checkpoint": str(ckpt), "step": manifest.step, "tokens_seen": manifest.tokens_seen,
                      **score(loaded.model, held, batch_size, device), "settings": held.settings()}
            write_text_atomic(_mkdir(run.eval_file(held.name, result["step"])), json.dumps(result, indent=2) + "\n")
            log_to_tensorboard(run.path, [result])
            log.info("step %d: %s", result["step"], split_line(result))
            new.append(result)
        for held in todo:
            write_csv(run.path, held.name)
    for name in sorted({r["set"] for r in new}):
        log.info("results: %s and %s/", run.eval_csv(name), run.eval_dir / name)
    return new


def _mkdir(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(run_dir: Path, name: str) -> Path:
    """`eval/<name>.csv`: one row per step from the step files, in step order (rewritten atomically)."""
    run = RunDir(run_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(run.eval_results(name))
    path = run.eval_csv(name)
    write_text_atomic(path, buffer.getvalue())
    return path
