"""Every place normlab overrides, patches or relies on a private API of Lightning, DeepSpeed, torch or
`datasets` — and only here.

`PATCHES` lists each one: what it touches, why, and the versions it was written and tested against. An entry is
a `patch` (normlab overrides, replaces or writes it) or `internal` (normlab calls or reads an API its library
does not document as public: a rename would break it just the same). Before a touch runs, `require` checks the
installed version and fails loudly (`CompatError`, naming the entry, the versions and the fix) on any other: a
private API may change in any release, silently. To support a new release, read each entry below against its
source, run the multi-process tests, then widen the range here and the pin in pyproject.toml together.
`tests/test_compat.py` checks that every listed attribute still exists, and scans normlab's code for a private
name of another package (`._name`: read, written, imported or overridden) that is not listed here.

What this module provides:
- `DeepSpeedStrategyPatches`: Lightning's `DeepSpeedStrategy` with the overrides that let it train on CPU (gloo,
  DeepSpeed's CPU accelerator); `training.strategy` builds on it. On CUDA every override defers to Lightning's
  own method, so the CPU-tested path is not quite the CUDA path: the multi-process CPU tests exercise these
  overrides, which production GPUs never run.
- `restore_full_weights`, `repair_zero3_universal_load`: what the strategy's checkpoint loading needs from
  DeepSpeed's and Lightning's internals; `hold_recovery_script`: DeepSpeed's one checkpoint write outside its
  checkpoint engine, routed through the engine normlab installs (training/strategy.py).
- `patched`: an attribute replaced for the length of a block (what the CPU patches and safe.py's weights-only
  `torch.load` use).
- `set_collective_timeout`: `cluster.timeout_s` for every process group, DeepSpeed's included.
- `own_signals`: the trainer's signal connector replaced by one that installs no handler, so that normlab's stop
  handlers (training/cluster/signals.py) own SIGTERM, SIGINT and Slurm's warning signal.
- The touches made elsewhere are listed too, so an upgrade reads them: the progress bar's description
  (`callbacks/progress.py`), the epoch loop's `max_steps` (`callbacks/step_checkpoint.py`), the ZeRO optimizer's
  overflow test and gradient scaler (`callbacks/guard.py`), ZeRO-3's init context (`checkpointing/init_from.py`),
  the universal converter's entry point and the DeepSpeed classes of the weights-only allow-list
  (`checkpointing/safe.py`), the engine's checkpoint engine (`strategy.py`), LightningCLI's parser
  (`lightning_cli.py`) and the `datasets` fingerprint (`data/prepare.py`).
Replaced by public APIs since: the universal-load flag (the documented config key `checkpoint.load_universal`),
`save_checkpoint(save_latest=False)` (the strategy's public `save_checkpoint`, given the engine's own
`save_latest` argument), the `TorchCheckpointEngine.save`/`.makedirs` patches (one `TorchCheckpointEngine`
subclass) and `LightningCLI._parse_ckpt_path` (a `parse_arguments` override). See docs/compat.md.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from training.errors import UserError

# The ranges tested (lightning 2.6.6, deepspeed 0.19.8); pyproject.toml pins the same.
LIGHTNING = ">=2.6,<2.7"
DEEPSPEED = ">=0.19,<0.20"
_DS_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"


@dataclass(frozen=True)
class Patch:
    target: str  # "module:attribute.path" of what is overridden, patched or called
    reason: str
    package: str
    versions: str
    kind: str = "patch"  # "patch": overridden, replaced or written; "internal": an undocumented API called or read


_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
_ZERO3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_ZERO_INIT = "deepspeed.runtime.zero.partition_parameters"

PATCHES: dict[str, Patch] = {p.target: p for p in [
    # -- DeepSpeed on CPU (Lightning refuses it; the multi-process tests run ZeRO this way) -----------------------
    Patch("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy.setup_environment",
          "on CPU: the parent's body minus its CUDA-only accelerator check (DDP's environment setup)",
          "lightning", LIGHTNING),
    Patch("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._init_deepspeed_distributed",
          "on CPU: setup_distributed is the parent's body minus _validate_device_index_selection (no device index)",
          "lightning", LIGHTNING),
    Patch("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._setup_model_and_optimizer",
          "on CPU: deepspeed.initialize gets device_rank=root_device.index=None and fails on `None >= 0`",
          "lightning", LIGHTNING),
    Patch("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._initialize_deepspeed_inference",
          "on CPU: the same device_rank=None failure when validate/test build the inference engine",
          "lightning", LIGHTNING),
    Patch("deepspeed:initialize",
          "on CPU: wrapped to pass device_rank=0 instead of None (DeepSpeed's CPU accelerator ignores it)",
          "deepspeed", DEEPSPEED),
    Patch("deepspeed.comm.torch:build_shm_op",
          "on CPU: not JIT-built with g++ (60-90 s, a crash without a compiler); it serves inference all-reduce only",
          "deepspeed", DEEPSPEED),
    # -- loading ------------------------------------------------------------------------------------------------
    Patch("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._restore_zero_state",
          "validate/test of a ZeRO-3 checkpoint: copy consolidated weights into the partitions, one module at a time",
          "lightning", LIGHTNING),
    Patch(f"{_ZERO3}.optimizer",
          "the ZeRO-3 universal loader gives every group the first group's hyper-parameters and one shared AdamW "
          "`step` tensor: repaired after the load", "deepspeed", DEEPSPEED),
    Patch("torch:load",
          "DeepSpeed reads checkpoints with torch.load, passing weights_only=False, at ~20 call sites, several "
          "bypassing its checkpoint engine (zero_to_fp32, the universal loader, ds_to_universal): around those reads "
          "only, torch.load is made weights-only (training/checkpointing/safe.py)", "torch", ">=2.6"),
    Patch("deepspeed.checkpoint.ds_to_universal:main",
          "the universal-format converter is a script: safe.py runs its main(parse_arguments()) with its own argv "
          "(in a subprocess), reading weights-only", "deepspeed", DEEPSPEED, "internal"),
    Patch("deepspeed.checkpoint.ds_to_universal:parse_arguments", "as for main: the converter's own argv parser",
          "deepspeed", DEEPSPEED, "internal"),
    Patch("deepspeed.runtime.fp16.loss_scaler:LossScaler",
          "allowed by the weights-only loader (safe.py): ZeRO optimizer shards pickle it (a rename: every ZeRO "
          "resume refused)", "deepspeed", DEEPSPEED, "internal"),
    Patch("deepspeed.runtime.zero.config:ZeroStageEnum", "allowed by the weights-only loader: ZeRO shards pickle it",
          "deepspeed", DEEPSPEED, "internal"),
    Patch("deepspeed.utils.tensor_fragment:fragment_address",
          "allowed by the weights-only loader: ZeRO-1/2 shards pickle it", "deepspeed", DEEPSPEED, "internal"),
    # -- saving: every file write of a checkpoint is held on error, so a failing rank reaches the collectives ----
    Patch("deepspeed.runtime.engine:DeepSpeedEngine.checkpoint_engine",
          "replaced, once the engine is built, by HoldingCheckpointEngine (training/strategy.py), a "
          "TorchCheckpointEngine whose save/makedirs go through the save's error holding: DeepSpeed 0.19 has no "
          "hook for a checkpoint engine of one's own", "deepspeed", DEEPSPEED),
    Patch("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.save",
          "HoldingCheckpointEngine overrides it (and `makedirs`, the base class's): the class is DeepSpeed's "
          "default engine, not an extension point it documents", "deepspeed", DEEPSPEED),
    Patch(f"{_DS_ENGINE}._copy_recovery_script",
          "the zero_to_fp32.py copy is the save's one file write outside the checkpoint engine: the engine's "
          "instance attribute is wrapped to go through the same holding (hold_recovery_script)",
          "deepspeed", DEEPSPEED),
    # -- FSDP2 (training/fsdp2.py) and its DCP checkpoints (training/checkpointing/dcp.py) ----------------------
    Patch("lightning.pytorch.strategies.model_parallel:ModelParallelStrategy._data_parallel_size",
          "set before the mesh is built: data-parallel over every rank (its 'auto' splits nodes from devices for "
          "tensor parallelism, which normlab does not use)", "lightning", LIGHTNING),
    Patch("lightning.pytorch.strategies.model_parallel:ModelParallelStrategy._tensor_parallel_size",
          "set to 1 with _data_parallel_size", "lightning", LIGHTNING),
    Patch("torch.distributed.checkpoint.filesystem:_StorageInfo",
          "allowed by the restricted unpickler of a DCP directory's .metadata (where each record sits): a rename "
          "refuses every FSDP2 checkpoint", "torch", ">=2.6", "internal"),
    Patch("torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING",
          "allowed by the .metadata unpickler: TensorProperties pickles it", "torch", ">=2.6", "internal"),
    Patch("torch.serialization:_get_layout", "allowed by the .metadata unpickler: how a tensor layout is pickled",
          "torch", ">=2.6", "internal"),
    Patch("torch._weights_only_unpickler:_get_allowed_globals",
          "the types torch.load(weights_only=True) accepts: a refused plain pickle is named by its first type outside "
          "them (checkpointing/safe.py)", "torch", ">=2.6", "internal"),
    Patch("torch.optim._muon:_zeropower_via_newtonschulz",
          "GatheredMuon (training/optim/muon.py) runs torch.optim.Muon's own Newton-Schulz on each FSDP2 matrix, "
          "gathered: the update one process computes", "torch", ">=2.9", "internal"),
    Patch("torch.optim._muon:_adjust_lr", "and its LR adjustment, as torch.optim.Muon applies it", "torch", ">=2.9",
          "internal"),
    # -- training -----------------------------------------------------------------------------------------------
    Patch(f"{_ZERO12}.has_overflow",
          "the non-finite guard's cheap test (callbacks/guard.py): each rank's gradient partition, one all-reduced "
          "flag, before any full gradient is gathered", "deepspeed", DEEPSPEED, "internal"),
    Patch(f"{_ZERO3}.has_overflow", "as for ZeRO-1/2", "deepspeed", DEEPSPEED, "internal"),
    Patch(f"{_ZERO12}.torch_autocast_gradscaler",
          "under fp16 autocast the ZeRO optimizer's own GradScaler skips an overflowing step: the guard must not "
          "abort it (callbacks/guard.py)", "deepspeed", DEEPSPEED, "internal"),
    Patch(f"{_ZERO3}.torch_autocast_gradscaler", "as for ZeRO-1/2", "deepspeed", DEEPSPEED, "internal"),
    Patch(f"{_ZERO_INIT}:shutdown_init_context",
          "`fit --init_from` builds the source model inside LitLM.configure_model, which Lightning runs in "
          "deepspeed.zero.Init: paused as DeepSpeed pauses it itself (checkpointing/init_from.py)",
          "deepspeed", DEEPSPEED, "internal"),
    Patch(f"{_ZERO_INIT}:restore_init_context", "the other half of the pause", "deepspeed", DEEPSPEED, "internal"),
    Patch("lightning.pytorch.callbacks.progress.rich_progress:RichProgressBar._get_train_description",
          "StepRichProgressBar (callbacks/progress.py) overrides it: the bar's description counts optimizer steps "
          "(of max_steps), not epochs", "lightning", LIGHTNING),
    Patch("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.max_steps",
          "StopOnSignal (cluster/stop.py) lowers it to the current step after an agreed stop signal: the fit ends "
          "after this step, as at max_steps (trainer.should_stop would run one more validation first)", "lightning",
          LIGHTNING),
    # -- signals and collectives (training/cluster/) --------------------------------------------------------------
    Patch("lightning.pytorch.trainer.trainer:Trainer._signal_connector",
          "replaced by one that installs no handler (own_signals): Lightning's SIGTERM handler broadcasts from inside "
          "the handler and its SLURM USR1 handler saves and requeues from inside it, a collective at an arbitrary "
          "line of each rank (a deadlock); normlab's handlers only record (training/cluster/signals.py)",
          "lightning", LIGHTNING),
    Patch("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers",
          "overridden to install nothing (NoLightningSignals; see Trainer._signal_connector)", "lightning", LIGHTNING),
    Patch("torch.distributed.distributed_c10d:_set_pg_timeout",
          "cluster.timeout_s for every process group: new_group() without a timeout gets gloo's 30-minute default, not "
          "the default group's, and DeepSpeed makes its groups that way (torchtitan sets its timeouts the same way)",
          "torch", ">=2.6"),
    Patch("torch.distributed.distributed_c10d:_world",
          "_world.pg_map lists every process group of this process, to give each the timeout", "torch", ">=2.6"),
    Patch("torch.utils.tensorboard.writer:SummaryWriter._get_file_writer",
          "a sweep run's HParams session (the experiment, its start and end summaries) goes into the run's own event "
          "file, as Lightning's TensorBoardLogger.log_hyperparams writes its own (training/loggers.py); add_hparams "
          "would start another run directory", "torch", ">=2.6"),
    # -- the command line and data ------------------------------------------------------------------------------
    Patch("lightning.pytorch.cli:LightningCLI._parser",
          "the running subcommand's parser, for its defaults: `fit --init_from` takes the model fields left at their "
          "defaults from the source (NormlabCLI._subcommand_defaults), and a mistyped option is matched against "
          "their keys (NormlabCLI._options)", "lightning", LIGHTNING, "internal"),
    Patch("datasets:Dataset._fingerprint",
          "how `datasets` identifies a Hub dataset's content (from its cache files): `normlab prepare` records it "
          "so a rebuild knows whether its input changed (data/prepare.py)", "datasets", ">=3.0", "internal"),
]}


class CompatError(UserError):
    """A patched library's installed version is outside the range its patch was written against."""


@functools.cache
def _installed(package: str) -> str:
    return metadata.version(package)


def require(target: str) -> None:
    """Fail loudly unless the installed version of the package that `target` belongs to is in the tested range."""
    from packaging.specifiers import SpecifierSet

    patch = PATCHES[target]
    installed = _installed(patch.package)
    if installed not in SpecifierSet(patch.versions, prereleases=True):
        raise CompatError(
            f"normlab patches {target} ({patch.reason}), written for {patch.package}{patch.versions}, but "
            f"{patch.package} {installed} is installed: pip install '{patch.package}{patch.versions}' (or check "
            "the patch in training/compat.py against the new version and widen its range)")


def exists(target: str) -> bool:
    """Whether the attribute `target` names (`module:Owner.attr`) is still there: on the module or class, or, for
    an instance attribute, assigned in the class's code (`self.attr =`)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *owners, name = path.split(".")
    for attr in owners:
        owner = getattr(owner, attr)
    if hasattr(owner, name):
        return True
    return isinstance(owner, type) and f"self.{name} =" in inspect.getsource(owner)


@contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` within the block, then what it was (the attribute of a module, a class or an
    instance: one it only inherited is deleted again, not copied onto it)."""
    own = vars(owner)
    had, old = name in own, own.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def _with_device_rank_zero(initialize: Callable) -> Callable:
    @functools.wraps(initialize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"].device_rank = 0
        return initialize(*args, **kwargs)

    return wrapper


class DeepSpeedStrategyPatches(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, made to run on CPU (see PATCHES); on CUDA, Lightning's own methods."""

    @property
    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if self._on_cuda:
            return super().setup_environment()
        require("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy.setup_environment")
        DDPStrategy.setup_environment(self)  # the parent's body minus its CUDA-only check

    def setup_distributed(self) -> None:
        if self._on_cuda:
            return super().setup_distributed()
        require("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._init_deepspeed_distributed")
        require("deepspeed.comm.torch:build_shm_op")
        reset_seed()  # the parent's body minus _validate_device_index_selection
        self.set_world_ranks()
        # (`deepspeed.comm.torch` as an attribute is the torch package that deepspeed.comm imports; hence importlib.)
        ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
        with patched(ds_torch_backend, "build_shm_op", lambda: None):  # None: "op unavailable" to DeepSpeed
            self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        require("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._setup_model_and_optimizer")
        return self._call_with_cpu_device_rank(super()._setup_model_and_optimizer, *args, **kwargs)

    def _initialize_deepspeed_inference(self, *args: Any, **kwargs: Any) -> Any:
        require("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._initialize_deepspeed_inference")
        return self._call_with_cpu_device_rank(super()._initialize_deepspeed_inference, *args, **kwargs)

    def _call_with_cpu_device_rank(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._on_cuda:
            return fn(*args, **kwargs)
        import deepspeed

        require("deepspeed:initialize")
        with patched(deepspeed, "initialize", _with_device_rank_zero(deepspeed.initialize)):
            return fn(*args, **kwargs)


def restore_full_weights(strategy: DeepSpeedStrategy, checkpoint: dict[str, Any]) -> None:
    """Copy a checkpoint's full (consolidated) weights into the ZeRO-3 partitioned parameters (a collective)."""
    require("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._restore_zero_state")
    strategy._restore_zero_state(checkpoint, strict=True)


def repair_zero3_universal_load(optimizer: Any, own: list[dict[str, Any]]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader (its ZeRO-1/2 loader is exact, and is left alone):
    - it gives every parameter group the hyper-parameters of the first, so the no-decay group would get weight
      decay: put back each group's own (`own`, read before the load; the learning rate, the same in every group,
      stays as loaded — it is the LR schedule's position);
    - it stores one `step` tensor in every group's state, which AdamW increments in place once per group, so the
      second group's bias correction would run a step ahead per step: give each state its own copy.
    Both are no-ops where the load was already right. Checked by resuming on another world size and comparing
    with the straight run (tests/test_reliability_deepspeed.py)."""
    require("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.optimizer")
    for group, hyper in zip(optimizer.param_groups, own, strict=True):
        group.update(hyper)
    for state in getattr(getattr(optimizer, "optimizer", None), "state", {}).values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def zero_optimizer_internal(optimizer: Any, name: str) -> Any:
    """The internal attribute `name` of a DeepSpeed ZeRO optimizer (`has_overflow`, `torch_autocast_gradscaler`:
    catalogued above, so a rename fails here, loudly); None for any other optimizer (no ZeRO, or plain torch)."""
    for cls in type(optimizer).__mro__:
        target = {"DeepSpeedZeroOptimizer": _ZERO12, "DeepSpeedZeroOptimizer_Stage3": _ZERO3}.get(cls.__name__)
        if target is not None and cls.__module__ == target.partition(":")[0]:
            require(f"{target}.{name}")
            return getattr(optimizer, name)
    return None


def hold_recovery_script(engine: Any, hold: Callable[[Callable], Callable]) -> None:
    """Route the engine's copy of its recovery scripts (zero_to_fp32.py, written into every ZeRO checkpoint by
    rank 0 inside the save, outside the checkpoint engine) through `hold(copy)`, for the engine's life."""
    require(f"{_DS_ENGINE}._copy_recovery_script")
    copy = engine._copy_recovery_script
    engine._copy_recovery_script = lambda save_path: hold(copy)(save_path)


class NoLightningSignals(_SignalConnector):
    """Lightning's signal connector minus its handlers: normlab's own (training/cluster/signals.py) stay in place,
    so Lightning's `received_sigterm` stays False and none of its signal paths (a broadcast inside the SIGTERM handler,
    the SLURM auto-requeue save inside the USR1 handler) can run."""

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = {}  # so Lightning's teardown restores nothing either


def own_signals(trainer: Any) -> None:
    """Make normlab, not Lightning, own this trainer's signal handling (before `fit` installs Lightning's)."""
    require("lightning.pytorch.trainer.trainer:Trainer._signal_connector")
    require("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers")
    if not isinstance(trainer._signal_connector, NoLightningSignals):
        trainer._signal_connector = NoLightningSignals(trainer)


def set_collective_timeout(timeout: timedelta) -> None:
    """Give every process group of this process (the default one, DeepSpeed's, normlab's) `timeout`."""
    import torch.distributed as dist

    require("torch.distributed.distributed_c10d:_set_pg_timeout")
    require("torch.distributed.distributed_c10d:_world")
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)
