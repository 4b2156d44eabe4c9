"""What a resume (or a cooldown branch, training/checkpointing/branch.py) checks before any weight is loaded:
each failure names the checkpoint and the fix.

- a new run must not write over another run's checkpoints (`check_fresh_run`), nor over the config and logs of a
  run that stopped before its first checkpoint (`check_no_logged_run`);
- a DeepSpeed directory resumes under DeepSpeed, FSDP2's DCP directory under FSDP2, a Lightning file under
  neither (`check_format`);
- the checkpoint is whole (every file the manifest lists, at its size and sha256; on a DeepSpeed resume each rank
  checks the files it reads, on a DCP resume its share of them, `rank_files`, and the ranks agree on the
  outcome), holds no pickled code
  (training/checkpointing/safe.py), and was written with this model config and tokenizer (`check_resume`;
  `check_fits` for a branch, before `fit`);
- another gradient accumulation must continue on an update boundary (`check_accumulation`);
- on another world size, its format must be able to reshard (`check_reshard`).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from training.checkpointing import dcp, safe
from training.distributed import together
from training.errors import CheckpointError
from training.run.dir import model_config as saved_model_config
from training.run.layout import (
    CONFIG_FILE,
    DCP_METADATA,
    MANIFEST,
    MODEL_CONFIG_FILE,
    checkpoints_dir,
    complete_checkpoints,
)
from training.run.manifest import Manifest, config_hash, file_hash, read_verified

log = logging.getLogger(__name__)

# A DeepSpeed shard that only its own data-parallel rank loads: ZeRO-1/2/3 optimizer states, ZeRO-3 weights.
_RANK_SHARD = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")


def check_fresh_run(run_dir: str | Path) -> None:
    """A new (non-resumed) fit must not write over another run's checkpoints."""
    found = complete_checkpoints(run_dir)
    if found:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints (newest: {found[-1].name}). Resume it with `--ckpt_path last`, "
            f"or start a new run with `--name <new name>`."
        )


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def check_no_logged_run(run_dir: str | Path) -> None:
    """A new fit must not replace the config.yaml and hide the TensorBoard curves of a run that logged but saved no
    checkpoint (it stopped before its first save, or checkpoints are off): a fresh start there is asked for by
    `--ckpt_path last`, never implied."""
    run_dir = Path(run_dir)
    found = [name for name, present in (  # (empty files are what a start on a full disk leaves: nothing logged)
        (CONFIG_FILE, _nonempty(run_dir / CONFIG_FILE)),
        ("TensorBoard events", any(_nonempty(p) for p in run_dir.glob("events.out.tfevents.*"))),
        ("incomplete checkpoints", checkpoints_dir(run_dir).is_dir() and any(checkpoints_dir(run_dir).iterdir())),
    ) if present]
    if found:
        raise CheckpointError(
            f"{run_dir} already holds a run ({', '.join(found)}; no complete checkpoint). Continue it with "
            "`--ckpt_path last` (from step 0, replacing its config and curves), or start a new run with "
            "`--name <new name>`.")


# How each checkpoint format (the manifest's `format`, save.py's `checkpoint_format`) is loaded.
_LOADED_UNDER = {"deepspeed": "DeepSpeed, with the ZeRO stage that wrote it (e.g. --trainer.strategy zero2)",
                 "dcp": "FSDP2 (--trainer.strategy fsdp2, on any number of devices)",
                 "lightning": "one device or DDP (--trainer.strategy auto or ddp)"}


def check_format(ckpt_path: str, fmt: str) -> None:
    """The checkpoint at `ckpt_path` loads under a strategy whose checkpoints are of format `fmt`: a DeepSpeed
    directory under DeepSpeed, a DCP directory under FSDP2, a Lightning file (model.ckpt) under neither."""
    path = Path(ckpt_path)
    if path.is_file():
        saved = "lightning"
    elif (path / MANIFEST).is_file():
        saved = Manifest.read(path).format or "deepspeed"
    else:  # a foreign directory
        saved = "dcp" if (path / DCP_METADATA).is_file() else "deepspeed"
    if saved != fmt:
        what = {"lightning": "a Lightning checkpoint file", "dcp": "an FSDP2 (DCP) checkpoint",
                "deepspeed": "a DeepSpeed checkpoint"}.get(saved, f"a {saved} checkpoint")
        raise CheckpointError(f"{ckpt_path} is {what}: load it under {_LOADED_UNDER.get(saved, saved)}")


def check_resume(ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule) -> None:
    """Refuse to resume a checkpoint that does not fit this run. Each rank verifies the files it reads; then the
    ranks agree, so a file one rank refused stops every rank with that rank's one-line error (a collective)."""
    config = getattr(trainer.strategy, "config", None) or {}
    elastic = (config.get("zero_optimization") or {}).get("elastic_checkpoint", False)  # every rank reads every shard
    reader = None if elastic else (trainer.global_rank, trainer.world_size)
    together(lambda: check_fits(ckpt_dir, pl_module.config.to_dict(), trainer.datamodule.tokenizer_path, trainer,
                                reader=reader))


def rank_files(manifest: Manifest, rank: int, world_size: int) -> Manifest:
    """`manifest` cut down to the files rank `rank` of `world_size` reads when it resumes the checkpoint: under
    DeepSpeed every file but the other ranks' ZeRO shards (`zero_pp_rank_R_…_states.pt`, loaded by rank R only) —
    unless the world size changed, when rank 0 converts every shard to the universal format and the other ranks
    read none (they read the converted cache, checked against its own manifest: universal.py). A DCP checkpoint
    (FSDP2) is read by every rank in parts no file name tells (DCP decides at load time which rank reads which
    record, at any world size): each rank verifies every `world_size`-th file, and since the ranks agree on the
    outcome before the load (`check_resume`), every file is verified once. A Lightning checkpoint is read whole by
    every rank."""
    if manifest.dcp:
        share = {rel for i, rel in enumerate(sorted(manifest.files)) if i % world_size == rank}
        return dataclasses.replace(manifest, files={k: v for k, v in manifest.files.items() if k in share},
                                   sha256={k: v for k, v in manifest.sha256.items() if k in share})
    if not manifest.deepspeed or (rank == 0 and manifest.world_size != world_size):
        return manifest

    def read(rel: str) -> bool:
        shard = _RANK_SHARD.search(rel)
        return shard is None or (int(shard.group(1)) == rank and manifest.world_size == world_size)

    return dataclasses.replace(manifest, files={k: v for k, v in manifest.files.items() if read(k)},
                               sha256={k: v for k, v in manifest.sha256.items() if read(k)})


def _as_today(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved model config as today's ModelConfig writes it: a field added since (head_dim, rope_*, μP's) takes
    its default, so a checkpoint written before it resumes (a config ModelConfig refuses is compared as saved)."""
    from model.config import ModelConfig

    try:
        return ModelConfig(**saved).to_dict()
    except (TypeError, ValueError):
        return saved


def check_fits(ckpt_dir: Path, model_config: dict[str, Any], tokenizer_path: Path | None, trainer: Trainer,
               action: str = "resume", reader: tuple[int, int] | None = None) -> None:
    """The checkpoint at `ckpt_dir` can be loaded into a run with `model_config`, trained on the tokenizer at
    `tokenizer_path`, with `trainer`'s accumulation and world size. `action` ("resume", "branch from") names
    what is refused in the messages; `reader`: see `check_settings`. (Needs only the trainer's settings: also
    usable before `fit`.)"""
    check_loadable(ckpt_dir, check_settings(ckpt_dir, model_config, tokenizer_path, action, reader), trainer)


def check_settings(ckpt_dir: Path, model_config: dict[str, Any], tokenizer_path: Path | None,
                   action: str = "resume", reader: tuple[int, int] | None = None) -> Manifest:
    """The checks of `check_fits` that read no pickle: the files are as saved, the model config and the tokenizer
    are the run's (`action`: also "validate", "test"). `reader`: (rank, world size) of the process that resumes —
    only the files it reads are verified (`rank_files`); None: every file. Returns the manifest."""
    manifest = read_verified(ckpt_dir, None if reader is None else lambda m: rank_files(m, *reader))
    if (ckpt_dir / MODEL_CONFIG_FILE).is_file():
        saved = _as_today(saved_model_config(ckpt_dir))
        if config_hash(saved) != config_hash(model_config):
            diff = ", ".join(f"{k}: {saved.get(k)!r} → {model_config.get(k)!r}"
                             for k in sorted(set(saved) | set(model_config)) if saved.get(k) != model_config.get(k))
            fix = {"resume": "Resume with the checkpoint's model config (see its model_config.json), or start a new "
                             "run with --name",
                   "branch from": "A branch continues its parent's model: use the parent's model config (see its "
                                  "model_config.json)"}.get(action, "Give the checkpoint's model config (see its "
                                                                    "model_config.json)")
            raise CheckpointError(f"cannot {action} {ckpt_dir}: the model config changed ({diff}). {fix}")
    saved_tok = manifest.tokenizer_hash
    current_tok = file_hash(tokenizer_path)
    if saved_tok and current_tok and saved_tok != current_tok:
        raise CheckpointError(f"cannot {action} {ckpt_dir}: the tokenizer differs from the one it was trained with "
                              f"({tokenizer_path} has another hash); use the run's --data.path")
    return manifest


def check_loadable(ckpt_dir: Path, manifest: Manifest, trainer: Trainer) -> None:
    """The rest of `check_fits`: no file asks to run code — every rank refuses the same file here, before any
    collective of the load — and the accumulation and world size can continue it."""
    refuse_code(ckpt_dir)
    check_accumulation(ckpt_dir, manifest, trainer)
    saved_world = manifest.world_size
    if saved_world is not None and saved_world != trainer.world_size:
        check_reshard(ckpt_dir, manifest, trainer)


def refuse_code(ckpt_dir: Path) -> None:
    """Refuse a checkpoint directory any of whose files asks to run code (one line naming it): its pickled files
    (safe.py) and, in a DCP directory, its metadata and every record (dcp.py). Unpickles nothing unrestricted."""
    safe.refuse_code(ckpt_dir)
    if (Path(ckpt_dir) / DCP_METADATA).is_file():
        dcp.refuse_code(ckpt_dir)


def check_accumulation(ckpt_dir: Path, manifest: Manifest | dict[str, Any], trainer: Trainer) -> None:
    """Another accumulate_grad_batches on resume works when the micro-batches already read are a whole number of
    the new updates: Lightning restores its micro-batch count and closes an update whenever that count is a
    multiple of accumulate_grad_batches (DeepSpeed counts its own from 0), so otherwise the first update would
    end early — and under DeepSpeed the two would disagree on every update after it."""
    manifest = _typed(manifest)
    saved = manifest.accumulate_grad_batches
    if saved is None or saved == trainer.accumulate_grad_batches:
        return
    done = manifest.step * saved
    if done % trainer.accumulate_grad_batches:
        raise CheckpointError(
            f"cannot resume {ckpt_dir} with accumulate_grad_batches {trainer.accumulate_grad_batches}: it was saved "
            f"after {done} micro-batches ({manifest.step} updates of {saved}), not a whole number of updates of "
            f"{trainer.accumulate_grad_batches}. Use an accumulate_grad_batches that divides {done} (e.g. {saved}), "
            "or resume from another checkpoint")


def check_reshard(ckpt_dir: Path, manifest: Manifest | dict[str, Any], trainer: Trainer) -> None:
    """A world-size change on resume: which formats reshard, and what happens to the data position."""
    manifest = _typed(manifest)
    saved_world, stage = manifest.world_size, manifest.zero_stage
    if manifest.deepspeed and stage not in (1, 2, 3):  # (a DCP checkpoint reshards on load at any world size)
        raise CheckpointError(
            f"cannot resume {ckpt_dir} (DeepSpeed ZeRO stage {stage}, {saved_world} ranks) on {trainer.world_size} "
            "ranks: only ZeRO-1/2/3 checkpoints convert to DeepSpeed's universal format. Resume on "
            f"{saved_world} ranks, or start a new run from its consolidated weights (`normlab export`)")
    if trainer.is_global_zero:
        log.warning("resuming %s, written by %d ranks, on %d ranks: optimizer state is resharded; the data goes on "
                    "after the %s tokens seen so far", ckpt_dir, saved_world, trainer.world_size,
                    manifest.tokens_seen)


def _typed(manifest: Manifest | dict[str, Any]) -> Manifest:
    """(The checks also take a manifest's plain JSON, as tools and tests hold it.)"""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)
