"""QK-clip (`optim.qk_clip`, training/optim/qk_clip.py, training/callbacks/qk_clip.py) in real in-process fits of a
tiny LitLM: the per-step max logit it logs is the exact maximum over the whole training batch (a float64 computation
from the weights written here); with a tiny τ every later step's logits on the same batch are at most τ up to the
update's own change, with AdamW and with Muon; each clipped head lands exactly on τ and no other head moves, a
shared GQA key head is never scaled; τ = ∞ trains bit for bit as no clip; QK-norm is refused in one line. Its 2-rank
runs (ZeRO 1–3 against one process, Muon under DDP) are the reference runs of tests/test_training_deepspeed.py and
tests/test_ddp.py."""
from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from model.rope import rope_cos_sin
from training import health_tags as T
from training.callbacks.qk_clip import QKClip, clip
from training.lit_module import LitLM
from training.optim import OptimConfig

SEQ, BATCH = 12, 3
TOKENS = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _lit(optim: dict, **model) -> LitLM:
    torch.manual_seed(0)
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ,
                optim={"warmup_steps": 0, "lr": 3e-3, **optim}, **{"n_kv_heads": 4, **model})
    lit.configure_model()
    return lit


def _fit(lit: LitLM, tmp_path: Path, steps: int, callbacks: list) -> dict[int, dict[str, float]]:
    """`steps` updates on the same batch every step; the logged metrics by step."""
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                      callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(TOKENS.repeat(steps, 1), batch_size=BATCH))
    rows: dict[int, dict[str, float]] = {}
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return rows


def attention_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """What each layer's attention reads on the batch."""
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in model.layers]
    with torch.no_grad():
        model(TOKENS[:, :-1])
    for h in hooks:
        h.remove()
    return inputs


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's layout) of t [B, heads, T, D]."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin


def reference_max_logits(model: torch.nn.Module, inputs: list[torch.Tensor] | None = None) -> np.ndarray:
    """[L, H]: every head's largest q·k/√D over the batch's causal pairs, in float64 from the attention inputs
    (`inputs`, else this model's) and the projection weights (RoPE by rotate-half), not through the model's
    attention."""
    inputs = inputs or attention_inputs(model)
    cos, sin = (t.double() for t in rope_cos_sin(SEQ, model.cfg.head_dim, model.cfg.rope_theta))
    out = []
    for block, x in zip(model.layers, inputs, strict=True):
        attn, x = block.attn, x.double()
        torch.set_grad_enabled(False)
        H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = (x @ attn.q_proj.weight.double().T).view(BATCH, SEQ, H, D).transpose(1, 2)
        k = (x @ attn.k_proj.weight.double().T).view(BATCH, SEQ, K, D).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin).repeat_interleave(H // K, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), -math.inf)
        out.append(s.amax(dim=(0, 2, 3)).numpy())
        torch.set_grad_enabled(True)
    return np.stack(out)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_tiny_tau_holds_every_later_step_at_tau(tmp_path, name):
    lit = _lit({"name": name, "lr": 1e-6, "min_lr": 1e-7})  # an update that barely moves the logits
    start = reference_max_logits(lit.model)
    tau = float(np.quantile(start, 0.5))  # half of the heads start above it
    rows = _fit(lit, tmp_path, 4, [QKClip(tau)])
    assert rows[1][T.QK_CLIP_MAX_LOGIT] == pytest.approx(start.max(), rel=1e-5)  # exact, over the whole batch
    assert rows[1][T.QK_CLIP_HEADS] == (start > tau).sum() > 0
    # the same batch again: the step's forward runs on the weights the previous step updated, then clipped with
    # η from that step's own logits — so up to what the update itself changed (here ~1e-4 of a logit)
    assert all(rows[s][T.QK_CLIP_MAX_LOGIT] <= tau * (1 + 1e-3) for s in (2, 3, 4)), rows
    assert rows[4][T.QK_CLIP_MAX_LOGIT] == pytest.approx(tau, rel=1e-3)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_clipped_heads_land_on_tau_and_nothing_else_moves(kv_heads):
    """Without an optimizer step in between, each layer on the inputs it had: each head over τ ends exactly at τ,
    the others keep their logits; with its own key heads (MHA) the key rows take √η, a GQA key head shared by two
    query heads is not touched. (A layer's clip changes what the layers above it read, as any update does.)"""
    model = _lit({}, n_kv_heads=kv_heads).model
    inputs = attention_inputs(model)
    before = reference_max_logits(model, inputs)
    tau = float(np.quantile(before, 0.4))
    k_before = [b.attn.k_proj.weight.detach().clone() for b in model.layers]
    clip(model, torch.tensor(before, dtype=torch.float32), tau)
    after = reference_max_logits(model, inputs)
    np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
    for block, k, s in zip(model.layers, k_before, before, strict=True):
        eta = np.where(s > tau, tau / s, 1.0)
        rows = block.attn.k_proj.weight.detach().view(kv_heads, -1) / k.view(kv_heads, -1)
        expected = np.sqrt(eta) if kv_heads == 4 else np.ones(kv_heads)
        np.testing.assert_allclose(rows.numpy(), np.broadcast_to(expected[:, None], rows.shape), rtol=1e-5)


def test_tau_infinity_trains_bit_for_bit_as_no_clip(tmp_path):
    plain, clipped = _lit({}), _lit({"qk_clip": math.inf})
    _fit(plain, tmp_path / "a", 3, [])
    rows = _fit(clipped, tmp_path / "b", 3, [QKClip(math.inf)])
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), clipped.parameters(), strict=True))
    assert rows[3][T.QK_CLIP_HEADS] == 0


def test_qk_norm_with_qk_clip_is_one_line():
    with pytest.raises(ValueError, match="optim.qk_clip with model.qk_norm='head'.*use one of the two"):
        copy.deepcopy(_lit({"qk_clip": 10.0}, qk_norm="head"))
    with pytest.raises(ValueError, match=r"optim.qk_clip=0.0 must be a logit threshold τ > 0"):
        OptimConfig(qk_clip=0.0)
