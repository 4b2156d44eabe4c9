"""QK-clip (`optim.qk_clip: τ`), the weight clip of MuonClip (Kimi K2, arXiv 2507.20534, §2.1): after each optimizer
step, every attention head whose largest pre-softmax logit S_h in that step's forward exceeded τ gets its query
and key projections scaled so that the same inputs would give exactly τ:

    η_h = τ / S_h,     W_q^h ← η_h^α · W_q^h,     W_k^h ← η_h^(1−α) · W_k^h,     α = 1/2 (Kimi K2's)

(rows of the projection matrices, and of their biases where the model has them). The logit is q·k·s after RoPE, a
rotation, so it is bilinear in the two projections: the product of the two factors is η_h. Heads at or below τ
are untouched (K2 clips per head, not per layer).

Shared key heads (GQA, K < H key/value heads): K2's MLA has a key component shared by all heads (the rotary
k^R), and leaves it untouched so that clipping one head does not change the others, putting the whole factor on
the head-specific side (q^R ← η q^R). A GQA key head is shared by its H/K query heads likewise, so under GQA the
offending query head's rows take all of η_h and W_k is never scaled: each clipped head's logits scale by exactly
η_h, every other head's stay as they were. With K = H each head has its own key and gets √η_h on each side.

With QK-norm on the clip is refused (`check`): q and k are normalized after the projections, so scaling W_q and
W_k would be undone by the norm; what bounds the logits there is the norms' gains, and a per-head clip of those is
not possible with a `head` QK-norm, whose one gain vector every head shares (QK-norm itself is the logit
control: use one or the other). Under μP the logit is measured after μP's score scale (√D₀/D instead of 1/√D):
τ bounds the logits the softmax actually sees in either parametrization, and the scaling, which multiplies
weights, is the same. Other fields: the soft-cap (`attn_softcap`) acts after S is measured (τ bounds the logit
before the cap); a sink logit is not a key and is never scaled.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.config import ModelConfig

ALPHA = 0.5  # the query's share of log η (Kimi K2)


def check(tau: float | None, cfg: ModelConfig) -> None:
    """One ValueError line for a QK-clip this model cannot take."""
    if tau is None:
        return
    if not tau > 0:
        raise ValueError(f"optim.qk_clip={tau} must be a logit threshold τ > 0 (Kimi K2 used 100), or null for none")
    if cfg.qk_norm != "none":
        raise ValueError(f"optim.qk_clip with model.qk_norm={cfg.qk_norm!r}: the norm after the projections undoes "
                         "any scaling of W_q and W_k, and QK-norm already bounds the logits — use one of the two "
                         "(model.qk_norm none with optim.qk_clip, or optim.qk_clip null)")


def head_factors(max_logits: torch.Tensor, tau: float, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors (query rows per query head [H], key rows per key head [K]) from one layer's per-head max logits
    `max_logits` [H]: 1 where S_h ≤ τ; under GQA (K < H) the key factors are all 1 (module docstring)."""
    eta = torch.where(max_logits > tau, tau / max_logits, torch.ones_like(max_logits))
    if n_kv_heads == max_logits.numel():
        return eta ** ALPHA, eta ** (1 - ALPHA)
    return eta, torch.ones(n_kv_heads, dtype=eta.dtype, device=eta.device)


def scaled_rows(value: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """A projection's weight [heads·D, in] or bias [heads·D] with each head's D rows times its factor."""
    heads = factors.numel()
    shaped = value.reshape(heads, value.shape[0] // heads, -1)
    return (shaped * factors.to(value.dtype).view(heads, 1, 1)).reshape(value.shape)
