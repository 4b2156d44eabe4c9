"""Where the norm sits around a sublayer f (attention or MLP), and what scales the stream and the update.

Each placement's `formula(x, f)` is its one line of math, and `Block` never asks which placement it holds.
A placement names the norms it owns (`norms`, built by the base class; `norm_in` is the one the sublayer reads
through), and says whether the stack needs a final norm (`needs_final_norm`). Adding a placement is one subclass
and one entry in `PLACEMENTS`: the config's valid names, the parameter count, the final norm and the
registry-driven tests follow from it. A block holds one placement per sublayer (`ModelConfig.sublayer_placements`:
`placement`, `placement_mlp`, Mix-LN's post-norm lower layers).

Every placement carries three scalars, each the identity (and no op at all) by default, written into its formula:
- α (`residual_scale`), the stream term α·x: DeepNet's DeepNorm (Wang et al. 2022, arXiv 2203.00555);
- g (`branch_scale`), a learnable scalar or per-channel vector on the update before it joins the stream:
  ReZero (Bachlechner et al. 2020) / SkipInit (De & Smith 2020) with a scalar from 0, LayerScale (Touvron et
  al. 2021, "Going deeper with Image Transformers") with a vector from a small ε;
- s (`norm_depth_scale`) on what the sublayer reads through `norm_in`: LayerNorm Scaling's 1/√l for layer l
  (1-based; Sun et al. 2025, "The Curse of Depth", arXiv 2502.05795, applied to both pre-norms of a layer as in the
  authors' code). It is a plain Python float, not a buffer: `to_empty` after a meta-device build wipes buffers
  (OLMo-core PR #698), while attributes survive it.

The residual add is deferred across sublayers and blocks: the stream travels as a `Stream(x, pending)`
whose value is `x + pending`, so the next norm can fuse the add (the kernel returns (N(x + y), x + y) from
one read of the stream). `forward(stream, f)` is that fused form; by default it adds the pending update
and applies `formula`, and pre and sandwich override it to fuse.

`param_kinds` ({parameter attribute: kind}) tells the optimizer which parameters form a group of their own:
`branch_scale` (its own learning rate and no weight decay; a scalar or vector never goes to Muon). An attribute
that is None (no branch scale) is no parameter and has no kind.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from model.norms import Norm, build_norm

if TYPE_CHECKING:
    from model.config import ModelConfig

Sublayer = Callable[[torch.Tensor], torch.Tensor]
BRANCH_SCALES = ("none", "scalar", "vector")


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
    """One sublayer's norms and scalars. `sublayer` ("attn" or "mlp") picks the norms' per-location settings."""

    norms: tuple[str, ...] = ()  # the norms it owns; `norm_in` is the one the sublayer reads through
    needs_final_norm: bool = True  # False when the last block's output is already normalized
    adds_to_stream: bool = True  # output = α·input + update; False when the stream is renormalized (post)
    param_kinds = {"branch_scale": "branch_scale"}

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, sublayer: str = "attn") -> None:
        super().__init__()
        for name in self.norms:
            setattr(self, name, build_norm(cfg, where=sublayer))
        self.residual_scale = cfg.residual_alpha  # α
        self.depth_scale = 1 / math.sqrt(layer_id + 1) if cfg.norm_depth_scale else 1.0  # s
        shape = {"none": None, "scalar": (), "vector": (cfg.dim,)}[cfg.branch_scale]
        self.branch_scale = None if shape is None else nn.Parameter(torch.empty(shape))  # g
        self.branch_scale_init = cfg.branch_scale_init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.branch_scale is not None:
            nn.init.constant_(self.branch_scale, self.branch_scale_init)

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """α·x, the stream term (x itself when α = 1)."""
        return x if self.residual_scale == 1.0 else self.residual_scale * x

    def branch(self, update: torch.Tensor) -> torch.Tensor:
        """g·update, the update as it joins the stream (itself without a branch scale)."""
        return update if self.branch_scale is None else self.branch_scale * update

    def read(self, h: torch.Tensor) -> torch.Tensor:
        """s·h, what the sublayer reads from its pre-norm `norm_in` (h itself without LayerNorm Scaling)."""
        return h if self.depth_scale == 1.0 else h * self.depth_scale

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        """The stream after this sublayer, from the stream `x` before it: the placement's one line of math."""
        raise NotImplementedError

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        """`formula` on a deferred stream; a placement that starts with a norm overrides it to fuse the add."""
        return Stream(self.formula(stream.value(), f))


class PreNorm(Placement):
    """α·x + g·f(s·N(x)) — GPT-2, Llama, Qwen3. The stream itself is never normalized, so it grows with depth."""

    norms = ("norm_in",)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.skip(x) + self.branch(f(self.read(self.norm_in(x))))

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        h, x = stream.normalized(self.norm_in)
        return Stream(self.skip(x), self.branch(f(self.read(h))))  # the add is left to the next norm


class PostNorm(Placement):
    """N(α·x + g·f(x)) — the original Transformer, BERT; DeepNorm with α = (2L)^¼. The stream is renormalized
    after every sublayer."""

    norms = ("norm_out",)
    needs_final_norm = False
    adds_to_stream = False

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.norm_out(self.skip(x) + self.branch(f(x)))


class SandwichNorm(Placement):
    """α·x + g·N2(f(s·N1(x))) — Gemma 2/3, CogView, Peri-LN: pre-norm plus a norm on the sublayer output."""

    norms = ("norm_in", "norm_out")

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.skip(x) + self.branch(self.norm_out(f(self.read(self.norm_in(x)))))

    def forward(self, stream: Stream, f: Sublayer) -> Stream:
        h, x = stream.normalized(self.norm_in)
        return Stream(self.skip(x), self.branch(self.norm_out(f(self.read(h)))))


class OutputNorm(Placement):
    """α·x + g·N(f(x)) — OLMo 2 ("reordered norm"): the sublayer reads the raw stream, its update is normalized."""

    norms = ("norm_out",)

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.skip(x) + self.branch(self.norm_out(f(x)))


class NoNorm(Placement):
    """α·x + g·f(x) — no norm around the sublayer: HybridNorm's MLP once the norm it reads through is counted as
    the attention's post-norm (Zhuo et al. 2025; docs/research-options.md), or ReZero's x + g·f(x) (with
    `branch_scale: scalar`, init 0)."""

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.skip(x) + self.branch(f(x))


PLACEMENTS: dict[str, type[Placement]] = {
    "pre": PreNorm,
    "post": PostNorm,
    "sandwich": SandwichNorm,
    "output": OutputNorm,
    "none": NoNorm,
}
