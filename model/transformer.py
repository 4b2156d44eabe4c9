"""The decoder: token embedding → n_layers blocks → optional final norm → LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import DocumentMask, LayerCache
from model.block import Block
from model.config import ModelConfig
from model.init import init_std, init_weights
from model.layers import Embedding, Linear
from model.loss import fused_linear_cross_entropy, softcap_logits
from model.mup import output_mult
from model.norms import build_norm
from model.residual import Stream
from model.rope import rope_cos_sin, rope_cos_sin_at


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim, init_std(cfg, "embed"))
        # h₀ = N(s·E[t]): Gemma's √dim multiplier s, then BLOOM's / OLMo-core's embedding norm (OLMo-core's order)
        self.embed_scale = cfg.embed_multiplier
        self.embed_norm = build_norm(cfg, where="final") if cfg.embed_norm else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Pre-norm leaves the stream unnormalized, so it needs a final norm before the head; post-norm doesn't.
        self.norm = build_norm(cfg, where="final") if cfg.has_final_norm else None
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, False, init_std(cfg, "head"))
        self.activation_checkpointing = False  # recompute each block in backward (set by model.optimize)

    def init_weights(self) -> None:
        """Re-draw every parameter (e.g. after `to_empty` on a model built on the meta device)."""
        init_weights(self)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def new_cache(self, batch: int, max_len: int | None = None) -> list[LayerCache]:
        """Empty per-layer key/value caches for incremental decoding (see model/generate.py)."""
        p = self.head_weight
        return [LayerCache(batch, self.cfg.kv_heads, max_len or self.cfg.max_seq_len, self.cfg.head_dim, p.device,
                           p.dtype) for _ in self.layers]

    def hidden_states(self, tokens: torch.Tensor, cache: list[LayerCache] | None = None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [B, T, dim] (after the final norm) for tokens [B, T].

        With `cache`, tokens continue the cached sequence: positions start at the cached length. With
        `position_ids` [B, T] (document masking: 0 where each document of a packed window starts, counting up
        within it), each token attends only to its own document and RoPE uses these positions — each document
        gets what it would get alone. Not with `cache`.
        """
        B, T = tokens.shape
        start = cache[0].length if cache else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds ModelConfig.max_seq_len={self.cfg.max_seq_len}")
        doc_mask = None
        if position_ids is None:
            cos, sin = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, tokens.device, start=start,
                                    scaling=self.cfg.rope_scaling)
        else:
            if position_ids.shape != tokens.shape:
                raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of tokens {(B, T)}")
            cos, sin = rope_cos_sin_at(position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
            doc_mask = DocumentMask.from_positions(position_ids, self.cfg.attn_softcap)
        stream = Stream(self.embed(tokens))
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and torch.is_grad_enabled():
                stream = checkpoint(layer, stream, cos, sin, None, doc_mask, use_reentrant=False)
            else:
                stream = layer(stream, cos, sin, cache[i] if cache else None, doc_mask)
        if self.norm is None:
            return stream.value()
        return stream.normalized(self.norm)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The stream entering the first block [B, T, dim]: N(s·E[tokens]), s and N only where configured."""
        h = self.tok_embeddings(tokens)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        return h if self.embed_norm is None else self.embed_norm(h)

    def forward(self, tokens: torch.Tensor, cache: list[LayerCache] | None = None,
                targets: torch.Tensor | None = None, loss_chunk_size: int = 1024, z_loss: float = 0.0,
                return_z_loss: bool = False, position_ids: torch.Tensor | None = None):
        """Logits [B, T, vocab_size] for tokens [B, T] (soft-capped when `cfg.logit_softcap`); or, given targets
        [B, T], the mean cross-entropy, computed in chunks so the full logits are never materialized (see
        model/loss.py), plus `z_loss` · mean(log²Z) — with `return_z_loss`, (loss, that term). `position_ids`
        [B, T]: document masking (see `hidden_states`); the loss stays the mean over every target token."""
        h = self.hidden_states(tokens, cache, position_ids)
        if self.cfg.parametrization == "mup":  # μP's readout multiplier: logits = W h / m (model/mup.py)
            h = h * output_mult(self.cfg)
        if targets is None:
            return softcap_logits(F.linear(h, self.head_weight), self.cfg.logit_softcap)
        return fused_linear_cross_entropy(h, self.head_weight, targets, loss_chunk_size, z_loss=z_loss,
                                          softcap=self.cfg.logit_softcap, return_z_loss=return_z_loss)
