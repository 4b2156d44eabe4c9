"""The attention softmax beyond softmax(q·k·s): soft-capped scores, a sink logit, and the exact per-head max logit.

Shapes: B batch, H query heads, K key/value heads, T queries, S keys, D head_dim; s is the score scale
(`Attention.scale`).

Sinks (`ModelConfig.attn_sink`) add one logit σ_h per head to the softmax's denominator, with a zero value:

    p_j = exp(s_j) / (exp(σ_h) + Σ_i exp(s_i)),     out = Σ_j p_j v_j

A head can therefore attend to nothing, and its probabilities on real keys sum to less than 1.
- `learnable`: σ_h is a logit learned per query head, as gpt-oss's `sinks` (transformers'
  `modeling_gpt_oss.eager_attention_forward` appends it to the scores as one more column and drops that column
  after the softmax). It starts at 0, which makes step 0 identical to `off_by_one`; HF's gpt-oss init draws
  N(0, init_std), which is 0 give or take a few hundredths.
- `off_by_one`: σ = 0, Miller's softmax₁ (2023, "Attention is off by one"): exp(s_j)/(1 + Σ exp(s_i)).

Under μP σ is a Θ(1) logit set beside Θ(1) scores, so it takes no width multiplier. Its kind
(`AttentionSink.param_kinds`) keeps it away from Muon and lets it have its own LR and weight decay.

SDPA has no sink term. `sdpa_with_sink` is exact with SDPA alone: one extra key with a zero value whose logit
is σ_h, carried by one extra feature. With q' = [q, σ_h/s], k' = [k, 0] and k_sink = [0, 1], q'·k'·s equals
q·k·s for every real key and σ_h for the sink. The value gets a zero feature too, because the CPU flash kernel
needs q, k and v to share one head dim; on CUDA the extra width is 8, for the flash kernel's alignment. The
sink key sits at position 0. Without a mask, a dummy query row at position 0 keeps SDPA's top-left causal
alignment, so row t+1 sees the sink and keys 0…t. With a mask (KV cache, document masking) the sink gets a
visible column instead. Every gradient, σ's included, comes from SDPA's own backward. The soft-cap's math path
(`math_attention`) adds σ as one more score column, as gpt-oss does. Cost: `scripts/bench_attn_sink.py`.

Parameter kinds: a module whose parameter is neither a matrix nor a norm gain declares it in a class attribute
`param_kinds: dict[str, str]`, mapping the parameter's attribute name to an optimizer-group kind. An instance
whose attribute is None has no such parameter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SINKS = ("none", "learnable", "off_by_one")


class AttentionSink(nn.Module):
    """The sink logits σ [H] of one attention layer: a learned parameter (`learnable`, init 0) or constant zeros
    (`off_by_one`, with no parameter and no buffer, so `to_empty` has nothing to wipe)."""

    param_kinds = {"logit": "attn_sink"}

    def __init__(self, n_heads: int, learnable: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.logit = nn.Parameter(torch.empty(n_heads)) if learnable else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.logit is not None:
            nn.init.zeros_(self.logit)  # σ = 0: softmax₁ at step 0

    def forward(self, like: torch.Tensor) -> torch.Tensor:
        """σ [H], fp32, on the device of `like`."""
        return self.logit.float() if self.logit is not None else like.new_zeros(self.n_heads, dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{self.n_heads}, learnable={self.logit is not None}"


def sdpa_with_sink(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, sink: torch.Tensor,
                   scale: float, mask: torch.Tensor | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention [B, H, T, D] with sink logits `sink` [H], by SDPA on one extra key and feature (module docstring).
    `mask`: True where a query sees a key, [T, S] or [B, 1, T, S]; None means causal with T == S."""
    B, H, T, D = q_BHTD.shape
    K = k_BKSD.shape[1]
    extra = 8 if q_BHTD.is_cuda else 1  # CUDA's flash kernel wants head dims in multiples of 8
    dummy = 1 if mask is None else 0
    col = (sink / scale).to(q_BHTD.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    q = F.pad(torch.cat([q_BHTD, col], -1), (0, extra - 1, dummy, 0))
    sink_key = k_BKSD.new_zeros(B, K, 1, D + extra)
    sink_key[..., D] = 1.0
    k = torch.cat([sink_key, F.pad(k_BKSD, (0, extra))], 2)
    v = F.pad(v_BKSD, (0, extra, 1, 0))
    if mask is not None:
        mask = F.pad(mask, (1, 0), value=True)  # every query sees the sink
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=enable_gqa)
    return out[:, :, dummy:, :D]


def math_attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, cap: float | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention [B, H, T, D] computed as plain math on the materialized [B, H, T, S] scores: soft-capped to
    c·tanh(s/c) before the softmax (Gemma 2) when `cap` is given, and with one more score column σ_h when `sink`
    [H] is given. `mask` is as in `sdpa_with_sink`. This is the price of `attn_softcap`: O(T²) memory and no
    flash kernel, because SDPA has no hook between the scores and the softmax."""
    H, K = q_BHTD.shape[1], k_BKSD.shape[1]
    k_BHSD = k_BKSD.repeat_interleave(H // K, dim=1)  # GQA: query head h reads kv head h // (H/K)
    v_BHSD = v_BKSD.repeat_interleave(H // K, dim=1)
    scores = (q_BHTD @ k_BHSD.transpose(-1, -2)).float() * scale  # [B, H, T, S]
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if mask is None:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is None:
        probs = scores.softmax(-1)
    else:
        column = sink.float().view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]  # the sink's share is dropped
    return probs.to(v_BHSD.dtype) @ v_BHSD


@torch.no_grad()
def max_logit_per_head(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                       budget: int = 1 << 20) -> torch.Tensor:
    """The exact maximum of q·k·s per query head [H] (fp32), taken over the batch, the queries and the keys each
    query sees. It is computed after the score scale and before any soft-cap; a sink logit is not a key and is
    not included. `mask` is as in `sdpa_with_sink`. It must be causal in the sense of every mask normlab builds:
    query t of T sees no key past S − T + t.

    The scores are computed in fp32, a chunk of queries at a time, so at most about `budget` of them exist at
    once (B·H·rows·S ≤ budget). A chunk reads only the keys its last row can see, and GQA reads each KV head in
    place, without repeating it per query head."""
    B, H, T, D = q_BHTD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    q = q_BHTD.detach().float().reshape(B, K, H // K, T, D)
    kT = k_BKSD.detach().float()[:, :, None].transpose(-1, -2)  # [B, K, 1, D, S]
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    mask = mask.view(-1, 1, 1, T, S)  # [B or 1, 1, 1, T, S]
    rows = max(1, budget // (B * H * S))
    best = torch.full((H,), float("-inf"), device=q.device)
    for start in range(0, T, rows):
        end, keys = min(start + rows, T), S - T + min(start + rows, T)  # the keys the chunk's last row can see
        scores = q[:, :, :, start:end] @ kT[..., :keys]  # [B, K, H/K, rows, keys]
        scores.masked_fill_(~mask[..., start:end, :keys], float("-inf"))
        best = torch.maximum(best, scores.amax((0, 3, 4)).flatten())
    return best * scale  # scale > 0, so max(s·x) = s·max(x)
