"""Muon on the blocks' matrices and AdamW on everything else, as one `torch.optim.Optimizer`.

Why one optimizer rather than two: Lightning drives several optimizers only under manual optimization (the
LightningModule then owns backward, clipping, accumulation and the schedulers' stepping — everything `normlab
fit` gets from automatic optimization today), and the checkpoint, resume and branch code handle one optimizer and
one scheduler. So `MuonWithAdamW` holds a `torch.optim.Muon` and a `torch.optim.AdamW` that *share* its param-group
dicts and its state dict: the LR scheduler, gradient clipping, `zero_grad` and `state_dict()` see one ordinary
optimizer (one combined state, groups tagged "algorithm": "muon" | "adamw"), and each update is computed by
torch's own implementations, unchanged.

Not under DeepSpeed: ZeRO (stages 1–3) hands the optimizer flat 1-D partitions of the parameters, and its bf16
wrapper flat fp32 copies, while Muon's Newton–Schulz step needs each whole 2-D matrix (training/lit_module.py
refuses the combination with one line).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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
        self.muon = torch.optim.Muon(muon_groups, **muon)
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
