"""`normlab fit` logs the loss at initialization (update 1's train/loss, at step 1) whatever
`trainer.log_every_n_steps` is: the sweep caps a diverged run at it, and a loss logged after some updates would
depend on the learning rate."""
from __future__ import annotations

import csv

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from training.lit_module import LitLM

SEQ, BATCH = 8, 2


def _fit(tmp_path, lr: float, log_every: int) -> tuple[float, list[dict[str, str]]]:
    """(the untrained model's loss on the first batch, the logged rows) of a 4-step fit at `lr`."""
    torch.manual_seed(0)
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ,
                optim={"lr": lr, "warmup_steps": 0})
    lit.configure_model()
    tokens = torch.randint(0, 64, (4 * BATCH, SEQ + 1))
    with torch.no_grad():
        initial = lit.loss(tokens[:BATCH]).item()
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=log_every,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(lit, DataLoader(tokens, batch_size=BATCH))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        return initial, [r for r in csv.DictReader(f) if r.get("train/loss")]


def test_the_loss_at_initialization_is_logged_at_step_1_whatever_the_logging_interval(tmp_path):
    for lr in (1e-3, 1.0):  # the first logged loss no longer depends on the LR
        initial, rows = _fit(tmp_path / f"lr{lr}", lr, log_every=3)
        steps = [int(float(r["step"])) for r in rows]
        assert steps == [1, 3], steps  # step 1 added; Lightning's own every 3 updates
        assert abs(float(rows[0]["train/loss"]) - initial) < 1e-5


def test_no_second_point_when_every_update_is_logged(tmp_path):
    initial, rows = _fit(tmp_path, 1e-3, log_every=1)
    assert [int(float(r["step"])) for r in rows] == [1, 2, 3, 4]
    assert abs(float(rows[0]["train/loss"]) - initial) < 1e-5
