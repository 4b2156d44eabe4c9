"""``TokenDataModule``: a prepared directory as a resumable ``LightningDataModule``.

The train loader's position is the number of tokens the run has consumed, ``tokens_seen``: the tokens seen when
the run (re)started, from the checkpoint (Lightning saves and restores the datamodule's ``state_dict``), plus
``(global_step - step at the restart) * tokens per step`` for the steps since. Lightning restores both before it
builds the loaders, so a resume starts at global sample ``tokens_seen // seq_len`` without replay (see
``data.dataset``) — also on another world size, batch size or accumulation. The train loader is endless (an
``IterableDataset`` without a length): training ends at ``max_steps``, and position never depends on epoch
boundaries, so configure validation with an integer ``val_check_interval`` and ``check_val_every_n_epoch=None``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from data import meta as layout
from data.dataset import TrainBatches, ValBatches, check_enough_tokens
from data.errors import DataError
from data.prepare import DEFAULT_OUTPUT, ensure_default_corpus
from data.tokenizer import sha256_file

logger = logging.getLogger(__name__)


class TokenDataModule(L.LightningDataModule):
    """Batches are LongTensors [batch_size, seq_len + 1]; the LightningModule splits inputs and targets.

    Args:
        path: a directory made by ``normlab prepare``. The default path is built on first use (default corpus).
        seq_len: tokens the model sees per sample (each batch row holds seq_len + 1).
        batch_size: micro-batch size per rank.
        seed: selects the order of training windows (validation windows do not depend on it).
        num_workers: DataLoader worker processes.
        val_batches: size of the fixed validation set, in batches, shared out across ranks.
        tokenizer: optional ``.model`` file the data must have been prepared with (checked by sha256).
    """

    def __init__(
        self, path: str = DEFAULT_OUTPUT, seq_len: int = 256, batch_size: int = 8, seed: int = 1234,
        num_workers: int = 0, val_batches: int = 16, tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                                 ("num_workers", num_workers, 0), ("val_batches", val_batches, 0)):
            if value < low:
                raise DataError(f"data {name} must be at least {low}, got {value}")
        self.save_hyperparameters()
        self.path, self.seq_len, self.batch_size, self.seed = Path(path), seq_len, batch_size, seed
        self.num_workers, self.val_batches, self.tokenizer = num_workers, val_batches, tokenizer
        self._meta: dict[str, Any] | None = None
        self._restart = (0, 0)  # (global_step, tokens_seen) when this run started: from the checkpoint on resume

    # --- what the rest of normlab reads -------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """The directory's ``meta.json`` (read once)."""
        if self._meta is None:
            found = layout.read_meta(self.path) if self.path.is_dir() else None
            if found is None:
                raise DataError(
                    f"no prepared data at '{self.path}' (no {layout.META_FILE}); run `normlab prepare --input "
                    f"<your corpus> --output {self.path}` first, or `normlab prepare --output {self.path}` for "
                    "the default corpus"
                )
            self._meta = found
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.meta["tokenizer_path"]

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens predicted per rank per micro-batch (targets, not the extra input token)."""
        return self.batch_size * self.seq_len

    def tokens_per_step(self, accumulate_grad_batches: int = 1, world_size: int = 1) -> int:
        """Tokens predicted per optimizer step across all ranks."""
        return self.tokens_per_micro_batch * accumulate_grad_batches * world_size

    def tokens_seen(self) -> int:
        """Tokens predicted by all ranks before the trainer's current step, across every restart of the run."""
        trainer = self.trainer
        if trainer is None:
            return self._restart[1]
        step, tokens = self._restart
        return tokens + (trainer.global_step - step) * self.tokens_per_step(trainer.accumulate_grad_batches,
                                                                           trainer.world_size)

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint by Lightning: where the data stream stands."""
        step = self.trainer.global_step if self.trainer is not None else self._restart[0]
        return {"global_step": step, "tokens_seen": self.tokens_seen()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning on resume, before the loaders are built. (A checkpoint without this state resumes
        at ``global_step * tokens per step`` of the current run's layout.)"""
        self._restart = (int(state_dict["global_step"]), int(state_dict["tokens_seen"]))

    def check_model(self, vocab_size: int, max_seq_len: int) -> None:
        """Fail before training if the model cannot take this data."""
        if self.vocab_size > vocab_size:
            raise DataError(
                f"the data in '{self.path}' was tokenized with {self.vocab_size} pieces (meta.json), more than the "
                f"model's vocab_size {vocab_size}: ids ≥ {vocab_size} have no embedding. Set the model's "
                f"vocab_size to at least {self.vocab_size}"
            )
        if self.seq_len > max_seq_len:
            raise DataError(
                f"data seq_len {self.seq_len} is longer than the model's max_seq_len {max_seq_len}; lower the "
                "data seq_len or raise the model's max_seq_len"
            )

    # --- Lightning hooks ----------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the default corpus on first use (Lightning runs this on one process per node)."""
        if self._is_default_path() and not self._complete():
            ensure_default_corpus(self.path)

    def setup(self, stage: str | None = None) -> None:
        self._meta = None  # re-read: prepare_data may have just built the directory
        damage = layout.problems(self.path, self.meta)
        if damage:
            raise DataError(
                f"'{self.path}' is damaged ({'; '.join(damage)}); rebuild it with `normlab prepare --overwrite`"
            )
        self._check_tokenizer()
        check_enough_tokens(self.meta["splits"]["train"]["tokens"], self.seq_len, f"the train split of '{self.path}'")
        if self.val_batches and self._val_tokens():
            check_enough_tokens(self._val_tokens(), self.seq_len, f"the validation split of '{self.path}'")

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self._position()
        tokens_seen = self.tokens_seen()
        start = tokens_seen // self.seq_len
        split = self.meta["splits"]["train"]
        dataset = TrainBatches(
            self.path / split["file"], self.meta["dtype"], split["tokens"], seq_len=self.seq_len,
            batch_size=self.batch_size, seed=self.seed, start_sample=start, rank=rank, world_size=world_size,
        )
        logger.info("train data: rank %d/%d starts after %d samples (%d tokens seen)", rank, world_size, start,
                    tokens_seen)
        return self._loader(dataset)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_batches or not self._val_tokens():
            return []  # Lightning reads an empty list as "no validation"
        rank, world_size = self._position()
        if self.val_batches % world_size:
            logger.warning("val_batches %d is not a multiple of world size %d: some batches are evaluated twice",
                           self.val_batches, world_size)
        split = self.meta["splits"]["val"]
        dataset = ValBatches(
            self.path / split["file"], self.meta["dtype"], split["tokens"], seq_len=self.seq_len,
            batch_size=self.batch_size, val_batches=self.val_batches, rank=rank, world_size=world_size,
        )
        return self._loader(dataset)

    def test_dataloader(self) -> DataLoader | list:
        """`normlab test` evaluates the held-out split (prepared data has train and val splits only)."""
        return self.val_dataloader()

    # --- helpers ------------------------------------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        """(rank, world size) from the attached trainer."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def _loader(self, dataset: TrainBatches | ValBatches) -> DataLoader:
        # The datasets yield whole batches, so the loader does no batching or shuffling of its own.
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available())

    def _val_tokens(self) -> int:
        return int(self.meta["splits"]["val"]["tokens"])

    def _is_default_path(self) -> bool:
        return self.path.resolve() == Path(DEFAULT_OUTPUT).resolve()

    def _complete(self) -> bool:
        found = layout.read_meta(self.path) if self.path.is_dir() else None
        return found is not None and not layout.problems(self.path, found)

    def _check_tokenizer(self) -> None:
        expected = self.meta["tokenizer_sha256"]
        if sha256_file(self.tokenizer_path) != expected:
            raise DataError(f"'{self.tokenizer_path}' does not match the sha256 in meta.json; rebuild '{self.path}'")
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise DataError(f"tokenizer file '{self.tokenizer}' does not exist")
        if self.tokenizer is not None and sha256_file(self.tokenizer) != expected:
            raise DataError(
                f"the shards in '{self.path}' were made with a different tokenizer (sha256 {expected[:12]}…) than "
                f"'{self.tokenizer}' ({sha256_file(self.tokenizer)[:12]}…); re-run `normlab prepare --tokenizer "
                f"{self.tokenizer} --overwrite` or drop the tokenizer setting"
            )
