"""`normlab evaluate`: loss, perplexity and bits per byte of a saved checkpoint on held-out tokens.

By default it evaluates exactly the validation windows the run itself validated on (same data directory,
sequence length and window starts), so its loss equals the run's logged `val/loss` at that step. The numbers go
to a JSON file and into the run's TensorBoard (`eval/<split>/loss|ppl|bpb` at the checkpoint's step).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.dataset import gather, val_starts
from data.meta import load_tokenizer, open_tokens, read_meta
from data.tokenizer import sha256_file
from training.checkpoint import write_text_atomic
from training.errors import report
from training.loading import CheckpointError, load_checkpoint

log = logging.getLogger(__name__)


def piece_bytes(tokenizer_path: Path, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte pieces 1, special/control pieces such as EOS 0)."""
    out = np.zeros(vocab_size, dtype=np.int64)
    per_id = load_tokenizer(tokenizer_path).piece_bytes()[:vocab_size]
    out[:len(per_id)] = per_id
    return out


def evaluate(checkpoint: str | Path, data: str | Path | None = None, split: str = "val",
             max_tokens: int | None = None, batch_size: int = 8, device: str | None = None,
             log_to_run: bool = True) -> dict[str, Any]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_checkpoint(checkpoint, device=device)
    data_dir = Path(data) if data is not None else loaded.data_path
    if data_dir is None:
        raise CheckpointError(f"'{checkpoint}' does not record its data directory; pass --data DIR")
    meta = read_meta(data_dir)
    if meta is None:
        raise CheckpointError(f"no prepared data at '{data_dir}' (no meta.json); run `normlab prepare` or pass --data")
    if loaded.tokenizer_path is not None and loaded.tokenizer_path.is_file():
        if sha256_file(loaded.tokenizer_path) != meta["tokenizer_sha256"]:
            raise CheckpointError(
                f"'{data_dir}' was prepared with a different tokenizer (sha256 {meta['tokenizer_sha256'][:12]}…) than "
                f"the one '{checkpoint}' was trained with ({loaded.tokenizer_path}); evaluate on data prepared with "
                f"`normlab prepare --tokenizer {loaded.tokenizer_path}`")
    if split not in meta["splits"]:
        raise CheckpointError(f"split {split!r} is not in '{data_dir}'; choose one of {sorted(meta['splits'])}")
    model = loaded.model
    run_data = loaded.run_config.get("data") or {}
    seq_len = min(int(run_data.get("seq_len") or model.cfg.max_seq_len), model.cfg.max_seq_len)
    tokens = open_tokens(data_dir, meta, split)
    if max_tokens is not None:
        n_windows = max(1, max_tokens // seq_len)
    elif run_data.get("val_batches") and run_data.get("batch_size"):  # the run's own validation set
        n_windows = int(run_data["val_batches"]) * int(run_data["batch_size"])
    else:
        n_windows = min(128, max(1, (len(tokens) - 1) // seq_len))
    starts = val_starts(len(tokens), seq_len, n_windows)
    nbytes = piece_bytes(data_dir / meta["tokenizer_path"], model.cfg.vocab_size)

    total, count, total_bytes = 0.0, 0, 0
    batches = range(0, len(starts), batch_size)
    with torch.no_grad():
        for b in tqdm(batches, desc="evaluate", disable=len(batches) < 4 or not sys.stderr.isatty()):
            window = gather(tokens, starts[b:b + batch_size], seq_len + 1)
            x = torch.from_numpy(window).to(device)
            logits = model(x[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
            total_bytes += int(nbytes[window[:, 1:]].sum())
    loss = total / count
    result = {
        "checkpoint": str(checkpoint), "step": loaded.step, "data": str(data_dir), "split": split,
        "seq_len": seq_len, "tokens": count, "bytes": total_bytes, "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "bits_per_byte": loss / math.log(2) * count / max(total_bytes, 1),
    }
    if log_to_run and loaded.run_dir is not None and loaded.step is not None:
        _log_to_tensorboard(loaded.run_dir, split, result)
    return result


def _log_to_tensorboard(run_dir: Path, split: str, result: dict[str, Any]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir)) as writer:
        for key, tag in (("loss", "loss"), ("perplexity", "ppl"), ("bits_per_byte", "bpb")):
            writer.add_scalar(f"eval/{split}/{tag}", result[key], result["step"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a step directory, a .ckpt/.pt/.safetensors file or an export")
    ap.add_argument("--data", default=None, help="prepared data directory (default: the run's own)")
    ap.add_argument("--split", default="val", help="which split to evaluate (default: val)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="evaluate about this many tokens, spread over the split (default: the run's validation set)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--output", type=Path, default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    try:
        result = evaluate(args.checkpoint, args.data, args.split, args.max_tokens, args.batch_size, args.device)
    except (CheckpointError, ValueError) as err:
        return report("evaluate", err)
    if args.output:
        write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(f"step {result['step']}: {split_line(result)}")
    return 0


def split_line(r: dict[str, Any]) -> str:
    return (f"{r['split']} loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f}, {r['bits_per_byte']:.4f} bits/byte "
            f"over {r['tokens']:,} tokens")


if __name__ == "__main__":
    raise SystemExit(main())
