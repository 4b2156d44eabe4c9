"""One update of DeepSpeed's own Muon vs training/optim's Muon, on the same weights and batch, without ZeRO (the
control: the comparison itself is sound) and under ZeRO-1 and ZeRO-2: run by tests/test_muon.py as
`python -m tests.helpers.deepspeed_muon OUT.json` (one process, a gloo world of 1: ZeRO's Muon path,
`get_flat_partition`, runs whatever the world size). Both are set as alike as DeepSpeed allows: the same lr,
momentum (Nesterov) and weight decay, DeepSpeed's `standard` Newton–Schulz (bfloat16, as torch's), and normlab's
`adjust_lr: original` (DeepSpeed's only scale, √max(1, rows/cols)). Writes, per ZeRO stage and parameter, the norm
ratio ‖Δ_ds‖ / ‖Δ_normlab‖ and the cosine of the two updates, and which parameters each drove with Muon."""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch

from model import ModelConfig, Transformer
from training.optim import OptimConfig, build_optimizer

LR, MOMENTUM, WD = 2e-2, 0.95, 0.1


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("llama", vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                          tie_embeddings=False))


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))


def normlab_update() -> tuple[dict[str, torch.Tensor], set[str]]:
    model = tiny()
    cfg = OptimConfig(name="muon", lr=LR, weight_decay=WD, no_decay=[], warmup_steps=0, schedule="constant",
                      options={"momentum": MOMENTUM, "adjust_lr": "original"})
    optimizer = build_optimizer(model, cfg, total_steps=10)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = batch()
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    optimizer.step()
    muon = {n for n, p in model.named_parameters()
            for g in optimizer.param_groups if g["algorithm"] == "muon" and any(p is q for q in g["params"])}
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, muon


def deepspeed_update(stage: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    import deepspeed

    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WD,
                                                       "ns_method": "standard", "betas": [0.9, 0.95],
                                                       "eps": 1e-8}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = batch()
    engine.backward(engine(tokens[:, :-1], targets=tokens[:, 1:]))
    engine.step()
    muon = {n for n, p in model.named_parameters() if getattr(p, "use_muon", False)}
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, muon


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    return {n: {"norm_ratio": (theirs[n].norm() / d.norm()).item(),
                "cosine": torch.nn.functional.cosine_similarity(theirs[n].flatten(), d.flatten(), dim=0).item()}
            for n, d in ours.items()}


def main(out: str) -> None:
    import deepspeed

    from training.compat import patched

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with patched(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None):  # (as on CPU fits)
        deepspeed.init_distributed(dist_backend="gloo")
    ours, our_muon = normlab_update()
    stages = {}
    for stage in (0, 1, 2):
        theirs, their_muon = deepspeed_update(stage)
        stages[stage] = {"updates": compare(ours, theirs), "deepspeed_muon": sorted(their_muon)}
    Path(out).write_text(json.dumps({"normlab_muon": sorted(our_muon), "stages": stages}, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
