"""`normlab generate`: continue a prompt with a saved model (KV-cached sampling from model/generate.py)."""
from __future__ import annotations

import argparse
import sys

import torch

from model.generate import generate
from training.loading import CheckpointError, load_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab generate", description=__doc__)
    ap.add_argument("--checkpoint", required=True, help="a step directory, a state-dict file or an export")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        loaded = load_checkpoint(args.checkpoint, device=device)
        if loaded.tokenizer_path is None or not loaded.tokenizer_path.is_file():
            raise CheckpointError(f"no tokenizer found for '{args.checkpoint}' (its run's data directory or an "
                                  "exported tokenizer.model / tokenizer.json)")
    except CheckpointError as err:
        print(f"normlab generate: error: {err}", file=sys.stderr)
        return 2
    from data.meta import load_tokenizer

    tok = load_tokenizer(loaded.tokenizer_path)
    ids = tok.encode_batch([args.prompt])[0]
    prompt = torch.tensor([ids or [tok.bos_id if tok.bos_id >= 0 else tok.eos_id]], device=device)
    room = loaded.model.cfg.max_seq_len - prompt.shape[1]
    if room <= 0:
        print(f"normlab generate: error: the prompt is {prompt.shape[1]} tokens, the model's max_seq_len is "
              f"{loaded.model.cfg.max_seq_len}", file=sys.stderr)
        return 2
    g = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(loaded.model, prompt, min(args.max_new_tokens, room), temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, eos_id=tok.eos_id, generator=g)
    new = [t for t in out[0, prompt.shape[1]:].tolist() if t != tok.eos_id]
    print(args.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
