"""`normlab generate`: continue a prompt with a saved model (KV-cached sampling from model/generate.py)."""
from __future__ import annotations

import argparse
import math

import torch

from model.generate import generate
from training.checkpointing.load import load_checkpoint
from training.errors import CheckpointError, UserError


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse a sampling argument that would be silently meaningless, naming the flag and its valid range."""
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens {args.max_new_tokens} must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature} must be a finite number >= 0 (0 = greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top_k {args.top_k} must be at least 1 (or leave it out: no top-k cut)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p} must be in (0, 1] (or leave it out: no nucleus cut)")
    if args.device not in (None, "cpu") and not args.device.startswith("cuda"):
        raise UserError(f"--device {args.device!r} is not cpu or cuda[:N]")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device is available here; use --device cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab generate", description=__doc__)
    ap.add_argument("--checkpoint", required=True, help="a step directory, a state-dict file or an export")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max_new_tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top_k", type=int, default=None, help="sample from the k most likely tokens (k >= 1)")
    ap.add_argument("--top_p", type=float, default=None, help="nucleus sampling, 0 < p <= 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    args = ap.parse_args(argv)
    check_sampling(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_checkpoint(args.checkpoint, device=device)
    if loaded.tokenizer_path is None or not loaded.tokenizer_path.is_file():
        raise CheckpointError(f"no tokenizer found for '{args.checkpoint}' (its run's data directory or an "
                              "exported tokenizer.model / tokenizer.json)")
    from data.layout import load_tokenizer

    tok = load_tokenizer(loaded.tokenizer_path)
    ids = tok.encode_batch([args.prompt])[0]
    prompt = torch.tensor([ids or [tok.bos_id if tok.bos_id >= 0 else tok.eos_id]], device=device)
    room = loaded.model.cfg.max_seq_len - prompt.shape[1]
    if room <= 0:
        raise UserError(f"the prompt is {prompt.shape[1]} tokens, the model's max_seq_len is "
                        f"{loaded.model.cfg.max_seq_len}; shorten --prompt")
    g = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(loaded.model, prompt, min(args.max_new_tokens, room), temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, eos_id=tok.eos_id, generator=g)
    new = [t for t in out[0, prompt.shape[1]:].tolist() if t != tok.eos_id]
    print(args.prompt + tok.decode(new))
    return 0
