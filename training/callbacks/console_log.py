"""Training's progress as log lines: the train loss every `every_n_steps` updates, and each validation's loss.

The progress bar is drawn for a terminal; a log that is not one (a sweep's `fit.log`, `nohup`, a Slurm job's
output) would show no loss until the run ends. These lines go through normlab's logger (training/console.py:
rank 0 only, `[HH:MM:SS training.callbacks.console_log] step 40/300: train/loss 5.4321`), few enough not to
crowd a terminal: the default 20 gives 15 train lines and one line per validation in the default 300-step job.

The values are the ones the loggers write: `train/loss` of the update (the mean over its micro-batches and
ranks), printed on the first update at or after each multiple of `every_n_steps` whose metrics the logger
writes (`trainer.log_every_n_steps`; the default 10 divides the default 20), and the validation's `val/*loss`.
Lightning copies a step's logged values to `trainer.callback_metrics` only after every `on_train_batch_end`, so a
due train line is printed at the next hook that sees them: the next batch's start, a validation's start, or the
end of training.
"""
from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.loggers import logs_this_update

log = logging.getLogger(__name__)


class ConsoleLog(Callback):
    """One log line per `every_n_steps` updates with `train/loss` (0: none) and one per validation with its
    losses, during `fit` (validate/test print their own table)."""

    def __init__(self, every_n_steps: int = 20) -> None:
        if every_n_steps < 0:
            raise ValueError(f"console.every_n_steps={every_n_steps} must be >= 0 (0: no train-loss lines; each "
                             "validation still prints one)")
        self.every_n_steps = every_n_steps
        self._seen = 0  # the global step of the last update boundary seen
        self._next = every_n_steps  # the step from which the next train line is due
        self._pending: int | None = None  # a due step whose logged train/loss is not yet in callback_metrics

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen = trainer.global_step  # (a resumed run goes on from its checkpoint's step)
        self._next = (trainer.global_step // self.every_n_steps + 1) * self.every_n_steps if self.every_n_steps \
            else 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._seen or not self.every_n_steps or not trainer.is_global_zero:
            return  # inside a gradient accumulation, or no train lines, or not rank 0
        self._seen = step
        # LitLM logs train/loss of update `step` only where the logger writes it: print only that value.
        if step >= self._next and logs_this_update(trainer, step - 1):
            self._pending = step
            self._next = (step // self.every_n_steps + 1) * self.every_n_steps

    def _flush(self, trainer: Trainer) -> None:
        """Print the pending train line, now that Lightning has copied the update's logged values."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            log.info("%s: train/loss %.4f", _at(trainer, step), float(loss))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._flush(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)  # the update's train line before its validation's

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.is_global_zero:
            return
        losses = {k: float(v) for k, v in trainer.callback_metrics.items()
                  if k.startswith("val/") and k.endswith("/loss")}
        if losses:  # the data's own split first, then any named held-out sets
            text = " · ".join(f"{k} {losses[k]:.4f}" for k in sorted(losses, key=lambda k: (k != "val/loss", k)))
            log.info("%s: %s", _at(trainer, trainer.global_step), text)


def _at(trainer: Trainer, step: int) -> str:
    """`step s/max_steps` (the step as TensorBoard's: updates done), or `step s` for a run without max_steps."""
    return f"step {step}/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else f"step {step}"
