"""One Transformer block: attention then MLP, each wrapped by the configured norm placement."""
from __future__ import annotations

import torch
from torch import nn

from model.attention import Attention
from model.mlp import MLP
from model.residual import PLACEMENTS


class Block(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn, self.mlp = Attention(cfg, layer_id), MLP(cfg, layer_id)
        self.attn_res, self.mlp_res = PLACEMENTS[cfg.placement](cfg), PLACEMENTS[cfg.placement](cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn_res(x, lambda h: self.attn(h, cos, sin))
        return self.mlp_res(x, self.mlp)

    def forward_observed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rec) -> torch.Tensor:
        """`forward`, reporting the stream, each sublayer's input and its update to a probes.Recorder."""
        x_in = x
        for name, res, f in (("attn", self.attn_res, lambda h: self.attn(h, cos, sin)), ("mlp", self.mlp_res, self.mlp)):
            seen = {}

            def observed(h: torch.Tensor, f=f, seen=seen) -> torch.Tensor:
                seen["read"], seen["out"] = h, f(h)
                return seen["out"]

            new = res(x, observed)
            # What the sublayer adds to the stream; under post-norm the sum is renormalized, so it is f(x) itself.
            update = new - x if res.adds_to_stream else seen["out"]
            rec.sublayer(self.layer_id, name, stream=x, read=seen["read"], update=update)
            x = new
        rec.block(self.layer_id, x_in, x)
        return x

    def forward_deferred(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with the last residual add left pending, so the next norm can fuse it (see residual.py)."""
        x, pending = self.attn_res.forward_deferred(x, pending, lambda h: self.attn(h, cos, sin, cache))
        return self.mlp_res.forward_deferred(x, pending, self.mlp)
