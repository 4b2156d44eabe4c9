"""A run's state reaches its objects when they are built, not set on them afterwards: `StepCheckpoint` takes the
checkpoint it resumes and its manifests' record as constructor arguments, and `LitLM` takes `--init_from`'s weights
from an `InitFrom` among its trainer's callbacks. Here both run in a plain Lightning fit, with no CLI to fill
anything in."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from data.datamodule import TokenDataModule
from training.callbacks.step_checkpoint import StepCheckpoint
from training.checkpointing import init_from
from training.checkpointing.save import RunRecord
from training.lit_module import LitLM
from training.optim import OptimConfig
from training.optim.continuation import schedule_record
from training.run import layout
from training.run.manifest import git_revision

MODEL = dict(dim=32, n_layers=2, n_heads=4)


def fit(workdir: Path, run_dir: Path, callbacks: list[Callback], seed: int) -> LitLM:
    """Two updates of a tiny LitLM on the tiny corpus, in a plain Trainer."""
    torch.manual_seed(seed)
    data = TokenDataModule(path=str(workdir / "tiny"), seq_len=16, batch_size=4, val_batches=1)
    lit = LitLM(data_vocab_size=320, data_seq_len=16, **MODEL)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=run_dir, callbacks=callbacks)
    trainer.fit(lit, data)
    return lit


@pytest.fixture(scope="module")
def built(workdir: Path) -> tuple[Path, RunRecord]:
    """A run whose StepCheckpoint was given a record when built (as the CLI builds it)."""
    record = RunRecord(resolved_config="seed_everything: 7\n", branched_from={"checkpoint": "/runs/parent/step-4"},
                       init_from={"path": "/models/source", "kind": "export"})
    run_dir = workdir / "runs" / "built"
    fit(workdir, run_dir, [StepCheckpoint(every_n_steps=2, record=record)], seed=0)
    return run_dir, record


def test_a_step_checkpoint_records_what_it_was_built_with(built):
    run_dir, record = built
    ckpt = layout.checkpoints_dir(run_dir) / layout.step_dirname(2)
    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    assert manifest["branched_from"] == record.branched_from and manifest["init_from"] == record.init_from
    assert (ckpt / layout.CONFIG_FILE).read_text() == record.resolved_config
    assert manifest["git_revision"] == git_revision()  # this checkout's, taken at setup
    # the LR schedule it trained with (the default optim over max_steps 2), which a resume continues
    assert manifest["schedule"] == {**schedule_record(OptimConfig(), 2), "steps": 2}


class FirstWeights(Callback):
    """The model's weights when training starts (after `configure_model`, before any update)."""

    def on_train_start(self, trainer: Trainer, pl_module: LitLM) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_litlm_starts_from_the_init_source_among_its_trainers_callbacks(workdir, built):
    run_dir, _ = built
    source = init_from.resolve(str(layout.checkpoints_dir(run_dir) / layout.step_dirname(2)))
    first = FirstWeights()
    fit(workdir, workdir / "runs" / "from-built", [init_from.InitFrom(source), first], seed=1)
    expected = source.state_dict()
    assert first.weights.keys() == expected.keys()
    assert all(torch.equal(first.weights[k], expected[k]) for k in expected)
