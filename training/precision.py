"""The precision regime: which one a run defaults to, and what its checkpoints' manifests record of it.

One regime on every strategy: `bf16-mixed` / `16-mixed` are torch autocast over fp32 weights, on one device, under
DDP and FSDP2 (Lightning's own mixed precision) and under ZeRO 1-3 (training/strategy.py writes DeepSpeed's
`torch_autocast` section instead of its `bf16`/`fp16` mode, which would cast the weights too). FSDP2's per-module
`precision_policy` (training/fsdp2.py) is another regime, asked for explicitly and recorded as `mp_policy`.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from training.distributed import is_deepspeed

AUTOCAST_DTYPES = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def precision_record(trainer: Any, model: torch.nn.Module) -> dict[str, Any]:
    """What the manifest records about numerics: Lightning's precision, the dtype the weights are stored in
    during forward/backward, and the autocast dtype (None: no autocast); under FSDP2 with a `precision_policy`
    also `mp_policy`, the dtype each kind of module computes in ({"matmul": "bf16", "norms": "fp32"})."""
    precision = str(trainer.precision)
    weights = next((p.dtype for p in model.parameters()), torch.float32)
    autocast = None
    if is_deepspeed(trainer.strategy):
        engine = trainer.strategy.deepspeed_engine
        autocast = engine.torch_autocast_dtype() if engine.torch_autocast_enabled() else None
    elif precision in AUTOCAST_DTYPES:  # Lightning's MixedPrecision plugin: torch.autocast in every forward
        autocast = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    record = {"precision": precision, "weights": str(weights).removeprefix("torch."),
              "autocast": str(autocast).removeprefix("torch.") if autocast is not None else None}
    policy = getattr(trainer.strategy, "precision_policy", None)  # (FSDP2's, training/fsdp2.py)
    return {**record, "mp_policy": dict(policy)} if policy else record


def default_precision(accelerator: str | Any) -> str:
    """bf16 mixed precision on GPUs (fp16 on GPUs without bf16); fp32 elsewhere — bf16 was ~45x slower than
    fp32 on a CPU without bf16 matrix units, and DeepSpeed refuses fp16 on CPU."""
    wants_gpu = accelerator in ("auto", "gpu", "cuda") or isinstance(accelerator, CUDAAccelerator)
    if not (wants_gpu and torch.cuda.is_available()):
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
