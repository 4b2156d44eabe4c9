"""`normlab sweep SPEC --dry_run`'s time estimate, and what it is measured from — one of:

- this sweep's finished runs: the mean wall time of their last attempts (start-up, validation, checkpoints and
  metrics included), for each run still to train;
- otherwise a calibration on this machine: each distinct model of the spec (its config resolved as `normlab fit`
  would: configs/default.yaml, the `-c` files, the overrides, the cell's values) is built in this process and
  timed over a few fp32 training steps (forward, backward, AdamW) on random tokens of the run's batch shape, with
  the threads a run gets at `--max_parallel`; a run is its steps × that time plus the start-up of a CPU fit
  (`STARTUP_S`). Validation, metrics steps and checkpoints come on top, and the machine's load at the time of the
  calibration counts as much as at the time of the runs (on a busy shared 2-core machine the estimate for
  configs/sweeps/qk_lr_cpu.yaml was 50 minutes; its run on the same kind of machine, quiet, took 37).
A spec for GPUs or a Slurm executor gets no calibration here: this machine would not measure those runs.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from training import safe_yaml
from training.run.dir import RunDir, flatten
from training.sweep.spec import Run, Spec

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
STARTUP_S = 6.0  # a CPU fit's start-up, as the sweep's progress lines measure it on a 2-core machine (docs/sweeps.md)
TIMED_STEPS = 2
SHAPE = ("data.seq_len", "data.batch_size", "data.path", "trainer.accumulate_grad_batches")  # besides model.*


def fit_settings(spec: Spec, params: dict[str, Any]) -> dict[str, Any]:
    """A run's dotted settings as `normlab fit` resolves them from files and flags (plain YAML merging: enough for
    sizes and model fields)."""
    out: dict[str, Any] = {}
    for path in (DEFAULT_CONFIG, *map(Path, spec.configs)):
        out.update(flatten(safe_yaml.load(path.read_text(), f"-c {path}") or {}))
    return {**out, **spec.overrides, **params}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _vocab(settings: dict[str, Any]) -> int:
    from data.layout import read_meta

    meta = read_meta(settings["data.path"]) if settings.get("data.path") else None
    return int(settings.get("model.vocab_size") or (meta or {}).get("vocab_size") or 8192)


def model_key(settings: dict[str, Any]) -> str:
    """What decides a step's time: the model's fields and the batch's shape (not the LR, not the seed)."""
    return repr(sorted((k, repr(v)) for k, v in settings.items() if k.startswith("model.") or k in SHAPE))


_MEASURED: dict[tuple[str, int], float] = {}  # (model_key, threads) → seconds per step, once per process


def step_seconds(settings: dict[str, Any], threads: int) -> float:
    """The mean time of a plain fp32 training step of the run's model and batch on this machine."""
    import torch

    from model import ModelConfig, Transformer

    if (model_key(settings), threads) in _MEASURED:
        return _MEASURED[model_key(settings), threads]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_fields = {k[6:]: v for k, v in settings.items()
                    if k.startswith("model.") and k[6:] in fields and v is not None}
    seq, batch = int(settings["data.seq_len"]), int(settings["data.batch_size"])
    cfg = ModelConfig.preset(settings.get("model.preset") or "llama", **{"max_seq_len": seq, **model_fields,
                                                                         "vocab_size": _vocab(settings)})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(TIMED_STEPS + 1):  # the first step warms up the allocator and kernels: not counted
            start = time.perf_counter()
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    accumulate = int(settings.get("trainer.accumulate_grad_batches") or 1)
    _MEASURED[model_key(settings), threads] = sum(times[1:]) / TIMED_STEPS * accumulate
    return _MEASURED[model_key(settings), threads]


def estimate_lines(spec: Spec, runs: list[Run], todo: list[Run], max_parallel: int, executor: str) -> list[str]:
    """The estimate's lines for `todo` (the runs not finished yet), saying what it is measured from."""
    if not todo:
        return ["time: nothing left to train"]
    done = [r for r in runs if r not in todo and (rec := RunDir(spec.sweep_dir / r.rel).record)
            and rec.get("status") == "finished" and rec.get("ended") and rec.get("started")]
    slots = max(1, max_parallel)
    if done:
        records = [RunDir(spec.sweep_dir / r.rel).record for r in done]
        mean = sum(rec["ended"] - rec["started"] for rec in records) / len(records)
        return [f"time: about {_minutes(mean * len(todo) / slots)} for {len(todo)} runs, {slots} at a time — the mean "
                f"wall time of this sweep's {len(done)} finished runs ({mean:.0f} s each)"]
    first = fit_settings(spec, todo[0].params)
    if executor != "local" or str(first.get("trainer.accelerator")) in ("gpu", "cuda") or not isinstance(
            first.get("trainer.max_steps"), int):
        return ["time: no estimate here (GPU or Slurm runs, or no trainer.max_steps); --status gives an ETA once "
                "runs have finished"]
    threads = max(1, (os.cpu_count() or 1) // slots)
    per_model: dict[str, float] = {}
    total = 0.0
    for run in todo:
        settings = fit_settings(spec, run.params)
        key = model_key(settings)
        if key not in per_model:
            per_model[key] = step_seconds(settings, threads)
        total += settings["trainer.max_steps"] * per_model[key] + STARTUP_S
    slowest = max(per_model.values())
    return [f"time: about {_minutes(total / slots)} for {len(todo)} runs, {slots} at a time — calibrated here, now: "
            f"{len(per_model)} model(s) timed over {TIMED_STEPS} fp32 training steps each on {threads} thread(s) "
            f"(up to {slowest * 1000:.0f} ms/step) × trainer.max_steps, + {STARTUP_S:.0f} s start-up per run; "
            "validation, metrics steps and checkpoints add to it, and the machine's load changes it"]
