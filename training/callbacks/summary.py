"""What `normlab fit` says about the model at its start and about the run at its end (rank 0).

`NormSummary` replaces Lightning's default model summary (`--trainer.enable_model_summary`, on by default; a
summary callback the config names is left alone). Lightning's table lists one row, `model | Transformer`, and a
FLOPs column that reads 0 for every model that does not run `measure_flops` (normlab's MFU comes from
training/callbacks/throughput.py): what a normalization study compares is the norm axes and where the
parameters are, so that is what it shows:

    model: 7.4 M parameters — embedding 2.1 M, attention 1.0 M, MLP 2.1 M, norms 2.3 K, head 2.1 M
    4 layers, dim 256, 8 heads (8 KV), MLP swiglu 704, vocab 8192, context 256
    norm rmsnorm (eps 1e-05) · placement pre · QK-norm none · final norm yes · init normal (std 0.02)

and, when any of the newer axes (the stream's scalars, depth-aware and per-sublayer placements, embedding norms,
weightless norms, QK-norm kinds, sub-norms, attention gates and sinks) differs from its default, one more line with
just those, e.g. `also: residual_scale deepnorm · branch_scale scalar (init 0) · attn_sink learnable`.

On several processes `world_line` says the world size and the global batch (tokens per step) in one line.

`log_data_entropy` records the unigram entropy of the training tokens (`data/unigram_entropy`, logged once at
step 0): the plateau a sweep's report judges the run's final loss against (`training.stats.on_plateau`).

`closing_lines` is the run's last word: where everything went and the commands that come next.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from data.entropy import ENTROPY_TAG, unigram_entropy
from model import ModelConfig
from training.run import layout

log = logging.getLogger(__name__)

# Parameter groups by name (model/transformer.py's module names), first match wins: a norm inside attention
# (QK-norm) or a residual placement counts as a norm; a branch scale or a sink logit as a scalar.
GROUPS = (("norms", "norm"), ("scalars", "branch_scale"), ("scalars", ".sink."), ("embedding", "tok_embeddings"),
          ("attention", "attn"), ("MLP", "mlp"), ("head", "output"))
ORDER = ("embedding", "attention", "MLP", "norms", "scalars", "head", "other")  # as the model computes
# The norm axes the third line does not show, named on a fourth when they differ from their defaults (every other
# ModelConfig field is a size or a setting of a line above: tests/test_console.py holds the list to that).
MORE_AXES = ("placement_mlp", "mix_ln", "residual_scale", "branch_scale", "norm_depth_scale", "embed_norm",
             "embed_scale", "norm_affine", "qk_norm_kind", "sub_norm", "attn_gate", "attn_sink")


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 partitions a parameter: its full size


def parameter_groups(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts per group of GROUPS (others: "other"), in GROUPS' order; empty groups left out."""
    counts = dict.fromkeys(ORDER, 0)
    for name, p in model.named_parameters():
        group = next((g for g, key in GROUPS if key in name), "other")
        counts[group] += _numel(p)
    return {g: n for g, n in counts.items() if n}


def summary_lines(model: torch.nn.Module, cfg: ModelConfig) -> list[str]:
    groups = parameter_groups(model)
    def count(n: int) -> str:
        return get_human_readable_count(n).strip()

    parts = ", ".join(f"{g} {count(n)}" for g, n in groups.items())
    tied = " (head tied to the embedding)" if cfg.tie_embeddings else ""
    return [
        f"model: {count(sum(groups.values()))} parameters — {parts}{tied}",
        f"{cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads ({cfg.kv_heads} KV), MLP {cfg.mlp} "
        f"{cfg.hidden_dim}, vocab {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"norm {cfg.norm} (eps {cfg.norm_eps:g}) · placement {cfg.placement} · QK-norm {cfg.qk_norm} · final norm "
        f"{'yes' if cfg.has_final_norm else 'no'} · init {cfg.init} (std {cfg.init_std:g})",
        *more_axes_line(cfg),
    ]


def more_axes_line(cfg: ModelConfig) -> list[str]:
    """The `also:` line (see the module docstring): the MORE_AXES that differ from their defaults, or nothing."""
    default = ModelConfig()
    shown = []
    for name in MORE_AXES:
        value = getattr(cfg, name)
        if value != getattr(default, name):
            extra = f" (init {cfg.branch_scale_init:g})" if name == "branch_scale" else ""
            shown.append(f"{name} {value}{extra}")
    if isinstance(cfg.dyt_alpha, dict) and cfg.norm in ("dyt", "derf"):
        shown.append(f"dyt_alpha {cfg.dyt_alpha}")
    return [f"also: {' · '.join(shown)}"] if shown else []


def world_line(world_size: int, num_nodes: int, batch_size: int, accumulate: int, seq_len: int) -> list[str]:
    """On several processes, one line with the world size and the global batch each optimizer step takes: every
    rank reads its own `batch_size` sequences per micro-batch, so `--trainer.devices 2` (two-process DDP, also on
    a CPU) doubles the tokens per step — said once at the start, not left to be found in the curves."""
    if world_size <= 1:
        return []
    sequences = world_size * batch_size * accumulate
    return [f"world size {world_size} ({num_nodes} node{'s' if num_nodes > 1 else ''} × {world_size // num_nodes} "
            f"processes): global batch {sequences} sequences, {sequences * seq_len} tokens per step (batch_size "
            f"{batch_size} × accumulate_grad_batches {accumulate} × {world_size} ranks)"]


def log_world_line(trainer: Trainer, datamodule: Any) -> None:
    """`world_line` for this trainer and datamodule, on the first process only."""
    for line in world_line(trainer.world_size, trainer.num_nodes, datamodule.batch_size,
                           trainer.accumulate_grad_batches, datamodule.seq_len):
        log.info(line)


class NormSummary(ModelSummary):
    """The model summary above, on rank 0 as `fit` starts (Lightning's summary hook)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            for line in summary_lines(pl_module.model, pl_module.config):
                log.info(line)


def with_norm_summary(callbacks: list[Callback], configured: list[Callback]) -> list[Callback]:
    """`callbacks` with NormSummary in place of the summary Lightning adds by default (with the model summary
    enabled and none among the `configured` callbacks, which are left as they are)."""
    if any(isinstance(c, ModelSummary) for c in configured):
        return list(callbacks)
    return [NormSummary() if type(c) in (ModelSummary, RichModelSummary) else c for c in callbacks]


def log_data_entropy(trainer: Trainer, datamodule: Any) -> float | None:
    """Log the unigram entropy of the datamodule's training tokens (`ENTROPY_TAG`, at step 0) to the run's
    loggers and return it, so the run's own record says where its plateau lies. None (nothing logged) for a
    datamodule without prepared directories yet (the default corpus before its first build, or one of another
    kind): a report then counts it from the run's `data.path`."""
    sources = getattr(datamodule, "sources", None)
    try:
        entropy = unigram_entropy([(path, weight) for _, path, weight in sources or ()])
    except (OSError, ValueError):
        return None
    for logger in trainer.loggers:
        logger.log_metrics({ENTROPY_TAG: entropy}, step=0)
    return entropy


def closing_lines(run_dir: str | Path, config_file: str | Path, step: int, max_steps: int) -> list[str]:
    """Where the run went and what comes next: evaluate its last checkpoint, continue it (`--ckpt_path last`,
    with a later `max_steps` once `step` reached it — a stopped run resumes as it is; the run's own config.yaml
    holds every other option it was started with). A longer run keeps the LR schedule it trained with and holds
    its final LR for the added steps (`--optim.continuation hold`, training/optim/continuation.py): without it
    the resume is refused rather than the LR jumping. Every path is shell-quoted, so a pasted line runs only the
    command it shows, whatever the run's name holds."""
    run = Path(run_dir)
    ckpts = layout.complete_checkpoints(run)
    lines = [f"run directory: {run} (config.yaml, TensorBoard events)"]
    if ckpts:
        which = ckpts[0].name if len(ckpts) == 1 else f"{len(ckpts)}: {ckpts[0].name} … {ckpts[-1].name}"
        lines.append(f"checkpoints:   {layout.checkpoints_dir(run)}/ ({which})")
    lines.append(f"curves:        tensorboard --logdir {shlex.quote(str(run))}")
    if ckpts:
        lines.append(f"evaluate:      normlab evaluate --checkpoint {shlex.quote(str(ckpts[-1]))}")
    more = f" --trainer.max_steps {2 * max_steps} --optim.continuation hold" if 0 < max_steps <= step else ""
    lines.append(f"train on:      normlab fit -c {shlex.quote(str(config_file))} --ckpt_path last{more}")
    return lines


def log_closing_lines(trainer: Trainer, config_file: Any) -> None:
    """`closing_lines` on rank 0, after `fit` returns."""
    if trainer.is_global_zero:
        for line in closing_lines(trainer.default_root_dir, config_file, trainer.global_step,
                                  trainer.max_steps):
            log.info(line)
