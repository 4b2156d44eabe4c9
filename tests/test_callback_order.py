"""The order a run's callbacks run in (training/callbacks/order.py): a fit's callbacks are in the table's order, and
the dependencies the table states hold in a real run. One fit serves all: NaN gradients at update 3 that
`guard.policy=skip` drops, health metrics and a checkpoint at every update."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers.multiproc import REPO
from tests.helpers.runs import scalars
from training.callbacks import NonFiniteGuard, RNGState, StepCheckpoint, TrainingHealth
from training.callbacks.order import arrange, position
from training.cli import main
from training.cluster.stop import StopOnSignal
from training.errors import DEBUG_ENV
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


class RecordOrder(Callback):
    """Writes the trainer's callbacks in order, each as (class name, its row of ORDER), to `path` at setup."""

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage) -> None:
        Path(self.path).write_text(json.dumps([(type(c).__name__, position(c)) for c in trainer.callbacks]))


@pytest.fixture(scope="module")
def run(workdir: Path) -> Path:
    extra = workdir / "order.yaml"
    extra.write_text("trainer:\n  callbacks:\n"
                     "    - class_path: tests.helpers.faults.InjectNaNGrad\n      init_args: {steps: [3], rank: 0}\n"
                     "    - class_path: tests.test_callback_order.RecordOrder\n"
                     f"      init_args: {{path: '{workdir / 'order.json'}'}}\n")
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "-c", str(extra), "--data.path",
              str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", "order", "--trainer.devices", "1",
              "--trainer.max_steps", "4", "--checkpoint.every_n_steps", "1", "--metrics.every_n_steps", "1",
              "--guard.policy", "skip"])
    return workdir / "runs" / "order"


def guard_state(run: Path, step: int) -> dict:
    state = torch.load(layout.checkpoints_dir(run) / layout.step_dirname(step) / "model.ckpt", weights_only=True)
    return next(v for k, v in state["callbacks"].items() if k.startswith("NonFiniteGuard"))


def test_a_checkpoint_holds_the_guards_verdict_on_its_own_step(run):
    """The guard settles a step in on_train_batch_end (an applied update resets the skips in a row): the
    checkpoint of that step must hold it, or a resumed run aborts a skip earlier than the run it continues."""
    assert {k: guard_state(run, 3)[k] for k in ("skipped", "consecutive")} == {"skipped": 1, "consecutive": 1}
    assert {k: guard_state(run, 4)[k] for k in ("skipped", "consecutive")} == {"skipped": 1, "consecutive": 0}


def test_the_health_metrics_show_the_gradient_of_a_step_the_guard_skips(run):
    """Health reads the gradients before the guard drops those of a step it skips: update 3's NaN is on the
    dashboard (logged at step 2, the updates done before it), the applied updates' norms are finite."""
    grad = scalars(run, "grad/global")
    assert math.isnan(grad[2]) and all(math.isfinite(grad[s]) for s in (0, 1, 3))


def test_a_fit_runs_its_callbacks_in_the_tables_order(run):
    """RNGState first, the configured callbacks (in their order) before the run's own, every callback at its row."""
    recorded = json.loads((run.parent.parent / "order.json").read_text())
    names, rows = [name for name, _ in recorded], [row for _, row in recorded]
    assert rows == sorted(rows) and names[0] == "RNGState", recorded
    assert names.index("InjectNaNGrad") < names.index("RecordOrder") < names.index("TrainingHealth")
    assert {"NonFiniteGuard", "StopOnSignal", "StepCheckpoint", "Throughput", "SaveConfigCallback"} <= set(names)
    assert names.index("StopOnSignal") + 1 == names.index("StepCheckpoint")


def test_arrange_places_each_callback_by_its_row_and_keeps_the_rest_in_order():
    rest = [RecordOrder("a"), Callback(), RecordOrder("b")]
    ours = [StepCheckpoint(), NonFiniteGuard(), RNGState(), TrainingHealth(), StopOnSignal()]
    arranged = arrange([ours[0], rest[0], ours[1], rest[1], ours[2], rest[2], ours[3], ours[4]])
    assert arranged == [ours[2], *rest, ours[3], ours[1], ours[4], ours[0]]
    assert [position(c) for c in arranged] == [0, 2, 2, 2, 4, 5, 6, 7]  # (3: QKClip, a fit with optim.qk_clip)
