"""Where the norm sits around a sublayer f (attention or MLP): a registry of placements.

Each placement's `formula(x, f)` is its one line of math, and `Block` never asks which placement it holds.
A placement also says how many norms it owns (`n_norms`, for the parameter count) and whether the stack
needs a final norm (`needs_final_norm`). Adding a placement is one subclass and one entry in `PLACEMENTS`:
the config's valid names, the parameter count, the final norm and the registry-driven tests follow from it.

The residual add is deferred across sublayers and blocks: the stream travels as a `Stream(x, pending)`
whose value is `x + pending`, so the next norm can fuse the add (the kernel returns (N(x + y), x + y) from
one read of the stream). `forward(stream, f)` is that fused form; by default it adds the pending update
and applies `formula`, and pre and sandwich override it to fuse.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from model.norms import Norm, build_norm

if TYPE_CHECKING:
    from model.config import ModelConfig

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class Stream(NamedTuple):
    """The residual stream [B, T, dim] with its last add deferred: its value is `x + pending`.

    This is what a `Block` takes and returns (and what a forward hook on a block sees); `value()` is the
    stream itself.
    """

    x: torch.Tensor
    pending: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        return self.x if self.pending is None else self.x + self.pending

    def normalized(self, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(N(value), value), the pending add fused into the norm when there is one."""
        return (norm(self.x), self.x) if self.pending is None else norm(self.pending, residual=self.x)


class Placement(nn.Module):
    n_norms: int  # norms one placement owns (it wraps one sublayer; a block holds two)
    needs_final_norm: bool = True  # False when the last block's output is already normalized
    adds_to_stream: bool = True  # output = input + update; False when the stream is renormalized (post)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        """The stream after this sublayer, from the stream `x` before it: the placement's one line of math."""
        raise NotImplementedError

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        """`formula` on a deferred stream; a placement that starts with a norm overrides it to fuse the add."""
        return Stream(self.formula(stream.value(), f))


class PreNorm(Placement):
    """x + f(N(x)) — GPT-2, Llama, Qwen3. The stream itself is never normalized, so it grows with depth."""

    n_norms = 1

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_in = build_norm(cfg)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return x + f(self.norm_in(x))

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        h, x = stream.normalized(self.norm_in)
        return Stream(x, f(h))  # the add x + f(h) is left to the next norm


class PostNorm(Placement):
    """N(x + f(x)) — the original Transformer, BERT. The stream is renormalized after every sublayer."""

    n_norms = 1
    needs_final_norm = False
    adds_to_stream = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_out = build_norm(cfg)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.norm_out(x + f(x))


class SandwichNorm(Placement):
    """x + N2(f(N1(x))) — Gemma 2/3, CogView: pre-norm plus a norm on the sublayer output."""

    n_norms = 2

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_in, self.norm_out = build_norm(cfg), build_norm(cfg)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return x + self.norm_out(f(self.norm_in(x)))

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        h, x = stream.normalized(self.norm_in)
        return Stream(x, self.norm_out(f(h)))


class OutputNorm(Placement):
    """x + N(f(x)) — OLMo 2 ("reordered norm"): the sublayer reads the raw stream, its update is normalized."""

    n_norms = 1

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_out = build_norm(cfg)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return x + self.norm_out(f(x))


PLACEMENTS: dict[str, type[Placement]] = {
    "pre": PreNorm,
    "post": PostNorm,
    "sandwich": SandwichNorm,
    "output": OutputNorm,
}
