"""Checks of FSDP2's parts on 2 real gloo ranks, each against the same computation in one process (the model
unsharded, built from the same seed on every rank): run by tests/test_fsdp2_units.py as
`torchrun --nproc-per-node 2 tests/helpers/fsdp2_checks.py OUT.json`, one start-up for all of them. Rank 0 writes
each check's measured numbers to OUT.json; the test module asserts on them.

- `muon`: three GatheredMuon updates of the sharded matrices (training/optim/muon.py) vs torch.optim.Muon on the
  whole matrices, from the same gradients; then its state through a DCP save and a load into a fresh optimizer,
  and one more update on each;
- `telemetry`: after one backward, every parameter's and gradient's full value (training/distributed.py), the
  per-layer gradient norms (model/probes.py) and the non-finite count (callbacks/guard.py) vs one process;
- `policy`: under `precision_policy {matmul: bf16, norms: fp32}` the dtype each weight has inside its module's
  forward, and the stored parameters' and gradients' dtypes;
- `layout`: for each `reshard_after_forward`, whether a block's weights are sharded again between its forward
  and backward; with `compile`, whether each block was compiled and then sharded (both FSDP units and compiled).
"""
from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from model import ModelConfig, Transformer
from model.probes import grad_norms
from training.callbacks.guard import _count_nonfinite
from training.checkpointing import dcp
from training.distributed import full_grad, full_param
from training.fsdp2 import shard_model
from training.optim import OptimConfig, build_optimizer

TOKENS = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(7))


def tiny(**fields) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("llama", vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                          **fields))


def max_diff(sharded: torch.nn.Module, plain: torch.nn.Module) -> float:
    """The largest difference between the sharded model's full parameters and the plain model's."""
    return max((full_param(p, False) - q.detach()).abs().max().item()
               for p, q in zip(sharded.parameters(), plain.parameters(), strict=True))


def set_grads(sharded: torch.nn.Module, plain: torch.nn.Module, seed: int) -> None:
    """The same seeded full gradient on both: whole on the plain model, each rank's rows on the sharded one."""
    gen = torch.Generator().manual_seed(seed)
    for p, q in zip(sharded.parameters(), plain.parameters(), strict=True):
        q.grad = torch.randn(q.shape, generator=gen)
        p.grad = distribute_tensor(q.grad.clone(), p.device_mesh, p.placements, src_data_rank=None)


def muon(mesh) -> dict:
    cfg = OptimConfig(name="muon", lr=2e-2, warmup_steps=0, schedule="constant", options={"momentum": 0.9})
    plain, sharded = tiny(), tiny()
    shard_model(sharded, mesh)
    opts = [build_optimizer(m, cfg, total_steps=10)[0] for m in (plain, sharded)]
    for step in range(3):
        set_grads(sharded, plain, seed=step)
        for opt in opts:
            opt.step()
    after_3 = max_diff(sharded, plain)
    # its state through a DCP checkpoint, into a fresh optimizer (whose empty state DCP first fills by a step)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    sharded.zero_grad(set_to_none=True)  # as in a new process (DCP fills an empty state by a step without grads)
    directory = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None
    directory = Path(broadcast(str(directory)))
    dcp.save({"optimizer_0": get_optimizer_state_dict(sharded, opts[1])}, directory, dist.get_rank())
    fresh = build_optimizer(sharded, cfg, total_steps=10)[0]
    state = {"optimizer_0": get_optimizer_state_dict(sharded, fresh)}
    dcp.load(state, directory)
    set_optimizer_state_dict(sharded, fresh, optim_state_dict=state["optimizer_0"])
    set_grads(sharded, plain, seed=3)
    opts[0].step()
    fresh.step()
    algorithms = sorted({g["algorithm"] for g in fresh.param_groups})
    return {"after_3": after_3, "after_resume": max_diff(sharded, plain), "algorithms": algorithms}


def telemetry(mesh) -> dict:
    plain, sharded = tiny(), tiny()
    shard_model(sharded, mesh)
    for model in (plain, sharded):  # every rank the same batch: the reduced gradient is the one process's
        model(TOKENS[:, :-1], targets=TOKENS[:, 1:]).backward()
    grads = max((full_grad(p, False) - q.grad).abs().max().item()
                for p, q in zip(sharded.parameters(), plain.parameters(), strict=True))
    norms = grad_norms(sharded, partial(full_grad, deepspeed=False)), grad_norms(plain)
    bad = _count_nonfinite(sharded.parameters())
    if dist.get_rank() == 0:  # a NaN in rank 0's rows only
        next(sharded.parameters()).grad.to_local()[0, 0] = float("nan")
    poisoned = _count_nonfinite(sharded.parameters())
    dist.all_reduce(poisoned)
    return {"params": max_diff(sharded, plain), "grads": grads, "norms": norms, "nonfinite": bad.item(),
            "nonfinite_poisoned_summed": poisoned.item()}


def policy(mesh) -> dict:
    model = tiny()
    shard_model(model, mesh, precision_policy={"matmul": "bf16", "norms": "fp32"})
    seen: dict[str, str] = {}
    block = model.layers[0]
    def record(name: str, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen.setdefault(name, str(module.weight.dtype))

    hooks = [module.register_forward_hook(partial(record, name))
             for name, module in (("q_proj", block.attn.q_proj), ("attn_norm", block.attn_res.norm_in),
                                  ("final_norm", model.norm))]
    model(TOKENS[:, :-1], targets=TOKENS[:, 1:]).backward()
    for hook in hooks:
        hook.remove()
    stored = sorted({str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()})
    return {"in_forward": seen, "stored": stored}


def layout(mesh) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    resharded = {}
    for reshard in (True, False):
        model = tiny()
        shard_model(model, mesh, reshard_after_forward=reshard)
        loss = model(TOKENS[:, :-1], targets=TOKENS[:, 1:])
        resharded[str(reshard)] = isinstance(model.layers[0].attn.q_proj.weight, DTensor)  # (before the backward)
        loss.backward()
    model = tiny()
    shard_model(model, mesh, compile=True)  # (structure only: compiling happens at the first forward)
    compiled = [isinstance(b, FSDPModule) and b._compiled_call_impl is not None for b in model.layers]
    return {"resharded_after_forward": resharded, "blocks_compiled_and_sharded": compiled}


def broadcast(value):
    out = [value]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # explicitly a CPU mesh (pytorch #132471)
    results = {name: check(mesh) for name, check in (("muon", muon), ("telemetry", telemetry), ("policy", policy),
                                                        ("layout", layout))}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
