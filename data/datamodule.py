"""``TokenDataModule``: a prepared directory as a resumable ``LightningDataModule``.

The train loader's position is the number of tokens the run has consumed, ``tokens_seen``: the tokens seen when
the run (re)started, from the checkpoint (Lightning saves and restores the datamodule's ``state_dict``), plus
``(global_step - step at the restart) * tokens per step`` for the steps since. Lightning restores both before it
builds the loaders, so a resume starts at global sample ``tokens_seen // seq_len`` without replay (see
``data.dataset``) — also on another world size, batch size or accumulation. The train loader is endless (an
``IterableDataset`` without a length): training ends at ``max_steps``, and position never depends on epoch
boundaries, so configure validation with an integer ``val_check_interval`` and ``check_val_every_n_epoch=None``.

``path`` may also be a weighted mixture of prepared directories, ``{dir: weight, ...}`` (all prepared with one
tokenizer), sampled by ``data.mixture``; and ``val_sets`` names further held-out directories. Validation then
has one loader per set (``val_sets_order``): each source of a mixture and each named set is logged as
``val/<name>/loss|ppl|bpb``; ``val/loss`` stays the loss of the data's own validation split (for
a mixture: the weighted mean over its sources' validation splits).

``document_mask``: every batch (train and validation) is a dict ``{"tokens": [B, seq_len + 1], "position_ids":
[B, seq_len + 1]}``, the positions counted from each document's start within the window (read from the
directory's document index, ``data.layout.document_starts``); the model attends within documents only.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from data import layout
from data.dataset import TrainBatches, ValBatches, check_enough_tokens
from data.errors import DataError
from data.mixture import MixtureBatches
from data.prepare import DEFAULT_OUTPUT, DEFAULT_VOCAB_SIZE, ensure_default_corpus
from data.tokenizer import sha256_file


class ValSet:
    """One validation loader: ``name`` ("" for the main set), its directory, and its weight in ``val/loss``
    (0 for a named held-out set)."""

    def __init__(self, name: str, path: Path, weight: float) -> None:
        self.name, self.path, self.weight = name, path, weight

logger = logging.getLogger(__name__)


class TokenDataModule(L.LightningDataModule):
    """Batches are LongTensors [batch_size, seq_len + 1]; the LightningModule splits inputs and targets.

    Args:
        path: a directory made by ``normlab prepare`` (the default path is built on first use: default corpus),
            or a mixture ``{directory: weight, ...}`` of directories prepared with the same tokenizer.
        seq_len: tokens the model sees per sample (each batch row holds seq_len + 1).
        batch_size: micro-batch size per rank.
        seed: selects the order of training windows (validation windows do not depend on it).
        num_workers: DataLoader worker processes.
        val_batches: size of the fixed validation set, in batches, shared out across ranks.
        tokenizer: optional tokenizer file the data must have been prepared with (checked by sha256).
        val_sets: named held-out directories ``{name: directory}`` (prepared with the same tokenizer), whose
            validation splits are evaluated beside the main one as ``val/<name>/loss|ppl|bpb``.
        document_mask: batches become ``{"tokens", "position_ids"}`` dicts (see the module docstring), so the
            model attends within each document and restarts positions at each document's start.
    """

    def __init__(
        self, path: str | dict[str, float] = DEFAULT_OUTPUT, seq_len: int = 256, batch_size: int = 8,
        seed: int = 1234, num_workers: int = 0, val_batches: int = 16, tokenizer: str | None = None,
        val_sets: dict[str, str] | None = None, document_mask: bool = False,
    ) -> None:
        super().__init__()
        for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                                 ("num_workers", num_workers, 0), ("val_batches", val_batches, 0)):
            if value < low:
                raise DataError(f"data {name} must be at least {low}, got {value}")
        self.save_hyperparameters()
        self.sources = _mixture(path)  # [(name, directory, weight)]; one source with weight 1 for a plain path
        self.val_sets = _named_sets(val_sets, self.sources)
        self.path, self.seq_len, self.batch_size, self.seed = self.sources[0][1], seq_len, batch_size, seed
        self.num_workers, self.val_batches, self.tokenizer = num_workers, val_batches, tokenizer
        if not isinstance(document_mask, bool):
            raise DataError(f"data document_mask must be true or false, got {document_mask!r}")
        self.document_mask = document_mask
        self._meta: dict[str, Any] | None = None
        self._metas: dict[Path, dict[str, Any]] = {}  # of the other directories (mixture sources, val sets)
        self._restart = (0, 0)  # (global_step, tokens_seen) when this run started: from the checkpoint on resume
        self._checked = False  # check_directories passed (the files are not rewritten while a command runs)

    # --- what the rest of normlab reads -------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """The directory's ``meta.json`` (read once)."""
        if self._meta is None:
            found = layout.read_meta(self.path) if self.path.is_dir() else None
            if found is None:
                raise DataError(
                    f"no prepared data at '{self.path}' (no {layout.META_FILE}); run `normlab prepare --input "
                    f"<your corpus> --output {shlex.quote(str(self.path))}` first, or `normlab prepare --output "
                    f"{shlex.quote(str(self.path))}` for "
                    "the default corpus"
                )
            self._meta = found
        return self._meta

    @property
    def vocab_size(self) -> int:
        """Pieces of the data's tokenizer (meta.json). The default corpus, before its first build (in
        `prepare_data`), has the size it will be built with — so the model can be configured from it first."""
        if self._is_default_path() and not self._complete():
            return DEFAULT_VOCAB_SIZE
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
        if self._checked:  # by the command, before it wrote the run directory: the id scan is not repeated
            return
        self._meta = None  # re-read: prepare_data may have just built the directory
        self._metas = {}
        self.check_directories()

    def check_directories(self) -> None:
        """Every data directory (sources, held-out sets) matches its meta.json and this run's tokenizer, or one
        DataError naming the damage. `setup` runs it; a command runs it first too, before anything is written
        into the run directory, so a refused start leaves nothing there that would block the corrected one."""
        for _, path, _ in self.sources:
            self._check_directory(path, train=True)
        for name, path in self.val_sets.items():
            self._check_directory(path, train=False, role=f"data.val_sets.{name}")
        self._check_tokenizer()
        self._checked = True

    def _check_directory(self, path: Path, train: bool, role: str = "data.path") -> None:
        meta = self._meta_of(path, role)
        damage = layout.problems(path, meta)
        if damage:
            raise DataError(f"'{path}' is damaged ({'; '.join(damage)}); rebuild it with `normlab prepare --overwrite`")
        if meta["tokenizer_sha256"] != self.meta["tokenizer_sha256"]:
            raise DataError(
                f"{role} '{path}' was prepared with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]}…) than "
                f"'{self.path}' (sha256 {self.meta['tokenizer_sha256'][:12]}…); prepare it again with `normlab prepare "
                f"--tokenizer {self.tokenizer_path}`"
            )
        if train:
            check_enough_tokens(meta["splits"]["train"]["tokens"], self.seq_len, f"the train split of '{path}'")
        split = "val" if train else held_out_split(meta)
        tokens = int(meta["splits"][split]["tokens"])
        if (self.val_batches and tokens) or not train:
            check_enough_tokens(tokens, self.seq_len, f"the {split} split of '{path}'")

    def _meta_of(self, path: Path, role: str) -> dict[str, Any]:
        if path == self.path:
            return self.meta
        if path not in self._metas:
            found = layout.read_meta(path) if path.is_dir() else None
            if found is None:
                raise DataError(f"{role}: no prepared data at '{path}' (no {layout.META_FILE}); run `normlab prepare "
                                f"--tokenizer {self.tokenizer_path} --input <text> --output {path}` first")
            self._metas[path] = found
        return self._metas[path]

    @property
    def val_sets_order(self) -> list[ValSet]:
        """The validation loaders in order: the main set(s) first, then the named held-out sets."""
        if len(self.sources) == 1:
            main = [ValSet("", self.path, 1.0)] if self._val_tokens() else []
        else:
            with_val = [(n, p, w) for n, p, w in self.sources
                        if self._meta_of(p, "data.path")["splits"]["val"]["tokens"]]
            total = sum(w for _, _, w in with_val)
            main = [ValSet(n, p, w / total) for n, p, w in with_val]
        return main + [ValSet(name, path, 0.0) for name, path in self.val_sets.items()]

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self._position()
        tokens_seen = self.tokens_seen()
        start = tokens_seen // self.seq_len
        split = self.meta["splits"]["train"]
        position = {"seq_len": self.seq_len, "batch_size": self.batch_size, "seed": self.seed, "start_sample": start,
                    "rank": rank, "world_size": world_size}
        if len(self.sources) == 1:
            dataset = TrainBatches(self.path / split["file"], self.meta["dtype"], split["tokens"], **position,
                                   document_starts=self._document_starts(self.path, "train"))
        else:
            files = []
            for _, path, _ in self.sources:
                meta = self._meta_of(path, "data.path")
                files.append((path / meta["splits"]["train"]["file"], meta["dtype"], meta["splits"]["train"]["tokens"]))
            starts = [self._document_starts(p, "train") for _, p, _ in self.sources] if self.document_mask else None
            dataset = MixtureBatches(files, [w for _, _, w in self.sources], **position, document_starts=starts)
        logger.info("train data: rank %d/%d starts after %d samples (%d tokens seen)", rank, world_size, start,
                    tokens_seen)
        return self._loader(dataset)

    def val_dataloader(self) -> DataLoader | list:
        sets = self.val_sets_order
        if not self.val_batches or not sets:
            return []  # Lightning reads an empty list as "no validation"
        rank, world_size = self._position()
        if self.val_batches % world_size:
            logger.warning("val_batches %d is not a multiple of world size %d: some batches are evaluated twice",
                           self.val_batches, world_size)
        loaders = []
        for val_set in sets:
            meta = self._meta_of(val_set.path, "data.val_sets")
            name = "val" if val_set.weight else held_out_split(meta)
            split = meta["splits"][name]
            loaders.append(self._loader(ValBatches(
                val_set.path / split["file"], meta["dtype"], split["tokens"], seq_len=self.seq_len,
                batch_size=self.batch_size, val_batches=self.val_batches, rank=rank, world_size=world_size,
                document_starts=self._document_starts(val_set.path, name),
            )))
        return loaders[0] if len(loaders) == 1 else loaders

    def piece_bytes(self) -> torch.Tensor:
        """UTF-8 bytes of each token id (for bits per byte), int64 [vocab_size]."""
        return torch.from_numpy(layout.load_tokenizer(self.tokenizer_path).piece_bytes())

    def test_dataloader(self) -> DataLoader | list:
        """`normlab test` evaluates the held-out split (prepared data has train and val splits only)."""
        return self.val_dataloader()

    # --- helpers ------------------------------------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        """(rank, world size) from the attached trainer."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def _document_starts(self, path: Path, split: str) -> np.ndarray | None:
        """The split's document starts when document masking is on (else None: plain token batches)."""
        if not self.document_mask:
            return None
        return layout.document_starts(path, split, self._meta_of(path, "data.path"))

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

    def _check_tokenizer(self) -> None:  # the given tokenizer against the primary directory
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


def held_out_split(meta: dict[str, Any]) -> str:
    """The split a named held-out directory is evaluated on: its val split, or its train split when it has no
    val split (a directory prepared with --val_fraction 0 to be a held-out set as a whole)."""
    return "val" if meta["splits"]["val"]["tokens"] else "train"


def _mixture(path: str | Path | dict[str, float]) -> list[tuple[str, Path, float]]:
    """``data.path`` as (source name, directory, weight): a directory, or a ``{directory: weight}`` mixture."""
    if not isinstance(path, dict):
        return [("", Path(path), 1.0)]
    if not path:
        raise DataError("data.path is an empty mixture; give {directory: weight, ...}")
    sources = []
    for directory, weight in path.items():
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(f"data.path mixture: the weight of '{directory}' must be a positive number, got {weight!r}")
        sources.append((Path(directory).name, Path(directory), float(weight)))
    names = [n for n, _, _ in sources]
    if len(set(names)) < len(names):  # two sources named alike: tell them apart by position
        sources = [(f"{n}_{i}", p, w) for i, (n, p, w) in enumerate(sources)]
    return sources


def _named_sets(val_sets: dict[str, str] | None, sources: list[tuple[str, Path, float]]) -> dict[str, Path]:
    taken = {n for n, _, _ in sources if n}
    out = {}
    for name, directory in (val_sets or {}).items():
        if not name or "/" in name or name in taken:
            raise DataError(f"data.val_sets name {name!r} must be non-empty, without '/', and differ from the "
                            f"mixture's "
                            f"source names ({', '.join(sorted(taken)) or 'none'})")
        out[name] = Path(directory)
    return out
