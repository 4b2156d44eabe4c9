"""The order a run's callbacks run in: one table, each position with its reason.

Lightning calls the callbacks of every hook in list order and has no priority of its own, so where one callback must
see another's work, the list order is the contract. `ORDER` states it; `arrange` puts a trainer's callbacks in it
(NormlabCLI, once the trainer and the run's own callbacks are built). A callback is placed by the first row whose
class it is an instance of; the `REST` row holds everything no row names, in the order it was added: the callbacks
configured in `trainer.callbacks`, Lightning's own (the model summary, a Timer, …), `InitFrom` and `ConsoleLog` (it
prints values Lightning has already copied) — none of them depends on its place among the run's callbacks.
"""
from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.cli import SaveConfigCallback

from training.callbacks.downstream import DownstreamEval
from training.callbacks.guard import NonFiniteGuard
from training.callbacks.health import TrainingHealth
from training.callbacks.qk_clip import QKClip
from training.callbacks.rng import RNGState
from training.callbacks.step_checkpoint import StepCheckpoint
from training.callbacks.throughput import Throughput
from training.checkpointing.branch import BranchSchedule
from training.cluster.stop import StopOnSignal
from training.loggers import RecordLoggerRuns

REST = None  # the row of every callback no other row names

ORDER: tuple[tuple[type[Callback] | None, str], ...] = (
    (RNGState, "first of all: every other callback's on_train_batch_start draws from the random streams it "
               "restores after a resume or a validation"),
    (BranchSchedule, "before any other on_train_start: a branch's own LR schedule is in place before anything else "
                     "sees the optimizer"),
    (REST, "the callbacks configured in trainer.callbacks come before the run's own: one that changes the loss or "
           "the gradients (a fault injector, an extra loss term) acts before the guard judges them"),
    (QKClip, "on_train_batch_end before the health callback's and the checkpoint's: MuonClip's step is the "
             "optimizer's update and then the clip, so the step's update ratio and its checkpoint include the clip"),
    (TrainingHealth, "on_before_optimizer_step before the guard's: the step's gradient norms are logged before the "
                     "guard drops the gradients of a step it skips, or stops the run"),
    (NonFiniteGuard, "on_train_batch_end before the checkpoint's: the step's verdict is settled (an applied update "
                     "resets the skips in a row, DeepSpeed's own skips are counted, a non-finite update DeepSpeed "
                     "applied stops the run) before the step is saved"),
    (StopOnSignal, "on_train_batch_end right before the checkpoint's: the ranks agree whether to stop after this "
                   "step, so the checkpoint saves it as the fit's last; on_train_end first: its stop line follows the "
                   "save"),
    (StepCheckpoint, "saves the step once every callback above has updated the state the checkpoint holds"),
    (Throughput, "on_train_batch_end after the save: a step that saves is timed with its save (tokens_per_sec is "
                 "training's pace, checkpoints included)"),
    (DownstreamEval, "after the save: a slow or failing harness run never costs the step's checkpoint"),
    (SaveConfigCallback, "setup after StepCheckpoint's: a resume it refuses leaves config.yaml as it was"),
    (RecordLoggerRuns, "setup after StepCheckpoint's: a refused resume writes no loggers.json either"),
    (ProgressBar, "on_train_batch_end after the callbacks that put a value on the bar (Throughput's tok/s): it "
                  "shows this step's"),
    (Checkpoint, "last, Lightning's own rule: a ModelCheckpoint saves once every other callback has updated its "
                 "state"),
)


def position(callback: Callback) -> int:
    """The row of `ORDER` that places `callback`."""
    rows = [kind for kind, _ in ORDER]
    return next((i for i, kind in enumerate(rows) if kind is not REST and isinstance(callback, kind)),
                rows.index(REST))


def arrange(callbacks: list[Callback]) -> list[Callback]:
    """`callbacks` in `ORDER`'s order (stable: callbacks of one row keep the order they came in)."""
    return sorted(callbacks, key=position)
