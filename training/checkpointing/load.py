"""Load any model normlab writes, for evaluation, export and generation — on CPU or GPU, in fp32 by default.

Accepted `path`s:
- a checkpoint directory `runs/<name>/checkpoints/step-XXXXXXXX/` (manifest.json): DeepSpeed shards of any
  ZeRO stage and world size (consolidated in memory with DeepSpeed's own zero_to_fp32), FSDP2's DCP shards of
  any world size (assembled in memory, checkpointing/dcp.py), or Lightning's `model.ckpt` inside it;
- a Lightning `.ckpt` file, or a consolidated state dict (`.pt`/`.bin`/`.safetensors`) with `model_config.json`
  beside it;
- an exported directory: Hugging Face (`config.json` + safetensors) or normlab's own `--format safetensors`.

Nothing in a checkpoint is trusted: a step directory's files are checked against its manifest (sizes and sha256)
before any is read, and every pickled file is read weights-only (training/checkpointing/safe.py), so no code
from a checkpoint runs.
"""
from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model import ModelConfig, Transformer
from training.checkpointing import dcp
from training.checkpointing.remote_code import HF_READ, refuse_custom_code
from training.checkpointing.safe import no_code_from_checkpoints, refusal, safe_torch_load, unsafe_globals
from training.errors import CheckpointError
from training.run.dir import RunDir, data_path, model_config, step_config, tokenizer_of
from training.run.layout import LIGHTNING_FILE, MANIFEST, MODEL_CONFIG_FILE
from training.run.manifest import read_verified

log = logging.getLogger(__name__)

NORMLAB_EXPORT_CONFIG = "normlab_config.json"  # written by `normlab export --format safetensors`


@dataclass
class Loaded:
    model: Transformer
    step: int | None  # the optimizer step the weights are from, when known
    run_dir: Path | None  # runs/<name>, when the checkpoint belongs to a run
    run_config: dict[str, Any]  # the run's resolved config.yaml ({} when unknown)
    tokenizer_path: Path | None  # the tokenizer (.model or tokenizer.json) the weights were trained with, when known
    source: str  # which format was read

    @property
    def data_path(self) -> Path | None:
        """The run's data directory (of a mixture, its first source: all share one tokenizer)."""
        return data_path(self.run_config)


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LightningModule keys (`model.layers.0…`, `_forward_module.model.…`) → Transformer keys."""
    out = {}
    for key, value in state.items():
        for prefix in ("_forward_module.", "model."):
            if key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def deepspeed_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise CheckpointError(f"'{ckpt_dir}' has no DeepSpeed 'latest' file: the checkpoint is incomplete")
    try:
        # Reads every rank's shards and merges them, whatever ZeRO stage and world size wrote them (weights-only).
        with no_code_from_checkpoints():
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"cannot consolidate the DeepSpeed checkpoint '{ckpt_dir}': a shard is missing or "
                              f"truncated ({type(err).__name__}: {err})") from err


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read '{path}': {err}") from err


def _run_context(ckpt_dir: Path) -> tuple[Path | None, dict[str, Any]]:
    """The run directory (…/runs/<name>) and the resolved config saved beside a step directory."""
    run = RunDir.of_checkpoint(ckpt_dir)
    return run.path if run is not None else None, step_config(ckpt_dir)


def _build(config: dict[str, Any], state: dict[str, torch.Tensor], where: Path) -> Transformer:
    try:
        cfg = ModelConfig(**config)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"'{where}': its model config is invalid ({err})") from err
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"'{where}': the weights do not match its model config ({err})") from err
    return model


def _load_step_dir(ckpt_dir: Path) -> Loaded:
    manifest = read_verified(ckpt_dir)  # sizes and hashes, before anything is unpickled
    config = model_config(ckpt_dir)
    if manifest.deepspeed:
        state = deepspeed_state_dict(ckpt_dir)
    elif manifest.dcp:
        state = dcp.model_state(ckpt_dir)
    else:
        file = ckpt_dir / LIGHTNING_FILE
        if not file.is_file():
            raise CheckpointError(f"'{file}' is missing: the checkpoint is incomplete")
        state = safe_torch_load(file)["state_dict"]
    run_dir, run_config = _run_context(ckpt_dir)
    return Loaded(_build(config, _strip(state), ckpt_dir), manifest.step, run_dir, run_config,
                  tokenizer_of(run_config), f"checkpoint ({manifest.format})")


def _load_export_dir(path: Path) -> Loaded:
    # The original sentencepiece model when the export has one, else a Hugging Face tokenizer.json.
    tokenizer = next((path / n for n in ("tokenizer.model", "tokenizer.json") if (path / n).is_file()), None)
    if (path / NORMLAB_EXPORT_CONFIG).is_file():
        from safetensors.torch import load_file

        meta = _read_json(path / NORMLAB_EXPORT_CONFIG)
        model = _build(meta["model"], load_file(path / "model.safetensors"), path)
        return Loaded(model, meta.get("step"), None, {}, tokenizer, "normlab safetensors export")
    import transformers

    from model.hf_compat import from_hf

    refuse_custom_code(path, f"'{path}'")  # before transformers could ask whether to run the model's own code
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, **HF_READ, dtype=torch.float32)
    except (OSError, ValueError, KeyError, pickle.UnpicklingError) as err:
        raise _hf_refusal(path, err) from None
    step = _read_json(path / "config.json").get("normlab_step")
    return Loaded(from_hf(hf), step, None, {}, tokenizer, "Hugging Face export")


def _hf_refusal(path: Path, err: Exception) -> CheckpointError:
    """One line for a Hugging Face directory transformers could not load (a pickled weights file that names a type
    outside tensors — refused weights-only, never run — a missing file, a config it does not know)."""
    if isinstance(err, pickle.UnpicklingError):  # transformers reads pytorch_model.bin weights-only
        # Name the weights file — of a sharded model, the shard holding a refused type (err names no file)
        files = sorted(path.glob("pytorch_model*.bin"))
        named = [f for f in files if unsafe_globals(f)]
        return refusal((named or files or [path])[0], err)
    message = " ".join(str(err).split())
    return CheckpointError(f"cannot load the Hugging Face model in '{path}' ({type(err).__name__}: {message[:300]})")


def _load_file(path: Path) -> Loaded:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        loaded = safe_torch_load(path)
        state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
        if state is None:
            raise CheckpointError(f"'{path}' holds no state dict")
    config = model_config(path.parent, f"put the run's {MODEL_CONFIG_FILE} beside '{path.name}'")
    run_dir, run_config = _run_context(path.parent)
    return Loaded(_build(config, _strip(state), path), None, run_dir, run_config, tokenizer_of(run_config),
                  "state-dict file")


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> Loaded:
    """Load the model at `path` (see the module docstring for the accepted formats) onto `device`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist; list a run's checkpoints with "
                              "`ls runs/<name>/checkpoints/`")
    if path.is_dir() and (path / MANIFEST).is_file():
        loaded = _load_step_dir(path)
    elif path.is_dir() and ((path / "config.json").is_file() or (path / NORMLAB_EXPORT_CONFIG).is_file()):
        loaded = _load_export_dir(path)
    elif path.is_dir():
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {MANIFEST}) nor an exported model "
                              "(no config.json); an interrupted save leaves such a directory — use an earlier one")
    else:
        loaded = _load_file(path)
    loaded.model.to(device=device, dtype=dtype).eval()
    log.info("loaded %s from %s (step %s)", loaded.source, path, loaded.step)
    return loaded
