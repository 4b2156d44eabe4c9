"""No device-to-host synchronization on the hot path: at most one per optimizer step in steady state.

On a GPU every read of a device tensor's value from Python (`.item()`, `.tolist()`, `float(t)`, `bool(t)`, `if t:`,
`.cpu()`, `.numpy()`) waits for the queued kernels: the host stops feeding the GPU. CPU tensors have no queue,
so the test counts those calls instead, during a real `normlab fit` of a tiny model in this process: a callback
installs the counters and records, per optimizer step, how many such reads the training loop made between two
update boundaries. Steps that log, validate, checkpoint or take health metrics are left out (they read values on
purpose); the rest must read at most `BOUND` values each — the guard's one combined verdict (loss and every
gradient's finiteness, and the loss for the spike z-score).

Two kinds of reads are of host tensors on a GPU as well, and are not counted: AdamW's step counters (torch keeps
them on the CPU unless fused or capturable), and Lightning's read-back of the progress-bar values after every
batch, to which normlab hands host tensors only ("loss", copied at logging steps; "tok/s", a host number).
"""
from __future__ import annotations

import functools
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers.multiproc import REPO

HELPERS = REPO / "tests" / "helpers"
BOUND = 1
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
STEADY = (2, 3, 5, 6, 7)  # steps (1-based updates) with no logging, health metrics, validation or checkpoint


class SyncCounter(Callback):
    """Counts the value reads of tensors (READS) made during each optimizer step; `per_step[s]` lists where
    the reads of step s came from (the innermost frame of normlab or Lightning code)."""

    def __init__(self) -> None:
        self.per_step: dict[int, list[str]] = {}
        self._reads: list[str] = []
        self._originals: dict[str, Any] = {}
        self._step = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        self._step = trainer.global_step

    def _counting(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            stack = traceback.extract_stack()[:-1]
            if any("/torch/optim/" in f.filename for f in stack) or any(
                    f.name == "convert_tensors_to_scalars" for f in stack):
                return original(tensor, *args, **kwargs)  # host tensors on a GPU too (see the module docstring)
            frames = [f for f in stack if "/torch/" not in f.filename]
            where = frames[-1] if frames else None
            self._reads.append(f"{name} at {where.filename}:{where.lineno}" if where else name)
            return original(tensor, *args, **kwargs)
        return read

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != self._step:  # an update boundary
            self._step = trainer.global_step
            self.per_step[self._step] = self._reads
            self._reads = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def counted(workdir: Path) -> SyncCounter:
    from training.cli import run_lightning

    counter = SyncCounter()
    config = workdir / "counter.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: tests.test_host_syncs.SyncCounter\n")
    cli = run_lightning(["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(config), "--data.path",
                         str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", "syncs",
                         "--trainer.log_every_n_steps", "4", "--checkpoint.every_n_steps", "0",
                         "--trainer.val_check_interval", "100"])
    counter = next(c for c in cli.trainer.callbacks if isinstance(c, SyncCounter))
    return counter


def test_at_most_one_host_sync_per_optimizer_step(counted):
    assert sorted(counted.per_step) == list(range(1, 9))
    for step in STEADY:
        reads = counted.per_step[step]
        assert len(reads) <= BOUND, (step, Counter(reads).most_common())


# ---- fused AdamW: one kernel per update, its step counters on the GPU (no host reads of them) ----------------
def _optimizer(device: str) -> torch.optim.Optimizer:
    from model import Transformer
    from tests.helpers.model import tiny_config
    from training.optim import OptimConfig, build_optimizer

    return build_optimizer(Transformer(tiny_config()).to(device), OptimConfig(), total_steps=10)[0]


def test_fused_adamw_is_chosen_only_when_every_parameter_is_on_cuda():
    from training.optim.registry import use_fused

    class OnCuda:  # stands for a CUDA parameter, which this machine cannot make
        is_cuda = True

    cpu = torch.nn.Parameter(torch.zeros(2))
    assert use_fused([{"params": [OnCuda(), OnCuda()]}, {"params": [OnCuda()]}])
    assert not use_fused([{"params": [OnCuda()]}, {"params": [cpu]}])  # one parameter elsewhere: not fused
    assert not use_fused([])
    assert not _optimizer("cpu").defaults["fused"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fit_builds_fused_adamw_on_cuda():
    optimizer = _optimizer("cuda")
    assert optimizer.defaults["fused"] is True
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the fused kernel runs
    assert all(state["step"].is_cuda for state in optimizer.state.values())
