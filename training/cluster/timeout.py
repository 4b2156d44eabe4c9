"""`CollectiveTimeout`: the run's collective timeout (`cluster.timeout_s`, config.py) on every process
group. The strategy's default group gets it at start-up; the groups made later without a timeout — DeepSpeed's
among them — would get the backend's default (gloo: 30 minutes), so once training starts, with every group made,
each is given the run's."""
from __future__ import annotations

from datetime import timedelta

from lightning.pytorch import Callback, LightningModule, Trainer

from training.compat import set_collective_timeout


class CollectiveTimeout(Callback):
    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        set_collective_timeout(self.timeout)
