"""LitLM: the LightningModule that trains a `model.Transformer` with next-token cross-entropy.

Thin on purpose: the optimizer, its parameter groups and schedule live in `optim/`, DeepSpeed in `strategy.py`,
FSDP2's sharding in `fsdp2.py`, checkpoints in `checkpointing/` and `callbacks/step_checkpoint.py`, throughput,
RNG and the guard in `callbacks/`.

The model's fields are `ModelConfig`'s own, read from the dataclass (`model_fields`): LightningCLI builds the
module with `lit_lm`, whose signature offers each as `--model.<field>` (e.g. `--model.placement post`), each None
= "the preset's value". The data's tokenizer size and sequence length reach the module through two linked
arguments (`data_vocab_size`, `data_seq_len`: `NormlabCLI` links `data.vocab_size` and `data.seq_len` to them when
it builds the classes), and are the defaults of `vocab_size` and `max_seq_len`: so the model is complete at
construction, and both stay settable (a vocabulary padded to a multiple of 64, a longer RoPE table).
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from model import ModelConfig, Transformer
from model.optimize import compile_blocks, enable_activation_checkpointing
from training.checkpointing.init_from import InitFrom
from training.distributed import is_deepspeed, is_fsdp2
from training.errors import UserError
from training.eval.metrics import LossTotals, batch_loss, mixture, split_batch, tags
from training.loggers import log_scalars, logs_this_update
from training.optim import OptimConfig, build_optimizer, check_group_names, param_groups, qk_clip
from training.optim.continuation import continue_schedule, schedule_record


def model_fields(init: Callable) -> Callable:
    """Give the function `init`, which takes the model's fields as `**fields`, a signature that lists every
    `ModelConfig` field as an optional keyword (None: the preset's value) — what LightningCLI reads to offer
    `--model.<field>`. So the dataclass is the one list of fields: a new field is a new flag, with its type."""
    own, hints = typing.get_type_hints(init), typing.get_type_hints(ModelConfig)
    signature = inspect.signature(init)
    params = [p.replace(annotation=own.get(p.name, p.annotation)) for p in signature.parameters.values()
              if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=Optional[hints[f.name]])  # noqa: UP045 (typing's form, as jsonargparse reads it)
               for f in dataclasses.fields(ModelConfig)]
    init.__signature__ = signature.replace(parameters=params)
    return init


class LitLM(LightningModule):
    """Next-token language modelling of a `model.Transformer` built from `preset` + field overrides."""

    def __init__(self, preset: str = "llama", optim: OptimConfig | None = None, compile: bool = False,
                 activation_checkpointing: bool = False, data_vocab_size: int | None = None,
                 data_seq_len: int | None = None, **fields: Any) -> None:
        """`preset` (see `model.PRESETS`) plus any `ModelConfig` field; `optim` is the `--optim.*` group.

        `compile`: `torch.compile` each block separately (regional, see model/optimize.py); `activation_checkpointing`:
        recompute each block in backward instead of keeping its activations. `data_vocab_size` / `data_seq_len`:
        the data's tokenizer size and sequence length (linked from the datamodule by the CLI), the defaults of
        `vocab_size` / `max_seq_len` — without them (and without those fields) the preset's values.
        """
        super().__init__()
        self.compile, self.activation_checkpointing = compile, activation_checkpointing
        self.preset = preset
        self.overrides = {k: v for k, v in fields.items() if v is not None}
        self.optim = OptimConfig(**optim) if isinstance(optim, dict) else (optim or OptimConfig())
        from_data = {k: v for k, v in (("vocab_size", data_vocab_size), ("max_seq_len", data_seq_len)) if v is not None}
        # The whole config now, so a bad value or an unknown field fails before anything starts.
        self.config = ModelConfig.preset(preset, **{**from_data, **self.overrides})
        qk_clip.check(self.optim.qk_clip, self.config)
        # Plain values only, so checkpoints stay loadable with weights_only=True (no pickled dataclasses).
        self.save_hyperparameters(ignore=["optim"])
        self.hparams["optim"] = dataclasses.asdict(self.optim)
        self.model: Transformer | None = None
        self.resumed_schedule: dict[str, Any] | None = None  # the resumed checkpoint's schedule record, if any
        self.resumed_from = "the resumed checkpoint"  # its path, for the messages
        self.schedule_record: dict[str, Any] | None = None  # the schedule configure_optimizers built
        self._micro_losses: list[Tensor] = []  # this update's micro-batch losses so far
        self._val_sets: list[Any] = []  # this validation's sets (the datamodule's `val_sets_order`)
        self._eval_totals: list[LossTotals] = []  # one accumulator per set
        self._piece_bytes: Tensor | None = None  # UTF-8 bytes per token id (the data's tokenizer): bits per byte

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        if datamodule is not None:  # a model set smaller than its data (or data given to Trainer.fit directly)
            datamodule.check_model(self.config.vocab_size, self.config.max_seq_len)

    def configure_model(self) -> None:
        # Built here, not in __init__: under ZeRO-3 Lightning calls this inside deepspeed.zero.Init, so each
        # parameter is partitioned as it is created and no rank ever holds the full model.
        if self.model is None:
            self.model = Transformer(self.config)
            init = self._init_from()
            if init is not None:  # before DeepSpeed copies the weights into its optimizer
                init.load_into(self)
            if self.config.tie_embeddings and hasattr(self.model.tok_embeddings.weight, "ds_id"):
                # ZeRO-3: a tied head reads the embedding's weight in Transformer.forward, after the embedding
                # module's hook released it; registered, it is fetched for the whole forward.
                import deepspeed

                deepspeed.zero.register_external_parameter(self.model, self.model.tok_embeddings.weight)
            enable_activation_checkpointing(self.model, self.activation_checkpointing)
            strategy = self._strategy()
            if is_fsdp2(strategy):  # each block compiled (if asked), then sharded: training/fsdp2.py
                strategy.shard(self.model, compile=self.compile)
            elif self.compile:
                compile_blocks(self.model)

    def _strategy(self) -> Any:
        """The trainer's strategy; None when not attached to a trainer (a module configured by hand)."""
        try:
            return self.trainer.strategy
        except RuntimeError:
            return None

    def _init_from(self) -> InitFrom | None:
        """`fit --init_from`: the run's source of weights, one of its trainer's callbacks (the CLI builds it with
        the others), which fills the model once built (checkpointing/init_from.py); None without one."""
        try:
            callbacks = self.trainer.callbacks
        except RuntimeError:  # not attached to a trainer (a module built and configured by hand)
            return None
        return next((c for c in callbacks if isinstance(c, InitFrom)), None)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def loss(self, batch: Tensor | dict[str, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of a batch [B, T+1] (`training.eval.metrics.batch_loss`, which
        `normlab evaluate` scores with too)."""
        return batch_loss(self.model, batch)

    def training_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        # the cross-entropy plus optim.z_loss · log²Z (the z term also returned, detached, for logging)
        tokens, positions = split_batch(batch)
        loss, z_loss = self.model(tokens[:, :-1], targets=tokens[:, 1:], z_loss=self.optim.z_loss, return_z_loss=True,
                                  position_ids=positions)
        self.log("step", float(self.global_step + 1))  # logged at the update's number (see _log_eval)
        # train/loss is the cross-entropy of the whole update: the mean over its micro-batches (Lightning logs the
        # value of the last one, so log the running mean) and over ranks — independent of how the batch is split.
        self._micro_losses.append((loss - z_loss).detach())
        if len(self._micro_losses) >= self.trainer.accumulate_grad_batches:
            # Only where the logger writes: a value logged with sync_dist is all-reduced on every call.
            if logs_this_update(self.trainer, self.global_step):
                if self.optim.z_loss:
                    self.log("train/z_loss", z_loss, sync_dist=True)
                self.log("train/loss", torch.stack(self._micro_losses).mean(), sync_dist=True)
                # Short name for the progress bar, copied to the host here (one sync, on a logging step):
                # Lightning reads every progress-bar value back after every batch — a GPU sync if on the GPU.
                self.log("loss", loss.detach().cpu(), prog_bar=True, logger=False)
            elif self.global_step == 0:
                self._log_initial_loss()
            self._micro_losses = []
        self._log_lrs()
        return loss

    def _log_initial_loss(self) -> None:
        """train/loss of update 1 — the untrained model's loss — at step 1 even when `log_every_n_steps` skips
        it: a diverged run counts as this loss in the sweep's learning-rate statistics, and a later one would
        depend on the LR. Once per fresh fit (one all-reduce, one host sync)."""
        loss = self.trainer.strategy.reduce(torch.stack(self._micro_losses).mean(), reduce_op="mean")
        log_scalars(self.trainer, {"train/loss": float(loss)}, step=1)

    # Validation/test: an exact mean over all batches of all ranks (`LossTotals`: sums, reduced once), so val/ppl
    # is exactly exp(val/loss). One accumulator per validation loader: the datamodule's `val_sets_order` names them
    # (mixture sources, named held-out sets); "" is the data's own validation split.
    def on_validation_epoch_start(self) -> None:
        datamodule = self.trainer.datamodule
        self._val_sets = list(getattr(datamodule, "val_sets_order", None) or [None])
        self._eval_totals = [LossTotals(device=self.device) for _ in self._val_sets]
        if self._piece_bytes is None and hasattr(datamodule, "piece_bytes"):  # (read once: the tokenizer is fixed)
            self._piece_bytes = datamodule.piece_bytes()
        if self._piece_bytes is not None:
            self._piece_bytes = self._piece_bytes.to(self.device)

    def validation_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_totals[dataloader_idx].add_batch(self.loss(batch), split_batch(batch)[0][:, 1:], self._piece_bytes)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    on_test_epoch_start = on_validation_epoch_start
    test_step = validation_step

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_eval(self, split: str) -> None:
        reduced = LossTotals.reduce_all(self._eval_totals, lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
        # TensorBoard step = updates done: train/loss at s is the loss of update s, val/loss at s is measured
        # on the weights after s updates — those of checkpoint step-s. (Lightning's default, the 0-based batch
        # index, is one less; it would also put a checkpoint's validation on the far side of a resume purge.)
        # The values are already identical on every rank; sync_dist only keeps Lightning from warning.
        if self.trainer.state.fn == "fit":  # (validate/test do not restore global_step: Lightning's default)
            self.log("step", float(self.global_step), sync_dist=True)
        values = [t.compute() for t in reduced]
        main = [(v.weight if v is not None else 1.0, x) for v, x in zip(self._val_sets, values, strict=True)
                if v is None or v.weight > 0]
        if main:  # (none when the data has no validation split of its own, only named held-out sets)
            self.log_dict(tags(split, mixture(main)), sync_dist=True)
        for val_set, x in zip(self._val_sets, values, strict=True):
            if val_set is not None and val_set.name:
                self.log_dict(tags(f"{split}/{val_set.name}", x), sync_dist=True)

    def _log_lrs(self) -> None:
        """train/lr: the schedule's LR (optim.lr · factor); train/lr_<group>: each group's (× its multipliers)."""
        schedule = self.lr_schedulers()
        lrs = schedule.get_last_lr()
        factor = next((lr / base for lr, base in zip(lrs, schedule.base_lrs, strict=True) if base), 0.0)
        self.log("train/lr", self.optim.lr * factor)
        for group, lr in zip(schedule.optimizer.param_groups, lrs, strict=True):
            self.log(f"train/lr_{group['name']}", lr)

    def configure_optimizers(self) -> dict[str, Any]:
        refusal = self.optim.optimizer().zero_refusal
        if refusal and is_deepspeed(self.trainer.strategy):
            raise UserError(f"optim.name={self.optim.name} does not run under DeepSpeed: {refusal}; use "
                            "--trainer.strategy fsdp2 (sharded), ddp or auto (or optim.name=adamw with DeepSpeed)")
        # A resume continues its checkpoint's schedule as optim.continuation says (the record: `normlab fit`)
        optim, total = continue_schedule(self.resumed_schedule, self.optim,
                                         self.trainer.estimated_stepping_batches, self.resumed_from)
        self.schedule_record = schedule_record(optim, total)  # recorded in each checkpoint's manifest
        optimizer, schedule = build_optimizer(self.model, optim, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = self.config.to_dict()  # how to rebuild the Transformer from this file

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # before the optimizer state loads (by group position): a fit's groups must be the checkpoint's
        try:
            fitting = self.trainer.state.fn == "fit"
        except RuntimeError:  # not attached to a Trainer (`LitLM.load_from_checkpoint`)
            return
        if not fitting:
            return
        for state in checkpoint.get("optimizer_states") or []:
            check_group_names([g.get("name") for g in state["param_groups"]], param_groups(self.model, self.optim))


@model_fields
def lit_lm(preset: str = "llama", optim: OptimConfig | dict[str, Any] | None = None, compile: bool = False,
           activation_checkpointing: bool = False, data_vocab_size: int | None = None,
           data_seq_len: int | None = None, **fields: Any) -> LitLM:
    """`LitLM(...)` as LightningCLI's `model` group: its signature lists every `ModelConfig` field (see
    `model_fields`; on `LitLM.__init__` itself it would confuse Lightning's `save_hyperparameters`).

    `optim` is the `optim` group, linked in by the CLI. LightningCLI also parses a `--ckpt_path FILE`'s recorded
    hyper-parameters into this group (the link then replaces `optim`), so any recorded form is accepted here: a
    checkpoint from before `optim.options` records the flat `muon_*` fields."""
    return LitLM(preset, optim, compile, activation_checkpointing, data_vocab_size, data_seq_len, **fields)
