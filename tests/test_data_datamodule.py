"""TokenDataModule: position from the trainer, resume through a real Lightning checkpoint, validation, errors."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from data import datamodule as dm_module
from data.datamodule import TokenDataModule
from data.dataset import train_batch
from data.errors import DataError
from data.layout import open_tokens
from data.prepare import prepare
from tests.test_data_support import VOCAB, prose_documents

SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dm")
    for i, doc in enumerate(prose_documents(30)):
        (root / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    return prepare([root], output=root / "prepared", vocab_size=VOCAB, val_fraction=0.2)


def make(path: Path, **kwargs) -> TokenDataModule:
    dm = TokenDataModule(str(path), **{"seq_len": SEQ, "batch_size": BATCH, "seed": 7, **kwargs})
    dm.setup("fit")
    return dm


def stand_in(global_step: int = 0, accumulate: int = 1, rank: int = 0, world: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        global_step=global_step, accumulate_grad_batches=accumulate, global_rank=rank, world_size=world
    )


def first(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_batches_are_long_windows_from_the_pure_sampler(data_dir: Path) -> None:
    dm = make(data_dir)
    got = first(dm.train_dataloader(), 3)
    tokens = open_tokens(data_dir, dm.meta, "train")
    for step, b in enumerate(got):
        assert b.dtype == torch.long and b.shape == (BATCH, SEQ + 1)
        expected = train_batch(tokens, seq_len=SEQ, batch_size=BATCH, seed=7, step=step)
        assert torch.equal(b, torch.from_numpy(expected))


def test_position_comes_from_the_trainer(data_dir: Path) -> None:
    dm = make(data_dir)
    straight = first(dm.train_dataloader(), 12)
    dm.trainer = stand_in(global_step=3, accumulate=2)  # 6 micro-batches already consumed
    resumed = first(dm.train_dataloader(), 6)
    assert all(torch.equal(a, b) for a, b in zip(straight[6:], resumed, strict=True))


def test_tokens_seen_carry_over_a_world_size_change(data_dir: Path) -> None:
    """The position is the tokens consumed, carried in the datamodule's state: 3 steps on 2 ranks with accumulation
    2, resumed on 3 ranks without accumulation, go on at the next unread sample."""
    dm = make(data_dir)
    dm.trainer = stand_in(global_step=3, accumulate=2, world=2)
    state = dm.state_dict()
    assert state == {"global_step": 3, "tokens_seen": 3 * 2 * 2 * BATCH * SEQ}
    single = first(make(data_dir).train_dataloader(), 18)
    for rank in range(3):
        resumed = make(data_dir)
        resumed.load_state_dict(state)
        resumed.trainer = stand_in(global_step=3, rank=rank, world=3)
        got = first(resumed.train_dataloader(), 2)
        assert torch.equal(got[0], single[12 + rank]) and torch.equal(got[1], single[15 + rank])
        resumed.trainer = stand_in(global_step=5, rank=rank, world=3)  # two more steps of 3 micro-batches
        assert resumed.tokens_seen() == (12 + 2 * 3) * BATCH * SEQ


def test_ranks_get_different_batches(data_dir: Path) -> None:
    dm = make(data_dir)
    dm.trainer = stand_in(rank=0, world=2)
    rank0 = first(dm.train_dataloader(), 2)
    dm.trainer = stand_in(rank=1, world=2)
    rank1 = first(dm.train_dataloader(), 2)
    assert not any(torch.equal(a, b) for a in rank0 for b in rank1)


def test_workers_keep_the_order(data_dir: Path) -> None:
    one, two = first(make(data_dir).train_dataloader(), 5), first(make(data_dir, num_workers=2).train_dataloader(), 5)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_validation_is_fixed_and_split_across_ranks(data_dir: Path) -> None:
    single = list(make(data_dir, val_batches=6).val_dataloader())
    assert len(single) == 6
    reseeded = make(data_dir, val_batches=6, seed=99).val_dataloader()
    assert all(torch.equal(a, b) for a, b in zip(single, reseeded, strict=True))
    shards = []
    for rank in range(3):
        dm = make(data_dir, val_batches=6)
        dm.trainer = stand_in(rank=rank, world=3)
        shards += list(dm.val_dataloader())
    assert sorted(tuple(b.flatten().tolist()) for b in shards) == sorted(tuple(b.flatten().tolist()) for b in single)
    assert make(data_dir, val_batches=0).val_dataloader() == []


def test_exposes_vocab_tokenizer_and_tokens_per_step(data_dir: Path) -> None:
    dm = make(data_dir)
    assert dm.vocab_size == VOCAB == dm.meta["vocab_size"]
    assert dm.tokenizer_path == data_dir / "tokenizer.model" and dm.tokenizer_path.is_file()
    assert dm.tokens_per_step(accumulate_grad_batches=2, world_size=4) == BATCH * SEQ * 8


def test_check_model(data_dir: Path) -> None:
    dm = make(data_dir)
    dm.check_model(vocab_size=VOCAB, max_seq_len=SEQ)
    message = rf"tokenized with {VOCAB} pieces \(meta.json\), more than the model's vocab_size 256"
    with pytest.raises(DataError, match=message):
        dm.check_model(vocab_size=256, max_seq_len=SEQ)
    with pytest.raises(DataError, match=rf"data seq_len {SEQ} is longer than the model's max_seq_len 16"):
        dm.check_model(vocab_size=VOCAB, max_seq_len=16)


def test_corpus_too_small_for_one_sequence(data_dir: Path) -> None:
    message = (r"corpus too small: the train split of '.*' has \d+ tokens, "
               r"but one sequence of seq_len 1000000 needs 1000001")
    with pytest.raises(DataError, match=message):
        make(data_dir, seq_len=1_000_000)


def test_missing_path_says_how_to_prepare(tmp_path: Path) -> None:
    message = r"no prepared data at '.*nowhere'.*normlab prepare --input <your corpus> --output .*nowhere"
    with pytest.raises(DataError, match=message):
        TokenDataModule(str(tmp_path / "nowhere")).setup("fit")


def test_prepare_data_builds_only_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(dm_module, "ensure_default_corpus", lambda path: built.append(Path(path)))
    monkeypatch.chdir(tmp_path)
    TokenDataModule().prepare_data()
    TokenDataModule(str(tmp_path / "custom")).prepare_data()
    assert built == [Path("data_cache/default")]


def test_tokenizer_mismatch_and_damage(data_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.model"
    other.write_bytes((data_dir / "tokenizer.model").read_bytes() + b"\0")
    message = r"shards in '.*' were made with a different tokenizer \(sha256 \w+…\) than '.*other.model'"
    with pytest.raises(DataError, match=message):
        make(data_dir, tokenizer=str(other))
    make(data_dir, tokenizer=str(data_dir / "tokenizer.model"))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("meta.json", "tokenizer.model", "val.bin"):
        (damaged / name).write_bytes((data_dir / name).read_bytes())
    (damaged / "train.bin").write_bytes((data_dir / "train.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"'.*damaged' is damaged \(.*train.bin should hold \d+ bytes"):
        make(damaged)


def test_bad_settings() -> None:
    with pytest.raises(DataError, match="data seq_len must be at least 1, got 0"):
        TokenDataModule(seq_len=0)


def test_jsonargparse_reads_the_signature() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TokenDataModule, "data")
    cfg = parser.parse_args(["--data.seq_len", "64", "--data.path", "x"])
    assert cfg.data.seq_len == 64 and cfg.data.batch_size == 8 and cfg.data.path == "x"


class _Recorder(L.LightningModule):
    """Records every micro-batch it trains on; its loss is a dummy with zero learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return self.w * batch.float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(data_dir: Path, ckpt_dir: Path, ckpt_path: str | None = None, accumulate: int = 2) -> list[torch.Tensor]:
    model = _Recorder()
    trainer = L.Trainer(
        max_steps=4, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(model, datamodule=TokenDataModule(str(data_dir), seq_len=SEQ, batch_size=BATCH), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:You passed in a `val_dataloader`")
def test_resume_from_a_lightning_checkpoint_continues_exactly(data_dir: Path, tmp_path: Path) -> None:
    straight = _fit(data_dir, tmp_path / "a")
    assert len(straight) == 8
    resumed = _fit(data_dir, tmp_path / "b", ckpt_path=str(tmp_path / "a" / "epoch=0-step=2.ckpt"))
    assert len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(straight[4:], resumed, strict=True))


@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:You passed in a `val_dataloader`")
def test_resume_with_other_accumulation_continues_by_tokens(data_dir: Path, tmp_path: Path) -> None:
    """Resumed at step 2 (4 micro-batches read) without accumulation, the run reads the 5th and 6th micro-batches
    of the straight run, not the 3rd and 4th that counting by steps would give."""
    straight = _fit(data_dir, tmp_path / "a")
    resumed = _fit(data_dir, tmp_path / "b", ckpt_path=str(tmp_path / "a" / "epoch=0-step=2.ckpt"), accumulate=1)
    assert len(resumed) == 2
    assert all(torch.equal(a, b) for a, b in zip(straight[4:6], resumed, strict=True))


@pytest.mark.parametrize("damage, message", [
    # same size, every id 65535 (vocabulary 384): an IndexError at step 1 before, a device-side assert on a GPU
    (lambda d: (d / "train.bin").write_bytes(b"\xff" * (d / "train.bin").stat().st_size),
     r"train.bin holds token id 65535 at position 0, outside the vocabulary of \d+"),
    (lambda d: _write_index(d, "train.idx", lambda s: s.__setitem__(-1, 10**15)),
     r"train.idx holds document starts that do not rise from 0 within the \d+ tokens"),
    (lambda d: _write_index(d, "val.idx", lambda s: s.__setitem__(0, -7)),
     r"val.idx holds document starts that do not rise from 0"),
])
def test_ids_outside_the_vocabulary_and_a_bad_index_are_refused_at_open(data_dir: Path, tmp_path: Path, damage,
                                                                       message: str) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(data_dir, damaged)
    damage(damaged)
    with pytest.raises(DataError, match=rf"'.*damaged' is damaged \(.*{message}"):
        make(damaged)


def _write_index(directory: Path, name: str, edit) -> None:
    starts = np.fromfile(directory / name, dtype=np.int64)
    edit(starts)
    starts.tofile(directory / name)


def test_a_long_split_is_checked_on_evenly_spaced_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from data import layout

    monkeypatch.setattr(layout, "FULL_ID_CHECK_TOKENS", 1 << 17)  # 2 blocks of 2^16
    tokens = np.zeros(1 << 20, dtype=np.uint16)
    tokens[-1] = 500  # the last block is one of the two checked
    assert layout._id_problems(Path("t.bin"), tokens, 384) == [
        f"t.bin holds token id 500 at position {(1 << 20) - 1}, outside the vocabulary of 384"]
    tokens[-1], tokens[1 << 19] = 0, 500  # between the checked blocks: a sample does not see it
    assert layout._id_problems(Path("t.bin"), tokens, 384) == []
