"""FSDP2 for normlab: `--trainer.strategy fsdp2`, PyTorch's own sharded data parallelism (`fully_shard`: every
parameter a DTensor whose rows are split over the ranks), through Lightning's public `ModelParallelStrategy`,
data-parallel only (no tensor parallelism).

Sharding (`FSDP2.shard`, called by `LitLM.configure_model`), as torchtitan's `parallelize.py` and OLMo-core's
`distributed/parallel/` apply it: each block is one FSDP unit (its parameters all-gathered together before its
forward and backward, its gradients reduce-scattered after), then the root — embedding, final norm and LM head,
so a tied head reads the embedding inside the root's forward. `--model.compile` compiles each block before it is
sharded (torchtitan's order). `reshard_after_forward`: True frees each block's gathered parameters after its
forward and gathers them again for the backward (ZeRO-3-like memory); False keeps them until the backward (one
all-gather fewer per block, ZeRO-2-like memory).

Precision: one regime by default. `bf16-mixed` is torch autocast over fp32 weights here as on one device, under
DDP and under ZeRO (training/precision.py): FSDP2 gathers, reduces and steps fp32, and the losses are those of
one process. `precision_policy: {matmul: bf16, norms: fp32}` is a *different* regime, FSDP2's own per-module
policy (`MixedPrecisionPolicy`): each block's matmul weights are gathered and used in bf16 (half the all-gather
bytes, bf16 activations), while every norm module is its own FSDP unit whose gains stay fp32 (its input cast to
fp32, its output to bf16) and every gradient is reduced in fp32. It runs with `--trainer.precision 32-true`
(no autocast on top) and is recorded in each checkpoint's manifest (`precision.mp_policy`).

Checkpoints are Distributed Checkpoint (DCP) directories — every rank writes its own shards, and they load at any
world size (DCP reshards on load) — under normlab's rules: training/checkpointing/dcp.py reads them without
running code, training/checkpointing/save.py hashes and commits them like every other format.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from data.atomic import atomic_write
from model.norms import Norm
from training import compat
from training.checkpointing import dcp
from training.checkpointing.safe import safe_torch_load
from training.errors import CheckpointError, UserError
from training.run.layout import DCP_META_FILE

log = logging.getLogger(__name__)

POLICY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
POLICY_KEYS = ("matmul", "norms")
PRECISIONS = ("32-true", "bf16-mixed")  # the regimes tested under FSDP2 (see the module docstring)


def check_policy(policy: dict[str, str] | None) -> dict[str, str] | None:
    """`precision_policy` as given, or one error line naming the bad key or value and the valid ones."""
    if policy is None:
        return None
    if not isinstance(policy, dict) or set(policy) != set(POLICY_KEYS):
        raise ValueError(f"trainer.strategy.precision_policy={policy!r}: give both keys {list(POLICY_KEYS)}, e.g. "
                         "{matmul: bf16, norms: fp32}, or null for the default regime")
    for key, value in policy.items():
        if value not in POLICY_DTYPES:
            raise ValueError(f"trainer.strategy.precision_policy.{key}={value!r} is not valid; choose one of "
                             f"{list(POLICY_DTYPES)}")
    return dict(policy)


class FSDP2(ModelParallelStrategy):
    """`fully_shard` on every block and the root over a data-parallel mesh of all ranks (see the module
    docstring); `reshard_after_forward` and `precision_policy` as there; other arguments as Lightning's strategy
    (`timeout`, `process_group_backend`)."""

    def __init__(self, reshard_after_forward: bool = True, precision_policy: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.precision_policy = check_policy(precision_policy)
        self._hold: Callable[[Callable], Callable] | None = None

    def setup_environment(self) -> None:
        precision = str(self.precision_plugin.precision)
        if precision not in PRECISIONS or (self.precision_policy and precision != "32-true"):
            valid = ["32-true"] if self.precision_policy else list(PRECISIONS)
            raise UserError(f"--trainer.precision {precision} under fsdp2"
                            f"{' with a precision_policy' if self.precision_policy else ''}: choose one of {valid}")
        # Data-parallel only: one mesh dimension over every rank (Lightning's "auto" splits nodes from devices
        # for tensor parallelism).
        compat.require("lightning.pytorch.strategies.model_parallel:ModelParallelStrategy._data_parallel_size")
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def shard(self, model: nn.Module, compile: bool = False) -> None:
        """Shard `model` (a `model.Transformer`) in place over this strategy's mesh (`shard_model`): a mesh of the
        root device's type — a CPU mesh under gloo, never a default CUDA one (pytorch #132471)."""
        shard_model(model, self.device_mesh["data_parallel"], self.reshard_after_forward, self.precision_policy,
                    compile)

    # -- checkpoints: DCP shards + meta.pt, written through the save's error holding (checkpointing/save.py) ----
    @contextmanager
    def writes_held(self, hold: Callable[[Callable], Callable]) -> Iterator[None]:
        """Within the block, the checkpoint writes go through `hold(write)`: a failing rank's error is held."""
        self._hold = hold
        try:
            yield
        finally:
            self._hold = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Every rank writes its shards of the weights and optimizer states into the directory `filepath`
        (`.metadata` and `__<rank>_0.distcp`, DCP); rank 0 writes the rest of the checkpoint to `meta.pt`."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        path = Path(self.broadcast(filepath))
        hold = self._hold or (lambda write: write)
        shards = {"state_dict": checkpoint.pop("state_dict"),
                  **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
        path.mkdir(parents=True, exist_ok=True)
        hold(lambda state, where: dcp.save(state, where, self.global_rank))(shards, path)
        if self.is_global_zero:
            hold(_write_meta)(checkpoint, path / DCP_META_FILE)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the weights (and, in a fit, the optimizer states) from the DCP directory into this run's shards,
        whatever world size wrote it, weights-only (checkpointing/dcp.py); returns the rest of the checkpoint."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        dcp.refuse_code(path)  # (every rank: a crafted record is refused before the load's collectives)
        state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(state, path)
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key])
            if not optimizer.state:  # (DCP fills an empty template only when no parameter holds a gradient)
                raise CheckpointError(f"{path}: no optimizer state was loaded into {key}; resume in a new process")
        return safe_torch_load(path / DCP_META_FILE)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("fsdp2", cls, description="normlab FSDP2 (fully_shard per block), DCP checkpoints",
                                   override=True)


FSDP2.register_strategies(StrategyRegistry)


def shard_model(model: nn.Module, mesh: Any, reshard_after_forward: bool = True,
                precision_policy: dict[str, str] | None = None, compile: bool = False) -> None:
    """`fully_shard` each block of `model` (a `model.Transformer`; compiled first if `compile`), then the root,
    over the 1-D `mesh`; with a `precision_policy` (see the module docstring) every norm module with parameters
    first, as a unit of its own."""
    from torch.distributed.fsdp import fully_shard

    matmul, norms = _policies(precision_policy)

    def shard(module: nn.Module, policy: Any) -> None:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    **({"mp_policy": policy} if policy is not None else {}))

    if norms is not None:  # each norm its own unit (before the blocks that hold them)
        for module in model.modules():
            if isinstance(module, Norm) and any(True for _ in module.parameters(recurse=False)):
                shard(module, norms)
    for block in model.layers:
        if compile:  # before sharding: FSDP's hooks stay outside the compiled graph (torchtitan's order)
            block.compile()
        shard(block, matmul)
    shard(model, matmul)


def _policies(precision_policy: dict[str, str] | None) -> tuple[Any, Any]:
    """(the blocks' and root's MixedPrecisionPolicy, the norms'); (None, None) without a precision_policy."""
    if precision_policy is None:
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    matmul, norms = POLICY_DTYPES[precision_policy["matmul"]], POLICY_DTYPES[precision_policy["norms"]]
    # Gradients reduce-scattered in fp32 in both (torchtitan's default reduce dtype); a norm computes in its own
    # dtype (its input cast to it) and hands the matmuls theirs.
    return (MixedPrecisionPolicy(param_dtype=matmul, reduce_dtype=torch.float32),
            MixedPrecisionPolicy(param_dtype=norms, reduce_dtype=torch.float32, output_dtype=matmul))


def _write_meta(checkpoint: dict[str, Any], path: Path) -> None:
    """Lightning's checkpoint minus weights and optimizer states, through a temporary file beside it."""
    with atomic_write(path, "wb") as f:
        torch.save(checkpoint, f)
