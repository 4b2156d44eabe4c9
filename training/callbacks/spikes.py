"""Spike forensics: when a step's loss z-score (`guard/loss_z`, callbacks/guard.py) exceeds
`guard.dump_spike_z`, write what that step saw and did to `<run dir>/spikes/step-XXXXXXXX/`.

The step number is the update's, as `guard/loss_z` in TensorBoard (the update computed while global_step is s
is step s+1). A dump is written into `spikes/.tmp-step-X/`, fsynced and renamed, so a `step-X` directory is
always whole; at most `guard.max_dumps` are written per run directory (the ones already there from earlier
starts of the run, up to the step it resumed at, count). It holds:

- `batch.safetensors`: `tokens`, int64 [world_size, accumulate_grad_batches, batch_size, seq_len + 1] — every
  micro-batch of the step on every rank (inputs `[..., :-1]`, targets `[..., 1:]`); under `data.document_mask`
  also `position_ids`, int64, the same shape (the positions the model ran at: they mark the documents);
  `losses`, fp32 [world_size, accumulate_grad_batches] — each micro-batch's training loss;
- `spike.json`: `step`, `loss` (the step's training loss, mean over micro-batches and ranks), `z`,
  `threshold`, `window` (size, mean and standard deviation of the earlier losses the z-score is against), `lr`
  (of the update), `tokens_seen` (before the step), `world_size`, `accumulate_grad_batches`, `applied` (false
  when the guard skipped the update), and per group of parameters — `L{i}` for block i, `tok_embeddings`,
  `norm`, `output` (when untied), and `global` for all of them:
  - `grad_norm`: the L2 norm of the update's gradient (reduced over ranks and micro-batches, before
    clipping);
  - `update_norm`: the Adam update norm, ‖θ_after − θ_before‖₂: the parameter change that this step's
    optimizer step actually made (lr · AdamW's direction plus the decoupled weight decay, after gradient
    clipping; 0 for a skipped update), measured after the step;
  - `param_norm`: ‖θ_before‖₂, and `update_ratio` = update_norm / param_norm.

Under DeepSpeed (ZeRO 0-3) gradients and fp32 weights are read in full with DeepSpeed's `safe_get_full_grad`
and `safe_get_full_fp32_param` (collectives: every rank calls them, in the same order, on the same steps —
the z-score is the same on every rank); rank 0 writes. Tested single process and 2-rank ZeRO-2 (ZeRO-3 takes
the same gathers, untested). When `guard.skip_spike_z` also drops the step under
DeepSpeed, its gradient was made NaN on purpose (see guard.py), so its `grad_norm` values are NaN.
Cost: nothing on other steps (the step's batches are only referenced); on a dump step one fp32 copy of the
weights in host memory and a gather of the batch.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from data.atomic import fsync_path
from model.names import layer_index
from model.probes import grad_norms
from training import health_tags as T
from training.distributed import full_grad, full_param, gather_objects, is_deepspeed
from training.run.layout import SPIKES_DIR, TMP_PREFIX, step_dirname, step_of_name
from training.stats import mean_and_sd

log = logging.getLogger(__name__)

BATCH_FILE, SPIKE_FILE = "batch.safetensors", "spike.json"


def group_of(name: str) -> str:
    """`L{i}` for a parameter of block i, else the top-level module (`tok_embeddings`, `norm`, `output`)."""
    index = layer_index(name)
    return f"L{index}" if index is not None else name.split(".")[0]


def _full_weights(pl_module: LightningModule, deepspeed: bool) -> dict[str, torch.Tensor]:
    """Every parameter of the model in full fp32, copied to host memory (under ZeRO: a collective)."""
    return {name: full_param(p, deepspeed).float().to("cpu", copy=True)
            for name, p in pl_module.model.named_parameters()}


def _norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """L2 norm per `group_of` group, and `global`, in float64."""
    sq: dict[str, float] = {}
    for name, t in tensors.items():
        sq[group_of(name)] = sq.get(group_of(name), 0.0) + t.double().pow(2).sum().item()
    return {**{k: math.sqrt(v) for k, v in sq.items()}, "global": math.sqrt(sum(sq.values()))}


def dumps_in(run_dir: str | Path, up_to_step: int) -> int:
    """Complete dumps of the run directory at steps <= `up_to_step`."""
    root = Path(run_dir) / SPIKES_DIR
    if not root.is_dir():
        return 0
    return sum(1 for p in root.iterdir() if (step := step_of_name(p.name)) is not None and step <= up_to_step)


class SpikeRecorder:
    """The guard's spike dumps (see the module docstring); inert when `threshold` is None."""

    def __init__(self, threshold: float | None, max_dumps: int) -> None:
        self.threshold, self.max_dumps = threshold, max_dumps
        self.dumps = 0
        self._batches: list[dict[str, torch.Tensor]] = []  # this step's micro-batches (references, no copies)
        self._losses: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None  # a dump taken before the optimizer step

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def start(self, trainer: Trainer) -> None:
        """Count the dumps an earlier start of this run left (rank 0 reads, every rank gets the count)."""
        if self.enabled:
            found = dumps_in(trainer.default_root_dir, trainer.global_step) if trainer.is_global_zero else 0
            self.dumps = int(trainer.strategy.broadcast(found))

    def observe_batch(self, batch: torch.Tensor | dict[str, torch.Tensor], first_micro_batch: bool) -> None:
        """A micro-batch as the datamodule yields it: token ids [B, T+1], or under document masking the dict
        `{"tokens", "position_ids"}`."""
        if first_micro_batch:
            self._batches, self._losses = [], []
        batch = batch if isinstance(batch, dict) else {"tokens": batch}
        self._batches.append({k: v.detach() for k, v in batch.items()})

    def observe_loss(self, loss: torch.Tensor, accumulate: int) -> None:
        self._losses.append(loss.detach().float() * accumulate)  # Lightning divided it by the accumulation

    def due(self, z: float) -> bool:
        return self.enabled and self.dumps < self.max_dumps and z > self.threshold

    def before_step(self, trainer: Trainer, pl_module: LightningModule, step: int, loss: float, z: float,
                    window: list[float]) -> None:
        """On every rank, before the optimizer step of a spiking update: gradients, weights, batch."""
        deepspeed = is_deepspeed(trainer.strategy)
        self.dumps += 1
        grads = grad_norms(pl_module.model, partial(full_grad, deepspeed=deepspeed))
        # per key, [ranks, accumulate, B, T+1]: every rank's micro-batches
        arrays = {key: torch.stack(gather_objects(torch.stack([b[key] for b in self._batches]).cpu()))
                  for key in self._batches[0]}
        losses = gather_objects(torch.stack(self._losses).cpu() if self._losses else torch.zeros(0))
        accumulate = trainer.accumulate_grad_batches
        mean, std = mean_and_sd(window)
        self._pending = {
            "before": _full_weights(pl_module, deepspeed), "arrays": arrays, "losses": torch.stack(losses),
            "record": {
                "step": step, "loss": loss * accumulate, "z": z, "threshold": self.threshold,
                "window": {"size": len(window), "mean": mean * accumulate, "std": std * accumulate},
                "lr": trainer.optimizers[0].param_groups[0]["lr"], "tokens_seen": trainer.datamodule.tokens_seen(),
                "world_size": trainer.world_size, "accumulate_grad_batches": accumulate,
                "grad_norm": {k.removeprefix(f"{T.GRAD_NORM}/").replace(T.GRAD_GLOBAL, "global"): v
                              for k, v in grads.items()},
            },
        }

    def after_step(self, trainer: Trainer, pl_module: LightningModule, applied: bool) -> None:
        """On every rank, after the optimizer step: the update norms; then rank 0 writes the dump."""
        pending, self._pending = self._pending, None
        self._batches, self._losses = [], []
        if pending is None:
            return
        after = _full_weights(pl_module, is_deepspeed(trainer.strategy))
        before = pending["before"]
        record = pending["record"]
        record["applied"] = applied
        record["update_norm"] = _norms({k: after[k] - before[k] for k in before})
        record["param_norm"] = _norms(before)
        record["update_ratio"] = {k: v / record["param_norm"][k] if record["param_norm"][k] else 0.0
                                  for k, v in record["update_norm"].items()}
        if trainer.is_global_zero:
            self._write(Path(trainer.default_root_dir), record, pending["arrays"], pending["losses"])

    def _write(self, run_dir: Path, record: dict[str, Any], arrays: dict[str, torch.Tensor],
               losses: torch.Tensor) -> None:
        from safetensors.torch import save_file

        root = run_dir / SPIKES_DIR
        name = step_dirname(record["step"])
        final, tmp, old = root / name, root / (TMP_PREFIX + name), root / (".old-" + name)
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted dump
            tmp.mkdir()
            save_file({**{k: v.contiguous() for k, v in arrays.items()}, "losses": losses.float().contiguous()},
                      str(tmp / BATCH_FILE))
            with open(tmp / SPIKE_FILE, "w") as f:
                f.write(json.dumps(record, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp / BATCH_FILE)
            fsync_path(tmp)
            if final.exists():  # the same step again, after a resume from an earlier checkpoint: replace it
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_path(root)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as err:  # forensics must not end the run: say so, leave no partial dump
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():
                os.replace(old, final)
            log.error("could not write the spike dump of step %d to %s: %s", record["step"], final, err)
            return
        log.warning("loss spike at step %d (z=%.1f > guard.dump_spike_z=%g): its batch, gradient and update norms are "
                    "in %s (dump %d of at most %d)", record["step"], record["z"], self.threshold, final, self.dumps,
                    self.max_dumps)
