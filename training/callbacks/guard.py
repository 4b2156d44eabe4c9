"""Non-finite guard: never let a NaN/Inf loss or gradient reach the weights, and watch for loss spikes.

At every optimizer step, before the update (Lightning's `on_before_optimizer_step`; under DeepSpeed, which
accumulates gradients itself and so is called every micro-batch, only at the accumulation boundary):
- the step's loss (mean of its micro-batches) is checked on every rank and the verdict reduced over ranks;
- every parameter's gradient is checked (under ZeRO first by the optimizer's cheap partition-local overflow test,
  then, only if it fires, through `safe_get_full_grad`, a collective that all ranks call in the same order —
  so a healthy step costs one all-reduced flag, not a gather of the gradient); the reduced gradients are
  the same on every rank, so every rank reaches the same verdict and no rank is left waiting in a collective.

Policies (`--guard.policy`):
- `abort` (default): raise before the optimizer step — the weights, optimizer state and checkpoints stay as
  they were after the previous step — naming the step and the first parameter (in model order) whose
  gradient is non-finite.
- `skip`: drop the update and count it; abort when more than `max_consecutive_skips` steps in a row would be
  skipped.
  Without DeepSpeed the gradients are set to None, which `torch.optim.AdamW` skips entirely (no moment or
  weight-decay update; the LR schedule still advances with the step counter). Under DeepSpeed the update
  cannot be dropped from outside the engine: its ZeRO optimizer skips a step whose gradient norm is
  non-finite itself (its overflow check, also in fp32) — the guard relies on that and verifies it through
  `engine.skipped_steps`, raising if the engine applied the step anyway.
DeepSpeed's own skipped steps (bf16/fp32 overflow checks) are logged and count toward `max_consecutive_skips` too.

fp16 with a dynamic loss scale (Lightning's GradScaler, or DeepSpeed's fp16 loss scaler) is the exception: there an
overflowing gradient with a finite loss is routine — the scaler skips the update and lowers its scale — so the
guard neither aborts nor counts it, and logs `guard/scaler_overflows` instead. (A scale that keeps collapsing
ends the run in the scaler itself: DeepSpeed stops at its minimum scale.)

Loss spikes: the z-score of the step's loss against the previous `spike_window` finite losses of applied steps
(`training.stats.loss_z`, the rule a sweep counts spikes by) is logged as `guard/loss_z`. With `skip_spike_z` set
(policy `skip`), steps whose z-score exceeds it are skipped as above. Under DeepSpeed the verdict is reached before
the last micro-batch's backward (the step's losses are known by then), and a spiking step's gradient is made NaN
through a hook on that loss, so the engine's own overflow check drops the update — the same, verified path as a
real overflow. (With fp16 dynamic loss scaling that also halves the loss scale once, as any overflow does.)

Spike forensics: with `dump_spike_z` set, a step whose z-score exceeds it (with any policy) has its batch,
per-layer gradient norms and Adam update norms written to `<run dir>/spikes/step-XXXXXXXX/`, at most `max_dumps`
per run (callbacks/spikes.py).

Step numbers are update numbers, as in TensorBoard: the update computed while `global_step == s` is step s+1.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from model.names import layer_index
from training.callbacks.spikes import SpikeRecorder
from training.compat import zero_optimizer_internal
from training.distributed import full_grad, is_deepspeed, local
from training.loggers import log_scalars
from training.stats import loss_z

log = logging.getLogger(__name__)

POLICIES = ("abort", "skip")


class NonFiniteError(RuntimeError):
    """Training stopped before an update with a non-finite loss or gradient (or too many skipped steps)."""


def _scaler_skips_overflows(trainer: Trainer, deepspeed: bool) -> bool:
    """fp16 with a dynamic loss scale: the scaler itself skips a step whose gradient overflowed."""
    if deepspeed:
        engine = trainer.strategy.deepspeed_engine
        # fp16 autocast (16-mixed, training/strategy.py): the ZeRO optimizer's own torch GradScaler
        autocast_scaler = zero_optimizer_internal(engine.optimizer, "torch_autocast_gradscaler") is not None
        return bool(engine.fp16_enabled() and engine.dynamic_loss_scale()) or autocast_scaler
    return getattr(trainer.precision_plugin, "scaler", None) is not None


def _count_nonfinite(params: Any) -> torch.Tensor:
    """How many of the parameters' gradients hold a NaN or Inf, as a device tensor (no host sync). Under FSDP2
    each rank counts its own rows of each gradient (a DTensor's local shard): the sum over ranks, which the loss's
    reduction takes, is nonzero exactly when some gradient is non-finite somewhere."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().sum().float()


def _layer(name: str) -> str:
    index = layer_index(name)
    return f"layer L{index} ({name})" if index is not None else name


class NonFiniteGuard(Callback):
    def __init__(self, policy: str = "abort", max_consecutive_skips: int = 3, spike_window: int = 50,
                 skip_spike_z: float | None = None, dump_spike_z: float | None = None, max_dumps: int = 5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"guard.policy={policy!r} is not one of {list(POLICIES)}")
        if max_consecutive_skips < 1:
            raise ValueError(f"guard.max_consecutive_skips={max_consecutive_skips} must be >= 1")
        if spike_window < 2:
            raise ValueError(f"guard.spike_window={spike_window} must be >= 2")
        if skip_spike_z is not None and (skip_spike_z <= 0 or policy != "skip"):
            raise ValueError(f"guard.skip_spike_z={skip_spike_z} needs a positive value and guard.policy=skip")
        if dump_spike_z is not None and not dump_spike_z > 0:
            raise ValueError(f"guard.dump_spike_z={dump_spike_z} must be > 0 (a loss z-score), or null for no dumps")
        if max_dumps < 1:
            raise ValueError(f"guard.max_dumps={max_dumps} must be >= 1 (set guard.dump_spike_z null for none)")
        self.policy, self.max_consecutive_skips = policy, max_consecutive_skips
        self.spike_window, self.skip_spike_z = spike_window, skip_spike_z
        self.skipped = 0  # steps skipped in this run, across restarts (by the guard or by DeepSpeed)
        self.consecutive = 0
        self._losses: deque[float] = deque(maxlen=spike_window)
        self._step_losses: list[torch.Tensor] = []
        self.scaler_overflows = 0  # fp16 loss-scale overflows (the scaler's skips, not faults)
        self._skip_this_step = False
        self._scaler_overflow = False  # this step overflowed under an fp16 loss scaler
        self._decided = False  # on_before_optimizer_step ran for the current step
        self._ds_skipped = 0
        self._judged: tuple[bool, float, float] | None = None  # the step's loss verdict, when reached early
        self.dump_spike_z, self.max_dumps = dump_spike_z, max_dumps
        self._spikes = SpikeRecorder(dump_spike_z, max_dumps)

    # Saved in every checkpoint, so a resumed run judges spikes against the same window and keeps counting.
    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self._losses), "skipped": self.skipped, "consecutive": self.consecutive,
                "scaler_overflows": self.scaler_overflows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._losses.extend(state_dict["losses"])  # (the newest spike_window of them)
        self.skipped, self.consecutive = state_dict["skipped"], state_dict["consecutive"]
        self.scaler_overflows = state_dict["scaler_overflows"]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_deepspeed(trainer.strategy):
            self._ds_skipped = trainer.strategy.deepspeed_engine.skipped_steps
        self._spikes.start(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._spikes.enabled:
            self._spikes.observe_batch(batch, batch_idx % trainer.accumulate_grad_batches == 0)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._step_losses.append(loss.detach())
        if self._spikes.enabled:
            self._spikes.observe_loss(loss, trainer.accumulate_grad_batches)
        if self.skip_spike_z is None or not is_deepspeed(trainer.strategy):
            return
        if not trainer.strategy.deepspeed_engine.is_gradient_accumulation_boundary():
            return
        # The engine applies any step with a finite gradient: decide now, while the gradient can still be poisoned.
        self._judged = self._judge_loss(trainer, pl_module)[:3]
        if self._is_spike(*self._judged):
            loss.register_hook(lambda grad: torch.full_like(grad, float("nan")))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        deepspeed = is_deepspeed(trainer.strategy)
        if deepspeed and not trainer.strategy.deepspeed_engine.is_gradient_accumulation_boundary():
            return
        step = trainer.global_step + 1
        self._decided = True
        if self._judged is not None:  # (DeepSpeed with skip_spike_z: judged before the last backward)
            (loss_ok, loss, z), local_bad = self._judged, None
        else:  # without DeepSpeed, every gradient's finiteness rides in the loss's reduction: one sync in all
            local_bad = None if deepspeed else _count_nonfinite(pl_module.model.parameters())
            loss_ok, loss, z, grads_bad = self._judge_loss(trainer, pl_module, local_bad)
        self._judged = None
        spike = self._is_spike(loss_ok, loss, z)
        # Under DeepSpeed a spiking step's gradient was made NaN on purpose (on_before_backward): not a fault.
        if deepspeed:
            bad = [] if spike else self._nonfinite_grads(trainer, pl_module, deepspeed)
        else:  # names only when some gradient is bad (then a read per parameter is no matter)
            bad = self._nonfinite_grads(trainer, pl_module, deepspeed) if grads_bad else []
        if loss_ok and bad and _scaler_skips_overflows(trainer, deepspeed):
            self._scaler_overflow = True
            self.scaler_overflows += 1
            log.info("fp16 gradient overflow at step %d: the loss scaler skips it and lowers its scale", step)
            self._log(trainer, {"guard/scaler_overflows": float(self.scaler_overflows)}, step)
            return
        if not loss_ok or bad:
            what = (f"non-finite gradient, first in {_layer(bad[0])} ({len(bad)} parameters)" if bad else
                    "non-finite loss")
            if self.policy == "abort":
                raise NonFiniteError(
                    f"{what} at step {step}: stopped before the optimizer step (guard.policy=abort); the weights "
                    "and checkpoints are those of the previous step. Lower the learning rate, check the data, "
                    "or use --guard.policy skip")
            self._skip(trainer, pl_module, deepspeed, f"{what} at step {step}")
            return
        self._log(trainer, {"guard/loss_z": z}, step)
        if self._spikes.due(z):  # (the same verdict on every rank: the dump's gathers are collectives)
            self._spikes.before_step(trainer, pl_module, step, loss, z, list(self._losses))
        if spike:
            self._skip(trainer, pl_module, deepspeed, f"loss spike at step {step} (z={z:.1f})")
            return
        self._losses.append(loss)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not self._decided:  # not the end of an optimizer step (gradient accumulation)
            return
        applied = not self._skip_this_step
        if is_deepspeed(trainer.strategy):
            engine = trainer.strategy.deepspeed_engine
            new, self._ds_skipped = engine.skipped_steps - self._ds_skipped, engine.skipped_steps
            if self._skip_this_step and new == 0:
                raise NonFiniteError(f"DeepSpeed applied step {trainer.global_step}, which the guard found "
                                     "non-finite, so it cannot be skipped under this engine: use guard.policy=abort")
            if new and self._scaler_overflow:
                applied = False  # the scaler's routine skip: neither applied nor a fault
            elif new and applied:
                applied = False
                self._count_skip(trainer, f"DeepSpeed skipped step {trainer.global_step} (overflow)",
                                 trainer.global_step)
        if applied and not self._scaler_overflow:  # (without DeepSpeed the GradScaler skipped it)
            self.consecutive = 0
        self._spikes.after_step(trainer, pl_module, applied and not self._scaler_overflow)
        self._skip_this_step = self._scaler_overflow = self._decided = False

    # -- helpers -----------------------------------------------------------------------------------------
    def _judge_loss(self, trainer: Trainer, pl_module: LightningModule,
                    grads_bad: torch.Tensor | None = None) -> tuple[bool, float, float, int]:
        """(finite on every rank, the step's loss: mean over micro-batches and ranks, its z-score, the number of
        non-finite gradients summed over ranks — of `grads_bad`, this rank's count, 0 if None). A collective:
        every rank calls it at the same point, and all get the same verdict. One read of a device value in all
        (the only host sync of a healthy step: the z-score needs the loss on the host)."""
        local = torch.stack(self._step_losses).float().mean() if self._step_losses else torch.zeros(())
        self._step_losses = []
        local = local.to(pl_module.device)
        finite = torch.isfinite(local)
        bad = grads_bad.to(local) if grads_bad is not None else torch.zeros_like(local)
        # [sum of finite losses, non-finite loss count, non-finite gradient count] over ranks.
        totals = trainer.strategy.reduce(torch.stack([torch.where(finite, local, 0.0), (~finite).float(), bad]),
                                         reduce_op="sum")
        loss_sum, loss_bad, nbad = totals.tolist()
        loss = loss_sum / trainer.world_size
        return loss_bad == 0, loss, self._zscore(loss) if loss_bad == 0 else 0.0, int(nbad)

    def _is_spike(self, loss_ok: bool, loss: float, z: float) -> bool:
        return loss_ok and self.skip_spike_z is not None and z > self.skip_spike_z

    def _nonfinite_grads(self, trainer: Trainer, pl_module: LightningModule, deepspeed: bool) -> list[str]:
        if deepspeed:
            # The ZeRO optimizer's own overflow test reads each rank's gradient partition and all-reduces one
            # flag: cheap. Only when it fires are the full gradients gathered, to name the first bad layer.
            has_overflow = zero_optimizer_internal(trainer.strategy.deepspeed_engine.optimizer, "has_overflow")
            if has_overflow is not None and not has_overflow(partition_gradients=True):
                return []
        bad = []
        for name, p in pl_module.model.named_parameters():
            g = full_grad(p, deepspeed)  # under ZeRO: every rank, every parameter, same order (a collective)
            if g is not None and not torch.isfinite(g).all():
                bad.append(name)
        return bad

    def _skip(self, trainer: Trainer, pl_module: LightningModule, deepspeed: bool, why: str) -> None:
        if not deepspeed:
            for p in pl_module.parameters():
                p.grad = None  # AdamW skips parameters without a gradient: no update, no state change
        self._skip_this_step = True
        self._count_skip(trainer, why, trainer.global_step + 1)

    def _count_skip(self, trainer: Trainer, why: str, step: int) -> None:
        self.skipped += 1
        self.consecutive += 1
        log.warning("skipped update: %s (%d skipped, %d in a row)", why, self.skipped, self.consecutive)
        self._log(trainer, {"guard/skipped_steps": float(self.skipped)}, step)
        if self.consecutive > self.max_consecutive_skips:
            raise NonFiniteError(f"{why}: {self.consecutive} consecutive updates skipped "
                                 f"(guard.max_consecutive_skips={self.max_consecutive_skips}); training stopped")

    def _zscore(self, loss: float) -> float:
        # the one definition: a sweep's spike count (training.stats.count_spikes) replays it over logged losses
        return loss_z(self._losses, loss)

    @staticmethod
    def _log(trainer: Trainer, values: dict[str, float], step: int) -> None:
        log_scalars(trainer, values, step)
