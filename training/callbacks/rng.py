"""Save and restore every rank's random-number generators with each checkpoint.

Lightning does not checkpoint RNG state, so without this a resumed run draws different random numbers
(dropout masks, sampling, anything stochastic) than the uninterrupted run would have.

Semantics: the RNG state at the start of training step s+1 equals the state at the end of step s — in a
straight run and after resuming from the checkpoint of step s alike. Two things would break that, so both
are neutralised here:
- validation draws random numbers (each DataLoader iterator takes a seed from torch's CPU generator, before
  any validation hook runs), so the training streams are put back as they were when the last training batch
  ended;
- a resumed run creates its iterators (and may run a sanity check) before the first step, so the loaded
  state is applied at the first training batch, not when the checkpoint is read.

All states are plain Python values and tensors (no numpy objects), so checkpoints load with
`torch.load(weights_only=True)`.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from training.distributed import gather_objects

CHECKPOINT_KEY = "rng_states"  # a list indexed by global rank


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch and (if initialized) CUDA generator states."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one device per rank
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGState(Callback):
    """Checkpoints all ranks' RNG states and restores this rank's on resume (see the module docstring)."""

    def __init__(self) -> None:
        self._torch_after_last_batch: torch.Tensor | None = None
        self._restore_at_next_step: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Only torch's CPU generator (~2 µs): the validation loader's iterator draws from it before
        # on_validation_start; python and numpy (~85 µs together) are still untouched there.
        self._torch_after_last_batch = torch.get_rng_state()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._torch_after_last_batch is not None:
            state = capture_rng()
            state["torch"] = self._torch_after_last_batch
            self._restore_at_next_step = state

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._restore_at_next_step is not None:
            restore_rng(self._restore_at_next_step)
            self._restore_at_next_step = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = gather_objects(capture_rng())  # a collective: every rank dumps the checkpoint

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(CHECKPOINT_KEY)
        if not states:
            rank_zero_warn("the checkpoint holds no RNG states: random streams will differ from the original run")
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(f"the checkpoint holds RNG states of {len(states)} ranks, this run has "
                           f"{trainer.world_size}: ranks without a saved state keep their seeded generators")
        if trainer.global_rank < len(states):
            self._restore_at_next_step = states[trainer.global_rank]
