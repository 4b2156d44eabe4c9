"""Held-out loss, perplexity and bits per byte of a model: the sets to score (`plan_sets`) and the scoring.

By default a checkpoint is scored on exactly the validation windows its run validated on (same data directory,
sequence length and window starts), so its loss equals the run's logged `val/loss` at that step. `--data` takes
several prepared directories instead, optionally named (`--data web=data/a books=data/b`), each checked against
the checkpoint's tokenizer. The command itself is `training/eval/cli.py`; a run's whole history
`training/eval/history.py`; lm-evaluation-harness tasks `training/eval/harness.py`.
"""
from __future__ import annotations

import functools
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from data.dataset import val_starts, window_batch
from data.layout import document_starts, load_tokenizer, open_tokens, read_meta
from data.tokenizer import sha256_file
from training.checkpointing.load import load_checkpoint
from training.errors import CheckpointError, UserError
from training.eval.metrics import LossTotals, batch_loss, split_batch, tags
from training.loggers import write_scalars
from training.run.layout import MANIFEST
from training.run.manifest import Manifest

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)  # a run's history scores many checkpoints with the same tokenizer
def piece_bytes(tokenizer_path: Path, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte pieces 1, special/control pieces such as EOS 0). Cached:
    callers only read it."""
    out = np.zeros(vocab_size, dtype=np.int64)
    per_id = load_tokenizer(tokenizer_path).piece_bytes()[:vocab_size]
    out[:len(per_id)] = per_id
    return out


@dataclass
class HeldOut:
    """One held-out set, ready to score: the windows of `split` of a prepared directory, named `name`."""

    name: str
    data_dir: Path
    meta: dict[str, Any]
    split: str
    seq_len: int
    tokens: np.ndarray
    starts: np.ndarray
    document_starts: np.ndarray | None = None  # the split's documents when the run trained with document masking

    def settings(self) -> dict[str, Any]:
        """What the numbers depend on besides the weights: equal settings, equal windows of equal tokens."""
        return {"data": str(self.data_dir.resolve()), "split": self.split, "seq_len": self.seq_len,
                "windows": len(self.starts), "split_tokens": int(self.meta["splits"][self.split]["tokens"]),
                "tokenizer_sha256": self.meta["tokenizer_sha256"]}


def parse_sets(specs: list[str] | None) -> list[tuple[str | None, Path | None]]:
    """`--data` values → [(name or None, directory)]; None → the run's own data, [(None, None)]."""
    if not specs:
        return [(None, None)]
    sets = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or Path(spec).exists():  # a plain directory (even one whose name holds '=')
            sets.append((None, Path(spec)))
        elif not _SET_NAME.fullmatch(name):
            raise UserError(f"--data {spec}: the set name {name!r} must be letters, digits, '_', '-' or '.'")
        else:
            sets.append((name, Path(path)))
    return sets


_SET_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def plan_sets(specs: list[tuple[str | None, Path | None]], run_config: dict[str, Any], max_seq_len: int,
              tokenizer_sha256: str | None, where: str, split: str = "val",
              max_tokens: int | None = None) -> list[HeldOut]:
    """The held-out sets to score for a checkpoint (`where`, for messages) trained with the tokenizer whose
    sha256 is `tokenizer_sha256` (None: unknown, not checked). Unnamed sets are called `split` when there is one,
    else after their directory."""
    run_data = run_config.get("data") or {}
    seq_len = min(int(run_data.get("seq_len") or max_seq_len), max_seq_len)
    run_path = run_data.get("path")
    # The run's own directories (a mixture's sources, its named held-out sets): their validation windows are the
    # ones the run scored in the loop.
    run_dirs = {Path(d) for d in (run_path if isinstance(run_path, dict) else [run_path] if run_path else [])}
    run_dirs |= {Path(d) for d in (run_data.get("val_sets") or {}).values()}
    if isinstance(run_path, dict) and (None, None) in specs:  # no --data, a mixture: each source, by its name
        specs = [s for s in specs if s != (None, None)] + [(Path(d).name, Path(d)) for d in run_path]
    out: list[HeldOut] = []
    for name, data_dir in specs:
        if data_dir is None:
            if not run_path:
                raise CheckpointError(f"'{where}' does not record its data directory; pass --data DIR")
            data_dir = Path(run_path)
        meta = read_meta(data_dir)
        if meta is None:
            raise CheckpointError(f"no prepared data at '{data_dir}' (no meta.json); run `normlab prepare` or "
                                  "pass --data")
        if tokenizer_sha256 is not None and tokenizer_sha256 != meta["tokenizer_sha256"]:
            raise CheckpointError(
                f"'{data_dir}' was prepared with a different tokenizer (sha256 {meta['tokenizer_sha256'][:12]}…) "
                f"than the one '{where}' was trained with (sha256 {tokenizer_sha256[:12]}…); evaluate on data "
                "prepared with `normlab prepare --tokenizer <the run's tokenizer.model>`")
        if split not in meta["splits"]:
            raise CheckpointError(f"split {split!r} is not in '{data_dir}'; choose one of {sorted(meta['splits'])}")
        tokens = open_tokens(data_dir, meta, split)
        if max_tokens is not None:
            n_windows = max(1, max_tokens // seq_len)
        elif data_dir in run_dirs and run_data.get("val_batches") and run_data.get(
                "batch_size"):  # the run's own validation set
            n_windows = int(run_data["val_batches"]) * int(run_data["batch_size"])
        else:
            n_windows = min(128, max(1, (len(tokens) - 1) // seq_len))
        if name is None:
            name = split if len(specs) == 1 else data_dir.resolve().name
        # A run trained with document masking validated under it: score the same way (its windows and positions).
        docs = document_starts(data_dir, split, meta) if run_data.get("document_mask") else None
        out.append(HeldOut(name, data_dir, meta, split, seq_len, tokens, val_starts(len(tokens), seq_len, n_windows),
                           docs))
    names = [h.name for h in out]
    if len(set(names)) != len(names):
        raise UserError(f"--data: two sets are called {min(n for n in names if names.count(n) > 1)!r}; "
                         "name them: --data NAME=DIR ...")
    return out


def checkpoint_tokenizer_sha256(checkpoint: str | Path, loaded_tokenizer: Path | None) -> str | None:
    """The sha256 of the tokenizer a checkpoint was trained with: its manifest's record, else the file's."""
    manifest = Path(checkpoint) / MANIFEST
    if manifest.is_file():
        recorded = Manifest.read(checkpoint).tokenizer_hash
        if recorded:
            return recorded
    if loaded_tokenizer is not None and loaded_tokenizer.is_file():
        return sha256_file(loaded_tokenizer)
    return None


def score(model: torch.nn.Module, held: HeldOut, batch_size: int, device: str) -> dict[str, Any]:
    """Loss, perplexity and bits per byte of `model` on the windows of `held`: the batches and the loss of the
    run's own validation (`window_batch`, `batch_loss`), reduced by `LossTotals`."""
    nbytes = torch.from_numpy(piece_bytes(held.data_dir / held.meta["tokenizer_path"], model.cfg.vocab_size))
    nbytes = nbytes.to(device)
    totals = LossTotals(device=device)
    batches = range(0, len(held.starts), batch_size)
    with torch.no_grad():
        for b in tqdm(batches, desc=f"evaluate {held.name}", disable=len(batches) < 4 or not sys.stderr.isatty()):
            batch = window_batch(held.tokens, held.starts[b:b + batch_size], held.seq_len + 1, held.document_starts)
            batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)
            totals.add_batch(batch_loss(model, batch), split_batch(batch)[0][:, 1:], nbytes)
    return {"set": held.name, "data": str(held.data_dir), "split": held.split, "seq_len": held.seq_len,
            "tokens": totals.tokens, "bytes": totals.nbytes, **totals.compute()}


def evaluate_sets(checkpoint: str | Path, data: list[str] | None = None, split: str = "val",
                  max_tokens: int | None = None, batch_size: int = 8, device: str | None = None,
                  log_to_run: bool = True) -> list[dict[str, Any]]:
    """Score one checkpoint on each `--data` set (None: the run's own validation windows)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_checkpoint(checkpoint, device=device)
    sets = plan_sets(parse_sets(data), loaded.run_config, loaded.model.cfg.max_seq_len,
                     checkpoint_tokenizer_sha256(checkpoint, loaded.tokenizer_path), str(checkpoint), split, max_tokens)
    results = [{"checkpoint": str(checkpoint), "step": loaded.step, **score(loaded.model, held, batch_size, device)}
               for held in sets]
    if log_to_run and loaded.run_dir is not None and loaded.step is not None:
        log_to_tensorboard(loaded.run_dir, results)
    return results


def evaluate(checkpoint: str | Path, data: str | Path | None = None, split: str = "val",
             max_tokens: int | None = None, batch_size: int = 8, device: str | None = None,
             log_to_run: bool = True) -> dict[str, Any]:
    """`evaluate_sets` on one set (`data`, or the run's own)."""
    return evaluate_sets(checkpoint, None if data is None else [str(data)], split, max_tokens, batch_size, device,
                         log_to_run)[0]


def log_to_tensorboard(run_dir: Path, results: list[dict[str, Any]]) -> None:
    """`eval/<set>/loss|ppl|bpb` at each result's step, in the run's own TensorBoard directory."""
    for result in results:
        write_scalars(run_dir, tags(f"eval/{result['set']}", result), result["step"])


def split_line(r: dict[str, Any]) -> str:
    name = r["split"] if r.get("set", r["split"]) == r["split"] else f"{r['set']} ({r['split']})"
    return (f"{name} loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f}, {r['bits_per_byte']:.4f} bits/byte "
            f"over {r['tokens']:,} tokens")

