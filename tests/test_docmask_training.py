"""Document masking end to end: `normlab fit --data.document_mask true`, and LitLM passing the positions on."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from data.datamodule import TokenDataModule
from data.prepare import prepare
from tests.helpers.runs import scalars
from tests.test_docmask_data import short_documents
from training.lit_module import LitLM


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docmask_fit")
    return prepare([short_documents(root / "in", "docs", 300, 0)], output=root / "docs", vocab_size=300,
                   val_fraction=0.2)


def test_lit_module_passes_the_positions_to_the_model(corpus: Path) -> None:
    dm = TokenDataModule(corpus, seq_len=32, batch_size=2, document_mask=True)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    torch.manual_seed(0)
    lit = LitLM("llama", dim=32, n_layers=1, n_heads=4, vocab_size=dm.vocab_size, max_seq_len=32)
    lit.configure_model()
    tokens, positions = batch["tokens"], batch["position_ids"]
    with torch.no_grad():
        masked = lit.model(tokens[:, :-1], targets=tokens[:, 1:], position_ids=positions[:, :-1])
        assert lit.loss(batch).item() == pytest.approx(masked.item(), rel=1e-6)
        assert lit.loss(tokens).item() != pytest.approx(masked.item(), rel=1e-4)  # the mask matters here


@pytest.mark.slow
def test_fit_trains_with_document_mask(docmask_run: Path) -> None:
    """`normlab fit --data.document_mask true` (the session's run, tests/conftest.py: 4 steps of 32-token windows)
    trains, validates and runs its probes under the mask."""
    losses = scalars(docmask_run, "train/loss")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert math.isfinite(scalars(docmask_run, "val/loss")[4])
    entropy = scalars(docmask_run, "attn/entropy/L0")  # the probes ran under the mask (step 0 and every 2 steps)
    assert set(entropy) >= {0, 2} and all(0 < v <= 1 for v in entropy.values())
