"""DeepSpeed ZeRO for normlab: configs by name, and Lightning's DeepSpeedStrategy made to run on CPU.

`DeepSpeed(config="zero2")` reads `configs/deepspeed/zero2.json` (or any JSON path / dict). The names
`zero1`, `zero2`, `zero3` are registered with Lightning, so `--trainer.strategy zero3` selects one.

On CUDA this is Lightning's stock strategy. Lightning refuses DeepSpeed on other accelerators, but DeepSpeed
itself runs on CPU with gloo (its CPU accelerator): the few overrides of Lightning's private methods that make
the same strategy train for real on CPU — which is how the multi-process tests exercise ZeRO without a GPU — live
in `training/compat.py` (`DeepSpeedStrategyPatches`), with every other patch of a library's private API.

Resuming on another world size (ZeRO-1/2/3): DeepSpeed refuses to load optimizer shards written by another
number of ranks. `resume_from` (called by `normlab fit` before the engine is built) then sets DeepSpeed's config
key `checkpoint.load_universal`, and `load_checkpoint` converts the checkpoint once into DeepSpeed's universal
format (rank 0, `deepspeed.checkpoint.ds_to_universal`, cached inside the checkpoint directory with a manifest of
its own that every rank checks before reading the cache: training/checkpointing/universal.py) and loads that,
which re-partitions the fp32 weights and Adam moments for the new world size (and repairs two slips of the ZeRO-3
loader, see `compat.repair_zero3_universal_load`). DeepSpeed without ZeRO is refused earlier (see `check_reshard`).

Precision: one regime on every strategy. `bf16-mixed` / `16-mixed` mean torch autocast over fp32 weights — fp32
parameters, gradients, gradient all-reduce and optimizer, with matmuls in bf16/fp16 — on one device, under DDP
(Lightning's own mixed precision) and under ZeRO 1-3. Lightning would otherwise turn on DeepSpeed's own `bf16`/`fp16`
mode, which casts every parameter (norm gains included) to the low dtype for forward and backward: a ZeRO run
would then compute something else than its one-GPU pilot. So `DeepSpeed` writes DeepSpeed's `torch_autocast`
section instead (no module's gradients reduced in the low dtype: `lower_precision_safe_modules: []`). A config
that sets `bf16`, `fp16` or `torch_autocast` itself is used as written. What the checkpoint manifest records
of it: training/precision.py.

Every DeepSpeed read of a checkpoint here (the engine's loader, the universal conversion and load, the ZeRO-3
consolidation) runs weights-only: no code from a checkpoint runs (training/checkpointing/safe.py). Every write of a
save goes through `HoldingCheckpointEngine` (training/checkpointing/held_writes.py), installed on the engine at
`setup`, so a failed write is held until the save's collectives are over (training/checkpointing/save.py); `latest`
is left to the save (`save_checkpoint`'s `storage_options`, the engine's own arguments).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from training import compat
from training.checkpointing.load import deepspeed_state_dict
from training.checkpointing.safe import no_code_from_checkpoints
from training.checkpointing.universal import to_universal, verify_cache
from training.compat import DeepSpeedStrategyPatches, repair_zero3_universal_load, restore_full_weights
from training.distributed import shared_failure, together
from training.errors import CheckpointError, UserError
from training.precision import AUTOCAST_DTYPES
from training.run.layout import DEEPSPEED_TAG, MANIFEST
from training.run.manifest import Manifest

log = logging.getLogger(__name__)

# The JSON files are the source of truth for each stage; they live with the other recipes in configs/.
DEEPSPEED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
ZERO_NAMES = ("zero1", "zero2", "zero3")


def load_deepspeed_config(config: str | Path | dict) -> dict:
    """A DeepSpeed config from a name in configs/deepspeed (`zero2`), a JSON path, or a dict (copied)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    if path.suffix != ".json" and len(path.parts) == 1:  # a bare name
        path = DEEPSPEED_CONFIG_DIR / f"{config}.json"
    if not path.is_file():
        available = sorted(p.stem for p in DEEPSPEED_CONFIG_DIR.glob("*.json"))
        raise FileNotFoundError(f"DeepSpeed config {str(config)!r} not found (looked for {path}); "
                                f"give a JSON path or one of {available}")
    with open(path) as f:
        return json.load(f)


class DeepSpeed(DeepSpeedStrategyPatches):
    """Lightning's DeepSpeedStrategy with `config` given by name (`zero1|zero2|zero3`) or path; runs on CPU too."""

    def __init__(self, config: str | dict = "zero2", **kwargs: Any) -> None:
        config = load_deepspeed_config(config)
        other_engine = [k for k in ("checkpoint.writer", "datastates_ckpt") if _get(config, k) not in (None, False)]
        if other_engine:
            raise UserError(f"DeepSpeed config: {other_engine[0]} selects another checkpoint engine, which normlab's "
                            "checkpoint saves do not support (each file write is checked and a failed one reported by "
                            f"every rank, see docs/checkpoints.md): remove {other_engine[0]}")
        super().__init__(config=config, **kwargs)
        self._writes: Any = None  # the engine's HoldingCheckpointEngine, once the engine is built (setup)

    def setup_environment(self) -> None:
        # Before anything reads the config (Lightning formats it in `setup`, or in `model_sharded_context` for
        # ZeRO-3's configure_model, both later); the precision plugin is known by now.
        autocast_config(self.config, self.precision_plugin.precision)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # builds the engine
        if trainer.state.fn != TrainerFn.FITTING:  # (only a fit saves; validate/test's engine may have no writer)
            return
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        from training.checkpointing.held_writes import HoldingCheckpointEngine

        engine = self.deepspeed_engine
        if type(engine.checkpoint_engine) is not TorchCheckpointEngine:  # (refused in __init__ by its config keys)
            raise RuntimeError(f"unexpected DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__}")
        compat.require("deepspeed.runtime.engine:DeepSpeedEngine.checkpoint_engine")
        compat.require("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.save")
        self._writes = HoldingCheckpointEngine(engine.checkpoint_engine.zipfile_serialization)
        engine.checkpoint_engine = self._writes
        compat.hold_recovery_script(engine, self._writes.through)

    def writes_held(self, hold: Callable[[Callable], Callable]) -> AbstractContextManager[None]:
        """Within the block, every file the engine writes for a checkpoint goes through `hold(write)`."""
        return self._writes.holding(hold)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: dict[str, Any] | None = None) -> None:
        """Lightning's DeepSpeed save (the engine's own sharded save: weights and optimizer state are the engine's,
        the rest of `checkpoint` its client state), with `storage_options` as keyword arguments of the engine's
        `save_checkpoint` — `{"save_latest": False}`: normlab writes `latest` itself, once every shard is
        (checkpointing/save.py). (Lightning's own refuses any storage_options.)"""
        filepath = self.broadcast(filepath)  # every rank saves into rank 0's path
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.deepspeed_engine.save_checkpoint(filepath, client_state=client_state, tag=DEEPSPEED_TAG,
                                              exclude_frozen_parameters=self.exclude_frozen_parameters,
                                              **(storage_options or {}))

    def resume_from(self, ckpt_path: str | Path) -> None:
        """Before `fit` builds the engine: the checkpoint it will load. One written by another world size loads
        through DeepSpeed's universal format (see the module docstring), which the engine's documented config key
        `checkpoint.load_universal` selects for its loads."""
        manifest_file = Path(ckpt_path) / MANIFEST
        saved_world = Manifest.read(ckpt_path).world_size if manifest_file.is_file() else None
        if saved_world not in (None, self.world_size):
            self.config.setdefault("checkpoint", {})["load_universal"] = True

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        with no_code_from_checkpoints():  # DeepSpeed's readers ask torch.load for weights_only=False
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None) -> dict[str, Any]:
        manifest_file = Path(checkpoint_path) / MANIFEST
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if not fitting and self.zero_stage_3 and Path(checkpoint_path).is_dir():
            return self._load_zero3_weights_for_inference(Path(checkpoint_path))
        saved_world = Manifest.read(checkpoint_path).world_size if manifest_file.is_file() else None
        if saved_world in (None, self.world_size) or not fitting:
            # (validate/test under ZeRO-1/2: Lightning's inference engine is not sharded and reads the whole
            # weights, whatever world size wrote them)
            return super().load_checkpoint(checkpoint_path, weights_only)
        if not _get(self.config, "checkpoint.load_universal"):
            raise CheckpointError(f"{checkpoint_path} was written by {saved_world} ranks, this fit runs "
                                  f"{self.world_size}: call DeepSpeed.resume_from(checkpoint) before fit (`normlab "
                                  "fit` does)")
        self._on_rank_zero(lambda: to_universal(Path(checkpoint_path)))
        together(lambda: verify_cache(Path(checkpoint_path)))  # every rank reads all of the cache: each checks it
        log.warning("loading %s (written by %d ranks) on %d ranks through DeepSpeed's universal checkpoint",
                    checkpoint_path, saved_world, self.world_size)
        optimizer = self.deepspeed_engine.optimizer
        own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
        try:
            return super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            if self.zero_stage_3:  # (the ZeRO-1/2 loader restores each group's own values itself)
                repair_zero3_universal_load(optimizer, own)

    def _load_zero3_weights_for_inference(self, ckpt_dir: Path) -> dict[str, Any]:
        """validate/test/predict of a ZeRO-3 checkpoint, on any world size. Lightning builds an inference engine
        without an optimizer, into which DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint (it calls the missing
        optimizer's `_restore_from_bit16_weights`). So rank 0 consolidates the shards (DeepSpeed's zero_to_fp32,
        as `normlab evaluate` does) and Lightning's own ZeRO-3 loader copies the full weights into the
        partitioned parameters, one module at a time."""
        def consolidated() -> dict[str, torch.Tensor]:
            state = deepspeed_state_dict(ckpt_dir)  # a CheckpointError naming a missing or truncated shard
            expected = set(self.lightning_module.state_dict())
            if set(state) != expected:
                raise CheckpointError(f"{ckpt_dir} does not hold this model's weights: missing "
                                      f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
            return state

        state = self._on_rank_zero(consolidated) or {}  # every rank stops, or none: the loader is a collective
        # (the version key: Lightning's checkpoint migration reads it; the weights are what matters here)
        checkpoint = {"state_dict": state, "pytorch-lightning_version": lightning.__version__}
        restore_full_weights(self, checkpoint)
        log.info("loaded the consolidated weights of %s into ZeRO-3 partitions", ckpt_dir)
        return checkpoint

    def _on_rank_zero(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on rank 0 only; its result there, None elsewhere. If it fails, every rank raises its error:
        a rank left waiting in the next collective for a rank 0 that raised would wait forever."""
        return shared_failure(fn, lambda error: [self.broadcast(error)], run=self.is_global_zero)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning has already divided the loss by accumulate_grad_batches; DeepSpeed's engine.backward would
        # divide it again by its gradient_accumulation_steps (the same number), leaving every gradient 1/N of the
        # true one — invisible to Adam's update direction but not to gradient clipping or the logged grad norms.
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in ZERO_NAMES:
            strategy_registry.register(name, cls, description=f"normlab DeepSpeed, configs/deepspeed/{name}.json",
                                       config=name, override=True)


DeepSpeed.register_strategies(StrategyRegistry)


def _get(config: dict[str, Any], dotted: str) -> Any:
    """A DeepSpeed config value by its dotted key (None when absent)."""
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return config


def autocast_config(config: dict, precision: str) -> None:
    """Make `bf16-mixed` / `16-mixed` DeepSpeed's torch autocast over fp32 weights (see the module docstring),
    unless `config` chooses its precision itself. Also disables the section Lightning would add (`bf16`/`fp16`)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None or {"bf16", "fp16", "torch_autocast"} & config.keys():
        return
    config["torch_autocast"] = {"enabled": True, "dtype": dtype, "lower_precision_safe_modules": []}
    config["bf16" if dtype == "bfloat16" else "fp16"] = {"enabled": False}  # (Lightning fills in absent ones)


def resolve_strategy(strategy: Any, devices: Any, num_nodes: int) -> Any:
    """`auto` on several devices (a count > 1, a list of more than one, or several nodes) is DDP, said in the run's
    config rather than left to Lightning's choice; anything else as given. (`devices: auto` stays Lightning's:
    one process per visible GPU, DDP when there are several.)"""
    if strategy != "auto":
        return strategy
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    several = (isinstance(devices, int) and devices > 1) or (isinstance(devices, (list, tuple)) and len(devices) > 1)
    return "ddp" if several or num_nodes > 1 else strategy


def adopt_deepspeed_launcher_env(environ: MutableMapping[str, str]) -> None:
    """The `deepspeed` launcher names a node's rank CROSS_RANK; Lightning reads NODE_RANK (or torchrun's
    GROUP_RANK). Without this every node would think it is node 0 and compute wrong global ranks."""
    if "CROSS_RANK" in environ and "NODE_RANK" not in environ and "GROUP_RANK" not in environ:
        environ["NODE_RANK"] = environ["CROSS_RANK"]
