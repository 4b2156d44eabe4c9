"""Document masking in the data: `position_ids` restart at every document start of `document_starts()`.

The reference is the document index itself, read independently of the code under test: a window's position is 0
at its first token and wherever a recorded document starts, and otherwise one more than at the previous token.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from data.datamodule import TokenDataModule
from data.dataset import WindowSampler, sample_indices, val_starts
from data.errors import DataError
from data.layout import document_starts, open_tokens, read_meta
from data.mixture import MixtureSampler
from data.prepare import prepare

SEQ, BATCH = 32, 4
WORDS = "the cat sat on a mat while dogs ran past the quick brown fox near old trees and small houses".split()


def short_documents(root: Path, name: str, n: int, seed: int) -> Path:
    """A .jsonl of ``n`` short documents (2–8 words): most windows of SEQ tokens span several."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))})
                            + "\n" for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("docmask")
    a = prepare([short_documents(root / "in", "a", 300, 0)], output=root / "a", vocab_size=300, val_fraction=0.2)
    b = prepare([short_documents(root / "in", "b", 200, 1)], output=root / "b", tokenizer=a / "tokenizer.model",
                val_fraction=0.2)
    return {"a": a, "b": b}


def make(path, **kwargs) -> TokenDataModule:
    dm = TokenDataModule(path, **{"seq_len": SEQ, "batch_size": BATCH, "seed": 7, "document_mask": True, **kwargs})
    dm.setup("fit")
    return dm


def first(loader, n: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def check_positions(positions: torch.Tensor, starts: np.ndarray, doc_starts: np.ndarray) -> int:
    """Assert the rule of the module docstring for windows at token offsets ``starts``; returns how many
    document starts fell inside the windows (so a test can insist on some)."""
    recorded = set(doc_starts.tolist())
    inside = 0
    for row, start in zip(positions.tolist(), starts.tolist(), strict=True):
        assert row[0] == 0
        for j in range(1, len(row)):
            begins = start + j in recorded
            inside += begins
            assert row[j] == (0 if begins else row[j - 1] + 1), (start, j)
    return inside


def test_train_positions_match_document_starts(dirs: dict[str, Path]) -> None:
    dm = make(dirs["a"])
    plain = TokenDataModule(dirs["a"], seq_len=SEQ, batch_size=BATCH, seed=7)
    plain.setup("fit")
    doc_starts = document_starts(dirs["a"], "train")
    tokens = open_tokens(dirs["a"], dm.meta, "train")
    sampler = WindowSampler(len(tokens), SEQ, 7)
    inside = 0
    for step, (batch, same) in enumerate(zip(first(dm.train_dataloader(), 3), first(plain.train_dataloader(), 3),
                                             strict=True)):
        assert set(batch) == {"tokens", "position_ids"} and batch["position_ids"].shape == (BATCH, SEQ + 1)
        assert torch.equal(batch["tokens"], same)  # the token stream is the one without masking
        starts = sampler.starts(sample_indices(step, 0, 1, BATCH))
        inside += check_positions(batch["position_ids"], starts, doc_starts)
        # a document start follows an EOS: the index and the tokens agree
        eos = batch["tokens"][:, :-1][batch["position_ids"][:, 1:] == 0]
        assert eos.numel() and (eos == dm.meta["eos_id"]).all()
    assert inside > 3 * BATCH  # several documents per window


def test_validation_positions_match_document_starts(dirs: dict[str, Path]) -> None:
    dm = make(dirs["a"], val_batches=3)
    starts = val_starts(dm.meta["splits"]["val"]["tokens"], SEQ, 3 * BATCH).reshape(3, BATCH)
    doc_starts = document_starts(dirs["a"], "val")
    for batch, window_starts in zip(dm.val_dataloader(), starts, strict=True):
        assert check_positions(batch["position_ids"], window_starts, doc_starts) > 0


def test_mixture_positions_come_from_each_source(dirs: dict[str, Path]) -> None:
    dm = make({str(dirs["a"]): 0.5, str(dirs["b"]): 0.5})
    n_tokens = tuple(read_meta(dirs[s])["splits"]["train"]["tokens"] for s in "ab")
    sampler = MixtureSampler(n_tokens, (0.5, 0.5), SEQ, 7)
    doc_starts = [document_starts(dirs[s], "train") for s in "ab"]
    seen = set()
    for step, batch in enumerate(first(dm.train_dataloader(), 4)):
        source, starts = sampler.locate(sample_indices(step, 0, 1, BATCH))
        for i in (0, 1):
            here = source == i
            check_positions(batch["position_ids"][torch.from_numpy(here)], starts[here], doc_starts[i])
        seen |= set(source.tolist())
    assert seen == {0, 1}


def test_resume_continues_exactly_with_document_mask(dirs: dict[str, Path]) -> None:
    dm = make(dirs["a"])
    straight = first(dm.train_dataloader(), 8)
    dm.trainer = type("Trainer", (), {"global_step": 3, "accumulate_grad_batches": 2, "global_rank": 0,
                                      "world_size": 1})()  # 6 micro-batches already consumed
    resumed = first(dm.train_dataloader(), 2)
    for a, b in zip(straight[6:], resumed, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["position_ids"], b["position_ids"])


def test_document_mask_must_be_a_bool(dirs: dict[str, Path]) -> None:
    with pytest.raises(DataError, match="data document_mask must be true or false, got 'yes'"):
        TokenDataModule(dirs["a"], document_mask="yes")
