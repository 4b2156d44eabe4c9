"""One Transformer block: attention then MLP, each wrapped by its norm placement (`cfg.sublayer_placements`)."""
from __future__ import annotations

import torch
from torch import nn

from model.attention import Attention, DocumentMask, LayerCache
from model.config import ModelConfig
from model.mlp import MLPS
from model.residual import PLACEMENTS, Stream


class Block(nn.Module):
    """stream → attention sublayer → MLP sublayer → stream.

    The stream comes in and goes out as a `Stream(x, pending)` (value x + pending): the last residual add is
    left for the next block's first norm to fuse (see model/residual.py). A forward hook on a block sees the
    `Stream` it returns; `output.value()` is the residual stream after the block.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn, self.mlp = Attention(cfg, layer_id), MLPS[cfg.mlp](cfg, layer_id)
        attn_res, mlp_res = cfg.sublayer_placements(layer_id)
        self.attn_res = PLACEMENTS[attn_res](cfg, layer_id, "attn")
        self.mlp_res = PLACEMENTS[mlp_res](cfg, layer_id, "mlp")

    def forward(self, stream: Stream, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                doc_mask: DocumentMask | None = None) -> Stream:
        stream = self.attn_res(stream, lambda h: self.attn(h, cos, sin, cache, doc_mask=doc_mask))
        return self.mlp_res(stream, self.mlp)
