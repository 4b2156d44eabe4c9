"""A forward hook a user puts on a block fires in a real training step: the step calls the model, the model
calls each block through `__call__` — with the training-health probes attached or not, compiled or not."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from training.callbacks.health import TrainingHealth
from training.lit_module import LitLM

STEPS, BATCH, SEQ = 2, 2, 8


def _fit_with_hook(tmp_path: Path, compile: bool, probes: bool, **model: Any) -> tuple[list[tuple[int, ...]],
                                                                                       list[dict[str, str]]]:
    """Fit STEPS steps of a tiny LitLM (ModelConfig fields `model` on top) with a forward hook on
    `model.layers[0]`; returns the shapes of the stream the hook saw, and the logged metrics rows."""
    torch.manual_seed(0)
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, compile=compile, **model)
    lit.configure_model()  # builds (and, with compile, compiles) the model, so the hook can be put on a block
    seen: list[tuple[int, ...]] = []
    lit.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(tuple(out.value().shape)))
    tokens = torch.randint(0, 64, (STEPS * BATCH, SEQ + 1))
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                      callbacks=[TrainingHealth(every_n_steps=1 if probes else 0)], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(tokens, batch_size=BATCH))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        return seen, list(csv.DictReader(f))


@pytest.mark.parametrize("probes", [False, True], ids=["plain", "probes"])
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_a_forward_hook_on_a_block_fires_in_every_training_step(tmp_path, compile, probes):
    seen, rows = _fit_with_hook(tmp_path, compile, probes)
    assert seen == [(BATCH, SEQ, 32)] * STEPS
    # The probes, themselves hooks, ran beside the user's on the same steps (and only when asked for).
    logged = [row["resid/update_ratio/attn/L0"] for row in rows if row.get("resid/update_ratio/attn/L0")]
    assert len(logged) == (STEPS if probes else 0)


def test_z_loss_is_logged_and_train_loss_stays_the_cross_entropy(tmp_path):
    """optim.z_loss: train/z_loss is w · mean(log²Z) of the step's batch, train/loss its cross-entropy alone."""
    torch.manual_seed(0)
    w = 0.1
    optim = {"z_loss": w, "lr": 1e-9, "min_lr": 0.0, "warmup_steps": 0}
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, optim=optim)
    lit.configure_model()
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1))
    with torch.no_grad():  # the reference, on materialized logits, before the (negligible, lr 1e-9) update
        logits = lit.model(tokens[:, :-1]).double()
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
        z = w * logits.logsumexp(-1).square().mean().item()
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(tokens, batch_size=BATCH))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        row = next(r for r in csv.DictReader(f) if r.get("train/z_loss"))
    assert float(row["train/z_loss"]) == pytest.approx(z, rel=1e-4)
    assert float(row["train/loss"]) == pytest.approx(ce, rel=1e-4)


def test_the_newer_norm_fields_train_through_lightning_with_probes(tmp_path):
    """The 2024–2026 fields together in a real Lightning fit with the probes on every step: the loss stays finite,
    and the sink and gate telemetry is logged for every layer."""
    seen, rows = _fit_with_hook(tmp_path, compile=False, probes=True, norm="derf", mix_ln=0.5, branch_scale="scalar",
                                branch_scale_init=0.5, residual_scale="deepnorm", embed_norm=True, qk_norm="head",
                                qk_norm_kind="l2", sub_norm=True, attn_gate="head", attn_sink="learnable")
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    for tag in ("attn/sink_logit_mass/L1", "attn/gate_mean/L0", "resid/update_ratio/mlp/L1"):
        assert sum(bool(row.get(tag)) for row in rows) == STEPS, tag
