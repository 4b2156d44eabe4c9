"""Progress bars that count an endless, step-limited run: micro-batches toward `max_steps × accumulation`.

Lightning's bars assume epochs: with normlab's endless loader (`max_epochs=-1`, training ends at `max_steps`)
the Rich bar is titled "Epoch 0/-2", and both bars compare the micro-batch count with `max_steps` optimizer
steps ("16/8" with accumulation 2). These subclasses fix the total and the title; the CLI swaps them in for
Lightning's default bar (when the config names a progress bar, it is left alone).
"""
from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar

TITLE = "Training"


class _StepTotal:
    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps > 0:
            # The epoch's batch counter runs over the whole run (it is restored on resume): the run's total.
            return trainer.max_steps * trainer.accumulate_grad_batches
        return super().total_train_batches


class StepRichProgressBar(_StepTotal, RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        return f"{TITLE:{len(self.validation_description)}}"  # padded as the parent does, against flicker


class StepTQDMProgressBar(_StepTotal, TQDMProgressBar):
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self.train_progress_bar.set_description(TITLE)


def step_counting(callback: Callback) -> Callback:
    """The step-counting version of Lightning's default bar; any other callback unchanged."""
    if type(callback) is RichProgressBar:
        return StepRichProgressBar()
    if type(callback) is TQDMProgressBar:
        return StepTQDMProgressBar()
    return callback
