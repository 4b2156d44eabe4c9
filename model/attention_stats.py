"""Softmax statistics of sampled query rows, from the softmax the model computes (the health probes' attention
half, model/probes.py).

The probabilities are recomputed from post-RoPE q and k with the attention module's own score scale, soft-cap,
mask and sink logits (`Attention.scale`, `.softcap`, `.sink`). With a sink (`attn_sink`) the softmax has one
more outcome, the explicit sink, so the probabilities on real keys sum to less than 1. The statistics read that
sunk softmax:

- `max_prob`, `saturated_frac`: the largest probability on a real key. A row that sends its mass to the explicit
  sink is therefore not saturated on a key.
- `entropy`: over every outcome of the model's softmax, so with a sink that is the visible keys plus the sink.
  It is normalized by log of the number of outcomes, so a uniform softmax gives 1.
- `sink_logit_mass` (only with a sink): the explicit sink's share, 1 − Σ p on the keys.
- `sink_mass` (`sink_mass`): the probability on key 0, or on the document's first token: the implicit sink
  of Xiao et al. 2023, which an explicit sink is meant to replace.
- `max_logit`: the largest q·k·s over real keys, before any soft-cap. A sink logit is a parameter, not a score,
  and is not included.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from model.attention import visible_keys


class AttentionRows(NamedTuple):
    """The softmax of sampled query rows as the model computes it. `logits` [B, H, R, T]: q·k·scale, fp32, before
    any softcap; `probs` [B, H, R, T]: the softmax of the (capped) scores over the visible keys (and the sink);
    `visible` [B, R, T]: the keys each row sees (causal, or its own document's); `valid` [B, R]: rows that see
    more than one key (a row that sees only itself is saturated by construction); `sink` [B, H, R]: the explicit
    sink's probability, None without one."""

    logits: torch.Tensor
    probs: torch.Tensor
    visible: torch.Tensor
    valid: torch.Tensor
    sink: torch.Tensor | None = None


def attention_rows(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, rows: torch.Tensor, scale: float,
                   softcap: float | None = None, doc_ids: torch.Tensor | None = None,
                   sink: torch.Tensor | None = None) -> AttentionRows:
    """Recompute the attention probabilities of the query positions `rows` from post-RoPE q [B,H,T,D] and k
    [B,K,T,D]. `scale`, `softcap` and `sink` [H] (sink logits) must be the attention module's own
    (`Attention.scale`, `Attention.softcap`, `Attention.sink`), so the probes describe the softmax the model
    computes — under μP or an explicit head_dim the scale is not 1/√D. With `doc_ids` [B, T] (document masking) a
    row sees only its own document, as in training."""
    q = q_BHTD.detach().float()[:, :, rows]  # [B, H, R, D]
    k = k_BKTD.detach().float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: query head h reads kv head h // (H/K)
    logits = q @ k.transpose(-1, -2) * scale  # [B, H, R, T]
    B, T = k.shape[0], k.shape[2]
    if doc_ids is None:
        visible = (torch.arange(T, device=q.device)[None, :] <= rows[:, None]).expand(B, -1, -1)  # causal
    else:
        visible = visible_keys(doc_ids)[:, rows]  # the sampled rows of training's own mask
    scores = logits if softcap is None else softcap * torch.tanh(logits / softcap)  # what the softmax sees
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sink is None:
        return AttentionRows(logits, scores.softmax(-1), visible, visible.sum(-1) > 1)
    column = sink.detach().float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, column], -1).softmax(-1)
    return AttentionRows(logits, probs[..., :-1], visible, visible.sum(-1) > 1, probs[..., -1])


def attention_stats(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, rows: torch.Tensor, scale: float,
                    threshold: float = 0.99, softcap: float | None = None, doc_ids: torch.Tensor | None = None,
                    sink: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Softmax statistics per head for the query positions `rows` (see `attention_rows` for the arguments).

    Returns per-head tensors [H]: `max_prob` (mean over rows of the largest probability on a key), `entropy`
    (normalized by log of the number of outcomes — visible keys, plus the sink when there is one — so a uniform
    softmax gives 1), `saturated_frac` (fraction of rows whose largest probability on a key ≥ threshold),
    `max_logit` (the largest scaled pre-softmax logit) and, with `sink`, `sink_logit_mass` (mean probability on
    the explicit sink). Means are over the (batch, row) pairs that see more than one key: row 0, and under
    document masking a document's first token, see only themselves and are left out. With `softcap` the
    probabilities are those of the capped scores, as in training; `max_logit` stays the uncapped score, so it
    shows what the cap is holding back.
    """
    rows = rows[rows > 0]
    if rows.numel() == 0:
        raise ValueError("attention_stats needs at least one query row past position 0")
    a = attention_rows(q_BHTD, k_BKTD, rows, scale, softcap, doc_ids, sink)
    if not a.valid.any():
        raise ValueError("attention_stats: no sampled query row sees more than one key of its document")
    outcomes = a.visible.sum(-1)  # [B, R]
    ent = -(a.probs * a.probs.clamp_min(1e-30).log()).sum(-1)  # [B, H, R]
    if a.sink is not None:  # the sink is one more outcome of the same softmax
        ent = ent - a.sink * a.sink.clamp_min(1e-30).log()
        outcomes = outcomes + 1
    pmax = a.probs.amax(-1)  # [B, H, R]
    weight = a.valid[:, None].float() / a.valid.sum()  # [B, 1, R]: mean over the valid (b, row) pairs
    shown = a.visible & a.valid[..., None]
    stats = {
        "max_prob": (pmax * weight).sum((0, 2)),
        "entropy": (ent / outcomes.clamp_min(2).float().log()[:, None] * weight).sum((0, 2)),
        "saturated_frac": ((pmax >= threshold).float() * weight).sum((0, 2)),
        "max_logit": a.logits.masked_fill(~shown[:, None], float("-inf")).amax((0, 2, 3)),
    }
    if a.sink is not None:
        stats["sink_logit_mass"] = (a.sink * weight).sum((0, 2))
    return stats


def sink_mass(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, rows: torch.Tensor, scale: float,
              softcap: float | None = None, doc_ids: torch.Tensor | None = None,
              sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probability on the sink key (the "attention sink", Xiao et al. 2023) per head [H]: the mean over
    the batch and the query positions `rows` of the probability at key 0, from the softmax the model computes
    (`attention_rows`: its scale, softcap, mask and sink logits). Row 0 sees only key 0 (probability 1 by
    construction, less with an explicit sink) and is left out, as are rows past the sequence. With `doc_ids` [B, T]
    (document masking) a row sees its own document only and its sink is that document's first token; a document's
    first token sees only itself and is left out like row 0.
    """
    T = k_BKTD.shape[2]
    rows = rows[(rows > 0) & (rows < T)]
    if rows.numel() == 0:
        raise ValueError("sink_mass needs at least one query row past position 0")
    a = attention_rows(q_BHTD, k_BKTD, rows, scale, softcap, doc_ids, sink)
    if not a.valid.any():
        raise ValueError("sink_mass needs at least one query row that sees a key besides its sink")
    first = a.visible.float().argmax(-1)  # [B, R]: the first key a row sees — 0, or its document's first token
    at_first = a.probs.gather(-1, first[:, None, :, None].expand(-1, a.probs.shape[1], -1, 1)).squeeze(-1)
    valid = a.valid.float()[:, None]  # [B, 1, R]
    return (at_first * valid).sum((0, 2)) / valid.sum((0, 2))
