"""Autoregressive sampling with a key/value cache: greedy, temperature, top-k and top-p (nucleus)."""
from __future__ import annotations

import torch

from model.transformer import Transformer


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]. temperature 0 means greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             use_cache: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue `prompt` [B, T] by up to `max_new_tokens`; returns prompt + continuation [B, T + n].

    `use_cache=False` recomputes the whole prefix every step (the reference the cached path is tested against).
    Generation stops early once every sequence has produced `eos_id`.
    """
    if prompt.shape[1] + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={model.cfg.max_seq_len}")
    tokens = prompt
    cache = model.new_cache(prompt.shape[0]) if use_cache else None
    step_input = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model(step_input, cache) if use_cache else model(tokens)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(done, eos_id)
            done |= nxt == eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        step_input = nxt[:, None]
        if eos_id is not None and done.all():
            break
    return tokens
