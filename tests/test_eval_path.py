"""One evaluation path: `normlab evaluate` scores the same batches, under the same document mask, with the same
loss and the same reduction to loss/ppl/bits-per-byte as the validation inside `normlab fit`."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import scalars
from training.eval import cli as eval_cli
from training.eval.metrics import LossTotals


def test_loss_totals_match_float64_reference() -> None:
    """Sums of per-batch token-weighted losses → loss, ppl, bpb, checked against plain float64 arithmetic."""
    torch.manual_seed(0)
    losses, tokens = torch.rand(5, dtype=torch.float64) * 4, torch.tensor([64, 64, 64, 64, 17])
    nbytes = torch.tensor([150, 140, 170, 160, 40])
    totals = LossTotals()
    for loss, n, b in zip(losses.tolist(), tokens.tolist(), nbytes.tolist(), strict=True):
        totals.add(loss * n, n, b)
    mean = float((losses * tokens).sum() / tokens.sum())
    out = totals.compute()
    assert out["loss"] == pytest.approx(mean, rel=1e-12)
    assert out["perplexity"] == pytest.approx(math.exp(mean), rel=1e-12)
    assert out["bits_per_byte"] == pytest.approx(mean / math.log(2) * int(tokens.sum()) / int(nbytes.sum()), rel=1e-12)
    assert LossTotals(loss_sum=800.0, tokens=1).compute()["perplexity"] == math.inf  # exp would overflow


@pytest.mark.slow
def test_evaluate_reproduces_val_loss_of_a_document_masked_run(docmask_run: Path, tmp_path: Path) -> None:
    """`normlab evaluate` on the checkpoint of a `data.document_mask: true` run (the session's, tests/conftest.py:
    32-token windows) prints the val/loss the run logged at that step (its windows, its mask: without the mask the
    loss differs by far more than the tolerance)."""
    out = tmp_path / "eval.json"
    assert eval_cli.main(["--checkpoint", str(docmask_run / "checkpoints" / "step-00000004"), "--output", str(out),
                          "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 2 * 4 * 32  # val_batches · batch_size · seq_len: the run's own windows
    assert result["loss"] == pytest.approx(scalars(docmask_run, "val/loss")[4], rel=1e-5)


@pytest.mark.slow
def test_validation_logs_bits_per_byte_of_its_own_set(single_run: Path) -> None:
    """`val/bpb` of the data's own validation set (the tiny reference run, validated at steps 4 and 8) is
    val/loss in nats per token × the target tokens / their UTF-8 bytes / ln 2, with the targets taken from the
    batches validation scored and each target's bytes read from sentencepiece's own pieces here."""
    import sentencepiece as spm
    import yaml

    from data.datamodule import TokenDataModule

    dm = TokenDataModule(**yaml.safe_load((single_run / "config.yaml").read_text())["data"])
    sp = spm.SentencePieceProcessor(model_file=str(dm.tokenizer_path))
    def nbytes(i: int) -> int:
        if sp.is_byte(i):
            return 1  # <0xAB>: one byte of a character the vocabulary lacks
        return 0 if sp.is_control(i) or sp.is_unknown(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode())

    targets = [int(t) for batch in dm.val_dataloader() for t in batch[:, 1:].flatten()]
    n_bytes = sum(nbytes(t) for t in targets)
    assert len(targets) == 2 * 8 * 16 and n_bytes > len(targets)  # val_batches × batch_size × seq_len
    loss, bpb = scalars(single_run, "val/loss"), scalars(single_run, "val/bpb")
    assert sorted(bpb) == [4, 8]
    for step in (4, 8):
        assert bpb[step] == pytest.approx(loss[step] * len(targets) / n_bytes / math.log(2), rel=1e-6)
