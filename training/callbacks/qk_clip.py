"""QK-clip in the training loop (`optim.qk_clip: τ`; what it does: training/optim/qk_clip.py).

The per-head maxima are exact and come from the training forward itself: every attention module records its
`max_logit_per_head` [H] (`Attention.track_max_logit`, switched on before every training batch, off during
validation), the maximum is kept over the step's micro-batches, and one MAX all-reduce of all layers' [L, H]
maxima makes every rank's the global one. After the optimizer step (on_train_batch_end; the step whose update
the guard skipped too), the offending heads' query and key rows are scaled:
- one process, DDP: in place on each rank's parameters, which are the same everywhere;
- FSDP2: each rank scales the rows of its own shard (`Shard(0)`) in place, with no collective;
- DeepSpeed ZeRO 1–3: the fp32 master weights the optimizer steps are scaled together with the module's own copy
  the forward reads — under ZeRO-1/2 read whole (`full_param`, a collective) and written back to this rank's
  fragment (`safe_set_full_fp32_param`) and to the module's full copy; under ZeRO-3 shard-wise, each rank scaling
  the elements it holds (the module's `ds_tensor` and `safe_get/set_local_fp32_param`), with no gather. Every
  rank clips the same layers in the same order (the maxima are global), so the collectives match. Tested against
  one process on 2 ranks, every ZeRO stage, and FSDP2 against DDP.
Logged every step: `qk_clip/max_logit` (the largest logit of the step, every layer and head) and
`qk_clip/heads_clipped`. One host read of the maxima per step (on a GPU, one sync).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor, distribute_tensor

from training import health_tags as T
from training.distributed import full_param, is_deepspeed
from training.loggers import log_scalars
from training.optim.qk_clip import head_factors, scaled_rows


class QKClip(Callback):
    def __init__(self, tau: float) -> None:
        self.tau = tau
        self._max: torch.Tensor | None = None  # [L, H], this rank's, over the step's micro-batches so far
        self._stepped = False

    @staticmethod
    def _attentions(pl_module: LightningModule) -> list[Any]:
        return [block.attn for block in pl_module.model.layers]

    def _track(self, pl_module: LightningModule, on: bool) -> None:
        for attn in self._attentions(pl_module):
            attn.track_max_logit = on

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._track(pl_module, True)  # every training forward, also the first after a validation

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._track(pl_module, False)  # a validation's logits are not a training step's

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        maxima = torch.stack([attn.max_logit_per_head for attn in self._attentions(pl_module)])
        self._max = maxima if self._max is None else torch.maximum(self._max, maxima)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # DeepSpeed calls this every micro-batch; its step is at the accumulation boundary only
        if not is_deepspeed(trainer.strategy) or trainer.strategy.deepspeed_engine.is_gradient_accumulation_boundary():
            self._stepped = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not self._stepped or self._max is None:
            return
        maxima, self._max, self._stepped = self._max, None, False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        over = maxima > self.tau
        top, clipped = torch.stack([maxima.max(), over.sum().float()]).tolist()
        log_scalars(trainer, {T.QK_CLIP_MAX_LOGIT: top, T.QK_CLIP_HEADS: clipped}, trainer.global_step)
        if clipped:
            self._clip(trainer, pl_module, maxima, over.any(dim=1).tolist())

    def _clip(self, trainer: Trainer, pl_module: LightningModule, maxima: torch.Tensor, layers: list[bool]) -> None:
        deepspeed = is_deepspeed(trainer.strategy)
        zero3 = deepspeed and trainer.strategy.zero_stage_3
        clip(pl_module.model, maxima, self.tau, lambda p, f: _scale(p, f, deepspeed, zero3), layers)


@torch.no_grad()
def clip(model: torch.nn.Module, maxima: torch.Tensor, tau: float,
         scale: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None,
         layers: list[bool] | None = None) -> None:
    """Scale the query and key rows of every head of `model` whose max logit (`maxima` [L, H], the same on every
    rank) exceeds `tau` (training/optim/qk_clip.py); `scale(p, factors)` writes a parameter (default: in place,
    one process or DDP); `layers`: which layers have a head over τ, if known."""
    scale = scale or (lambda p, factors: p.copy_(scaled_rows(p, factors)))
    for index, (block, s) in enumerate(zip(model.layers, maxima, strict=True)):
        if not (layers[index] if layers is not None else bool((s > tau).any())):
            continue
        attn = block.attn
        q, k = head_factors(s, tau, attn.n_kv_heads)
        for proj, factors in ((attn.q_proj, q), (attn.k_proj, k)):
            if bool((factors == 1).all()):
                continue  # (a shared key head under GQA: never scaled)
            for p in (proj.weight, proj.bias):
                if p is not None:
                    scale(p, factors)


def _scale(p: torch.nn.Parameter, factors: torch.Tensor, deepspeed: bool, zero3: bool) -> None:
    """p's head rows × factors, in the optimizer's fp32 master weights and in the module's copy. ZeRO-1/2: the
    master weights read whole (a collective: every rank calls it for the same parameters in the same order);
    ZeRO-3: each rank scales its own shards (`_scale_shards`), with no collective."""
    if isinstance(p, DTensor):
        _scale_dtensor(p, factors)
        return
    if not deepspeed:
        p.copy_(scaled_rows(p, factors))
        return
    if zero3:
        _scale_shards(p, factors)
        return
    from deepspeed.utils import safe_set_full_fp32_param

    new = scaled_rows(full_param(p, True).float().reshape(p.shape), factors)
    safe_set_full_fp32_param(p, new)  # this rank's fragment of the master weights
    p.data.copy_(new.to(p.dtype))  # the module's copy, whole on every rank under ZeRO-1/2


def _scale_dtensor(p: DTensor, factors: torch.Tensor) -> None:
    """FSDP2: p is sharded by rows (`Shard(0)`), with no other copy (the optimizer steps the sharded parameter
    itself). Each rank scales the rows it holds by their heads' factors: the row factors laid out with p's own
    placements (`src_data_rank=None`: every rank slices its share of the same vector, no communication)."""
    rows = factors.to(p.dtype).repeat_interleave(p.shape[0] // factors.numel())
    rows = rows.view(-1, *([1] * (p.dim() - 1)))
    p.to_local().mul_(distribute_tensor(rows, p.device_mesh, p.placements, src_data_rank=None).to_local())


def _scale_shards(p: torch.nn.Parameter, factors: torch.Tensor) -> None:
    """ZeRO-3: rank r holds elements [r·n, (r+1)·n) of the flattened parameter (the last shard padded), both of the
    module's copy (`ds_tensor`) and of the fp32 master weights; each element's factor is its row's head's. A
    persistent parameter (`ds_persist`: below `stage3_param_persistence_threshold`, never re-gathered) also has
    its whole copy, the same on every rank, scaled."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    shard = p.ds_tensor
    n, rows = shard.numel(), p.ds_shape[0]
    index = torch.arange(n, device=shard.device) + dist.get_rank(group=p.ds_process_group) * n
    row = index // (p.ds_numel // rows)  # the element's row of [heads·D, in] (a bias: of [heads·D])
    head = (row // (rows // factors.numel())).clamp(max=factors.numel() - 1)
    scale = torch.where(index < p.ds_numel, factors.to(shard.device)[head], torch.ones((), device=shard.device))
    shard.data.mul_(scale.to(shard.dtype))
    if getattr(p, "ds_persist", False):  # a small parameter ZeRO-3 keeps whole on every rank (its persistence
        p.data.copy_(scaled_rows(p.data, factors))  # threshold): the forward reads that copy, not the shards
    master = safe_get_local_fp32_param(p)
    safe_set_local_fp32_param(p, master * scale.to(master.dtype).view_as(master))
