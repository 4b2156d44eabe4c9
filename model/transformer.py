"""The decoder: token embedding → n_layers blocks → optional final norm → LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.block import Block
from model.config import ModelConfig
from model.init import init_std, init_weights
from model.layers import Embedding, Linear
from model.norms import build_norm
from model.rope import rope_cos_sin


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim, init_std(cfg, "embed"))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Pre-norm leaves the stream unnormalized, so it needs a final norm before the head; post-norm doesn't.
        self.norm = build_norm(cfg) if cfg.has_final_norm else None
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, False, init_std(cfg, "head"))
        self.recorder = None  # a model.probes.Recorder while metrics are being collected

    def init_weights(self) -> None:
        """Re-draw every parameter (e.g. after `to_empty` on a model built on the meta device)."""
        init_weights(self)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states [B, T, dim] (after the final norm) for tokens [B, T]."""
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds ModelConfig.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        x, pending = self.tok_embeddings(tokens), None
        if self.recorder is not None:  # metrics step: plain placement math, every intermediate observed
            for layer in self.layers:
                x = layer.forward_observed(x, cos, sin, self.recorder)
            self.recorder.final(x)
            return x if self.norm is None else self.norm(x)
        for layer in self.layers:
            x, pending = layer.forward_deferred(x, pending, cos, sin)
        if self.norm is not None:
            return self.norm(x) if pending is None else self.norm(pending, residual=x)[0]
        return x if pending is None else x + pending

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab_size] for tokens [B, T]."""
        return F.linear(self.hidden_states(tokens), self.head_weight)
