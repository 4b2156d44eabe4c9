"""`StopOnSignal`: the one owner of a fit's stop requests, from the handlers' lifetime to the requeue after the fit.

SIGTERM, Ctrl-C and the cluster's warning signal are recorded by the process's handlers (signals.py); at every
update boundary the ranks agree whether to stop after this step (`decision`, the same on every rank), and a stop
ends the fit after it, as `max_steps` does. `StepCheckpoint` (training/callbacks/step_checkpoint.py) reads the
decision and saves that step as the fit's last: it only decides when to save, as OLMo-core's checkpointer does
beside a trainer that owns cancelling (olmo_core/train/trainer.py, callbacks/checkpointer.py). After a fit the
warning stopped short of `max_steps`, rank 0 requeues the Slurm job (`requeue_if_warned`, called by the CLI once
the fit is over: the requeue ends the job at once).

The lifetime, hook by hook: `setup` takes the trainer's signal handling from Lightning (`compat.own_signals`) and
names the warning signal and the flags' timeout (`cluster.*`), installing the handlers when no `normlab fit`
installed them first; `on_train_start` connects the ranks' flag group (a collective) and forwards a signal to the
ranks Lightning spawned; each update boundary agrees; `on_train_end` says which signal stopped the fit and how long
after it the step was saved, waits for the last all-reduce and restores `max_steps`; `on_exception` releases the
handlers it installed.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.cluster import signals
from training.cluster.config import ClusterConfig
from training.cluster.requeue import requeue
from training.compat import own_signals, require
from training.run.layout import complete_checkpoints, step_of

log = logging.getLogger(__name__)


class StopOnSignal(Callback):
    """Agrees at every update boundary whether the ranks stop after this step (`decision`); see the module
    docstring. `config`: the run's `cluster.*` settings."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.decision = signals.Decision(stop=False, warned=False)  # agreed at the latest update boundary
        self._signals: signals.StopSignals | None = None  # the process's stop handlers
        self._own_handlers = False  # installed here (no `normlab fit` around this fit): restored at its end
        self._boundary = -1  # the global step of the last update boundary seen
        self._max_steps: int | None = None  # the trainer's, while a stop has lowered it to the stop's step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # In place before Lightning would install its own handlers, which it does after the setup hooks.
        own_signals(trainer)
        self._signals = signals.active()
        self._own_handlers = self._signals is None
        if self._own_handlers:
            self._signals = signals.install()
        self._signals.configure(self.config.signal, self.config.timeout)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._boundary = trainer.global_step
        if trainer.is_global_zero and getattr(trainer.strategy.launcher, "kill", None) is not None:
            self._signals.forward = trainer.strategy.launcher.kill  # the ranks Lightning spawned stop with this one
        self._signals.connect(trainer.world_size)  # a collective: every rank

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Called once per micro-batch: with gradient accumulation the step repeats until the next update.
        if step == self._boundary:
            return
        self._boundary = step
        self.decision = self._signals.agreed(trainer.world_size)  # a collective, at every boundary of every rank
        if self.decision.stop:
            # Ends the fit after this step, as max_steps does (trainer.should_stop would run one more validation).
            require("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.max_steps")
            self._max_steps = trainer.fit_loop.epoch_loop.max_steps  # given back when the fit has ended
            trainer.fit_loop.epoch_loop.max_steps = step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.decision.stop and trainer.is_global_zero:  # after the step's save (StepCheckpoint's batch end)
            self._log_stop(trainer.global_step)
        if self._signals is not None:
            self._signals.disconnect()  # every rank ends here: nothing of the flags' group left in flight
        self._release()
        if self._max_steps is not None:  # after a stop: what comes after the fit reads the run's own max_steps
            trainer.fit_loop.epoch_loop.max_steps, self._max_steps = self._max_steps, None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._signals is not None:
            self._signals.forward = None
        if self._own_handlers:
            signals.uninstall()
            self._own_handlers = False

    def _log_stop(self, step: int) -> None:
        """Which signal stopped the fit, and how long after it the step was saved: what a cluster's warning time
        (`#SBATCH --signal=USR1@<seconds>`) must exceed."""
        received = ", ".join(self._signals.received) or "another rank's signal"
        since = self._signals.since_first()
        after = "" if since is None else f"; saved {since:.1f} s after the signal"
        log.warning("stopping after step %d on %s%s", step, received, after)

    def requeue_if_warned(self, trainer: Trainer) -> None:
        """After the warning signal stopped the fit short of max_steps and saved its step: rank 0 asks Slurm to
        requeue the job (cluster.requeue), which resumes from that checkpoint (`--ckpt_path last`)."""
        if not (self.decision.stop and self.decision.warned and self.config.requeue and trainer.is_global_zero):
            return
        if 0 < trainer.max_steps <= trainer.global_step:
            return
        newest = complete_checkpoints(trainer.default_root_dir)
        if not newest or step_of(newest[-1]) != trainer.global_step:
            log.warning("warned at step %d, which has no complete checkpoint (checkpoint.every_n_steps=0?): not "
                        "requeued", trainer.global_step)
            return
        requeue(Path(trainer.default_root_dir), trainer.global_step, f"warned by SIG{self.config.signal}",
                self.config.max_requeues)
