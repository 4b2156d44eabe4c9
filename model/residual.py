"""Where the norm sits around a sublayer f (attention or MLP): a registry of placements.

Each placement is a tiny strategy object whose `forward(x, f)` is its one line of math. `Block` never
asks which placement it holds, and whether the stack needs a final norm is a property of the placement.

`forward_deferred` computes the same thing with the residual add of the previous sublayer ("pending")
postponed, so it can be fused into this placement's first norm: the kernel returns (N(x + y), x + y) from
one read of the stream. Pre and sandwich do this; the others add first and fall back to `forward`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from model.norms import build_norm

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class Placement(nn.Module):
    needs_final_norm: bool = True  # False when the last block's output is already normalized
    adds_to_stream: bool = True  # output = input + update; False when the stream is renormalized (post)

    def forward(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        raise NotImplementedError

    def forward_deferred(self, x: torch.Tensor, pending: torch.Tensor | None, f: Sublayer):
        """Returns (stream, pending): the stream after this sublayer is `stream + pending`."""
        if pending is not None:
            x = x + pending
        return self.forward(x, f), None


class PreNorm(Placement):
    """x + f(N(x)) — GPT-2, Llama, Qwen3. The stream itself is never normalized, so it grows with depth."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm_in = build_norm(cfg)

    def forward(self, x, f):
        return x + f(self.norm_in(x))

    def forward_deferred(self, x, pending, f):
        h, x = (self.norm_in(x), x) if pending is None else self.norm_in(pending, residual=x)
        return x, f(h)


class PostNorm(Placement):
    """N(x + f(x)) — the original Transformer, BERT. The stream is renormalized after every sublayer."""

    needs_final_norm = False
    adds_to_stream = False

    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm_out = build_norm(cfg)

    def forward(self, x, f):
        return self.norm_out(x + f(x))


class SandwichNorm(Placement):
    """x + N2(f(N1(x))) — Gemma 2/3, CogView: pre-norm plus a norm on the sublayer output."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm_in, self.norm_out = build_norm(cfg), build_norm(cfg)

    def forward(self, x, f):
        return x + self.norm_out(f(self.norm_in(x)))

    def forward_deferred(self, x, pending, f):
        h, x = (self.norm_in(x), x) if pending is None else self.norm_in(pending, residual=x)
        return x, self.norm_out(f(h))


class OutputNorm(Placement):
    """x + N(f(x)) — OLMo 2 ("reordered norm"): the sublayer reads the raw stream, its update is normalized."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm_out = build_norm(cfg)

    def forward(self, x, f):
        return x + self.norm_out(f(x))


PLACEMENTS: dict[str, type[Placement]] = {
    "pre": PreNorm,
    "post": PostNorm,
    "sandwich": SandwichNorm,
    "output": OutputNorm,
}
