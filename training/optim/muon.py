"""Muon on the blocks' matrices and AdamW on everything else, as one `torch.optim.Optimizer`.

Why one optimizer rather than two: Lightning drives several optimizers only under manual optimization (the
LightningModule then owns backward, clipping, accumulation and the schedulers' stepping — everything `normlab
fit` gets from automatic optimization today), and the checkpoint, resume and branch code handle one optimizer and
one scheduler. So `MuonWithAdamW` holds a `torch.optim.Muon` and a `torch.optim.AdamW` that *share* its param-group
dicts and its state dict: the LR scheduler, gradient clipping, `zero_grad` and `state_dict()` see one ordinary
optimizer (one combined state, groups tagged "algorithm": "muon" | "adamw"), and each update is computed by
torch's own implementations, unchanged.

Under FSDP2 (training/fsdp2.py) each matrix is a DTensor whose rows are split over the ranks: `GatheredMuon` keeps
the momentum, weight decay and step on each rank's rows and runs Newton–Schulz on the whole matrix, gathered — the
update one process computes, to the bit (tests/test_fsdp2_units.py).

Not under DeepSpeed: ZeRO (stages 1–3) hands the optimizer flat 1-D partitions of the parameters, and DeepSpeed's
own Muon for them computes another update than this one (registry.py's `zero_refusal` says by how much;
training/lit_module.py refuses the combination with one line).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class GatheredMuon(torch.optim.Muon):
    """torch.optim.Muon that also steps FSDP2's row-sharded DTensor matrices: the momentum, the Nesterov blend,
    the weight decay and the step act on each rank's own rows; Newton–Schulz, which needs the whole matrix, runs
    on the update gathered from every rank (one all-gather per matrix), on every rank alike — torch's own
    bfloat16 iteration on the same full matrix a single process orthogonalizes — and each rank keeps its rows.
    (torchtitan's dist_muon and OLMo-core's Muon spread the iterations over the ranks instead; here every rank
    repeats them, which at 125M–1B costs less than the gather.) Without DTensors: torch.optim.Muon unchanged."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if "momentum_buffer" not in state:  # a DTensor like the gradient: DCP saves it sharded
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    _sharded_step(p, state["momentum_buffer"], group)
        return loss


def _sharded_step(p: DTensor, buf: DTensor, group: dict[str, Any]) -> None:
    """torch.optim.Muon's `_single_tensor_muon` for one row-sharded matrix (see `GatheredMuon`), with its own
    Newton–Schulz and LR adjustment (torch internals, catalogued in training/compat.py)."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    grad, momentum = p.grad.to_local(), group["momentum"]
    buf.to_local().lerp_(grad, 1 - momentum)
    update = grad.lerp(buf.to_local(), momentum) if group["nesterov"] else buf.to_local()
    full = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
    mine = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
    lr = float(group["lr"])
    local = p.to_local()
    local.mul_(1 - lr * group["weight_decay"])
    local.add_(mine, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """`groups` as groups.py's `param_groups` makes them (each with "algorithm"); `adamw` / `muon`: the two
    optimizers' defaults (lr, betas, eps / lr, momentum, nesterov, ns_steps, adjust_lr_fn; registry.py's `Muon`
    entry builds it from `optim.*` and `optim.options`)."""

    def __init__(self, groups: list[dict], *, adamw: dict[str, Any], muon: dict[str, Any]) -> None:
        muon_groups = [g for g in groups if g["algorithm"] == "muon"]
        adamw_groups = [g for g in groups if g["algorithm"] != "muon"]
        if not muon_groups:
            raise ValueError("optim.name=muon: the model has no block matrix for Muon to drive")
        # The inner optimizers fill their defaults into these same dicts; the outer one keeps them, in order.
        self.muon = GatheredMuon(muon_groups, **muon)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw) if adamw_groups else None
        super().__init__(groups, defaults={})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this optimizer's groups and state (after init and after a load)."""
        self.muon.param_groups = [g for g in self.param_groups if g["algorithm"] == "muon"]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if g["algorithm"] != "muon"]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: re-share them
        self._share()
