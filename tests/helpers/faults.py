"""Fault injection for the reliability tests: NaN gradients, NaN/Inf losses and loss spikes at chosen steps
(callbacks, attached through a YAML config), and faults inside normlab's own code — a pause to be killed at, a
real failing write — installed from outside with `unittest.mock.patch.object` (`installed`, and
tests/helpers/fault_cli.py for runs in their own processes). Production code has no test hooks.

A fault is `<point>@<step>` or `<point>@<step>:<rank>` (only on that rank; default: rank 0 for pauses, every rank
for writes). Steps are the checkpoint's step (global_step). Points:
- `pause_before_step`: rank 0 pauses at the start of the batch after update `step` (between optimizer steps);
- `pause_after_shards`: every file of checkpoint `step` written, before the manifest and the rename;
- `pause_mid_shard`: halfway through writing a checkpoint file of `step` (half its bytes on disk, flushed);
- `enospc_shard`: the checkpoint files of `step` are written to /dev/full (a real write failing with ENOSPC);
- `enospc_manifest`: the manifest of `step` is written to /dev/full;
- `blind_guard` (no step): the guard's gradient check sees nothing, so only DeepSpeed's own overflow check
  catches a non-finite gradient.
A pause writes the file named by NORMLAB_TEST_FAULT_MARKER (when set), then sleeps until the process is killed.
"""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
from lightning.pytorch import Callback

from tests.helpers.multiproc import cpu_env

FAULTS_ENV, MARKER_ENV = "NORMLAB_TEST_FAULTS", "NORMLAB_TEST_FAULT_MARKER"


class InjectNaNGrad(Callback):
    """Makes the gradient of the first parameter of block `layer` NaN on rank `rank` at each of `steps`
    (update numbers: the update computed while global_step == s is step s+1). The hook sits on the parameter,
    so it fires before any gradient accumulation or reduction — under ZeRO the NaN reaches every rank's
    partition through the reduction, as a real overflow would; the loss stays finite."""

    def __init__(self, steps: list[int], rank: int = 0, layer: int = 1) -> None:
        self.steps, self.rank, self.layer = set(steps), rank, layer
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first_micro = batch_idx % trainer.accumulate_grad_batches == 0
        if first_micro and trainer.global_step + 1 in self.steps and trainer.global_rank == self.rank:
            param = next(pl_module.model.layers[self.layer].parameters())
            self._handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InjectLossSpike(Callback):
    """Multiplies the training loss by `factor`, on every rank and micro-batch of each of `steps` (update numbers),
    just before its backward — a loss spike, as after a burst of bad data, but sure to stand out on a tiny model
    that is still near uniform (where even random tokens barely raise the loss). It must come before the guard
    in the callback list, as every configured callback does (training/callbacks/order.py)."""

    def __init__(self, steps: list[int], factor: float = 10.0) -> None:
        self.steps, self.factor = set(steps), factor

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step + 1 in self.steps:
            loss.mul_(self.factor)  # in place: the guard and the backward see the same, spiked loss


class InjectNonFiniteLoss(Callback):
    """Makes the training loss `value` (NaN or Inf) on rank `rank`, on every micro-batch of each of `steps` (update
    numbers), just before its backward — with finite (zero) gradients: only the loss check can catch it."""

    def __init__(self, steps: list[int], value: str = "nan", rank: int = 0) -> None:
        self.steps, self.value, self.rank = set(steps), float(value), rank

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step + 1 in self.steps and trainer.global_rank == self.rank:
            loss.mul_(0).add_(self.value)  # in place: the guard and the backward see the same loss; d/dw = 0


# ---- faults inside normlab's code, patched in from outside --------------------------------------------------
def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _step_of(path: object) -> int | None:
    m = re.search(r"step-(\d{8})", str(path))
    return int(m.group(1)) if m else None


def pause(what: str) -> None:
    """Say so (and touch the marker file), then wait to be killed."""
    print(f"test fault: pausing at {what} until killed (pid {os.getpid()})", flush=True)
    if os.environ.get(MARKER_ENV):
        Path(os.environ[MARKER_ENV]).write_text(f"{what} pid={os.getpid()}\n")
    while True:
        time.sleep(1)


def _write_half(obj: object, path: str) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())


def _patches(point: str, step: int | None, rank: int | None) -> list:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    from training.callbacks import guard
    from training.callbacks.step_checkpoint import StepCheckpoint
    from training.checkpointing import save
    from training.checkpointing.safe import SafeCheckpointIO
    from training.run import manifest
    from training.run.layout import MANIFEST

    def armed(at_step: int | None, default_rank: int | None = None) -> bool:
        want = rank if rank is not None else default_rank
        return at_step == step and want in (None, _rank())

    if point == "pause_before_step":
        def batch_start(self, trainer, *args) -> None:
            if armed(trainer.global_step, 0):
                pause(f"{point}@{step}")
        return [mock.patch.object(StepCheckpoint, "on_train_batch_start", batch_start)]
    if point == "pause_after_shards":
        commit = save._commit

        def commit_later(tmp, final, trainer, *args):
            if armed(trainer.global_step, 0):
                pause(f"{point}@{step}")
            return commit(tmp, final, trainer, *args)
        return [mock.patch.object(save, "_commit", commit_later)]
    if point in ("pause_mid_shard", "enospc_shard"):
        def failing(original, obj_key):
            def write(self, *args, **kwargs):  # (obj, path, ...) positionally or by keyword
                obj = args[0] if args else kwargs[obj_key]
                path = args[1] if len(args) > 1 else kwargs["path"]
                if not armed(_step_of(path), 0 if point == "pause_mid_shard" else None):
                    return original(self, *args, **kwargs)
                if point == "enospc_shard":
                    return torch.save(obj, "/dev/full")  # a real write that fails: no space left on the device
                _write_half(obj, str(path))
                pause(f"{point}@{step} ({path})")
            return write
        return [mock.patch.object(SafeCheckpointIO, "save_checkpoint",  # model.ckpt's writer in every fit
                                  failing(SafeCheckpointIO.save_checkpoint, "checkpoint")),
                mock.patch.object(TorchCheckpointEngine, "save", failing(TorchCheckpointEngine.save, "state_dict"))]
    if point == "enospc_manifest":  # Manifest.write, the save's last write
        write_text = manifest.write_text_atomic

        def write(path, text):
            if Path(path).name == MANIFEST and armed(_step_of(path), 0):
                return Path("/dev/full").write_text(text)
            return write_text(path, text)
        return [mock.patch.object(manifest, "write_text_atomic", write)]
    if point == "blind_guard":
        return [mock.patch.object(guard.NonFiniteGuard, "_nonfinite_grads", lambda *args: [])]
    raise ValueError(f"unknown test fault {point!r}")


@contextmanager
def installed(spec: str) -> Iterator[None]:
    """Within the block, the faults of `spec` (comma-separated, see the module docstring) are in place."""
    with ExitStack() as stack:
        for item in filter(None, spec.split(",")):
            m = re.fullmatch(r"(\w+)(?:@(\d+))?(?::(\d+))?", item.strip())
            if not m:
                raise ValueError(f"bad test fault {item!r}: expected <point>@<step>[:<rank>]")
            point, step, rank = m.group(1), m.group(2), m.group(3)
            for patch in _patches(point, int(step) if step else None, int(rank) if rank else None):
                stack.enter_context(patch)
        yield


def run_with_faults(args: list[str], cwd: Path, faults: str, timeout: float = 300,
                    **env: str) -> subprocess.CompletedProcess:
    """`normlab <args>` (tests/helpers/fault_cli.py: the real CLI) with `faults` installed in every rank."""
    return subprocess.run([sys.executable, "-m", "tests.helpers.fault_cli", *args], check=False, cwd=cwd,
                          env=cpu_env(**{FAULTS_ENV: faults}, **env), capture_output=True, text=True,
                          timeout=timeout)


def kill_when_paused(args: list[str], cwd: Path, fault: str, marker: Path, timeout: float = 300) -> str:
    """Run `normlab <args>` with the pause fault `fault` installed (tests/helpers/fault_cli.py); when the
    pause begins, SIGKILL the whole process group (every rank), as a preemption or OOM kill would.
    Returns the output. Fails if the run ended before pausing."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fault_cli", *args], cwd=cwd,
                            env=cpu_env(**{FAULTS_ENV: fault, MARKER_ENV: str(marker)}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before pausing at {fault}:\n{proc.stdout.read()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no pause at {fault} within {timeout} s")
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session holds rank 0 and the ranks it spawned
        except ProcessLookupError:  # it had ended already (the AssertionError above says how)
            pass
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    return out


def signal_when_waiting(args: list[str], cwd: Path, marker: Path, log: Path, signum: int = signal.SIGTERM,
                        timeout: float = 300) -> int:
    """Run `normlab <args>` (its config attaches tests.helpers.callbacks.WaitForSignal with `marker`); when the
    waiting rank has written its process id to `marker`, send it `signum` — that process only — then let it go on.
    Returns the exit status; the output goes to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "training.cli", *args], cwd=cwd, env=cpu_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert marker.exists(), f"no rank waited for the signal:\n{log.read_text()[-4000:]}"
            os.kill(int(marker.read_text()), signum)
            marker.with_name(marker.name + ".sent").touch()
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
