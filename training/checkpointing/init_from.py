"""`normlab fit --init_from PATH`: a new run that starts from a published model's or another run's weights.

PATH is a Hugging Face model directory (`config.json` + `model.safetensors` or its shards, as `save_pretrained`
writes and the Hub serves), a normlab checkpoint directory (`runs/<name>/checkpoints/step-X`, any ZeRO stage) or
a `normlab export` (either format). Only the weights are taken: the optimizer, schedule, step and data position
start fresh (a branch that keeps them is `--branch_from`). Weights are read with safetensors or
`torch.load(weights_only=True)`, never by unpickling code.

- Model fields left at their defaults take the source's values (sizes, RoPE, norms, …); fields given on the
  command line or in a `-c` file that differ from the source's are norm surgery (training/checkpointing/surgery.py).
- The source's tokenizer must be the prepared data's (sha256 compared).
- At load, on rank 0 and the first validation batch: a Hugging Face source's logits from `transformers` are
  compared with the converted model's (`init/hf_max_abs_logit_diff`), and at step 0 the run logs how far this
  run's model is from the source (`surgery/kl`, `surgery/max_abs_logit_diff`; 0 when nothing changed).
- Every checkpoint manifest of the run records the source under `init_from` (path, kind, content sha256, …).
- ZeRO-1/2: every rank reads the source and fills its (whole) model before DeepSpeed starts. ZeRO-3: the model
  is already partitioned when it is built; only rank 0 reads the source, and each parameter is gathered whole,
  set, and re-partitioned one at a time — no rank holds two full copies of the weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from safetensors import SafetensorError

from data.tokenizer import sha256_file
from model import ModelConfig
from training.checkpointing.load import NORMLAB_EXPORT_CONFIG, load_checkpoint
from training.checkpointing.remote_code import HF_READ, refuse_custom_code
from training.errors import CheckpointError, UserError
from training.run.dir import model_config
from training.run.layout import MANIFEST
from training.run.manifest import Manifest, config_hash

log = logging.getLogger(__name__)

MANIFEST_KEY = "init_from"
NOT_INHERITED = ("kernels",)  # how norms run here, not what the weights are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_KINDS = "a Hugging Face model directory (config.json + *.safetensors), a normlab checkpoint directory " \
         "(runs/<name>/checkpoints/step-X) or a `normlab export` directory"


@dataclass(frozen=True)
class Source:
    """A model to start from, before its weights are read."""

    path: Path  # absolute
    kind: str  # "huggingface" | "checkpoint" | "export"
    config: ModelConfig
    tokenizer_hashes: dict[str, str]  # tokenizer file (or "manifest") → sha256
    step: int | None = None

    @functools.cached_property
    def sha256(self) -> str:
        """Content hash of the whole source directory: sha256 over (relative path, sha256 of the file)."""
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(self.path)}\0{sha256_file(file)}\n".encode())
        return digest.hexdigest()

    def record(self) -> dict[str, Any]:
        """What the run's manifests record about the source."""
        return {"path": str(self.path), "kind": self.kind, "sha256": self.sha256, "step": self.step,
                "config_hash": config_hash(self.config.to_dict()), "tokenizer_sha256": self.tokenizer_hashes}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The source's weights under normlab's names, on the CPU."""
        try:
            if self.kind == "huggingface":
                return _hf_state_dict(self.path, self.config)
            if self.kind == "export":
                from safetensors.torch import load_file

                return load_file(self.path / "model.safetensors")
            return load_checkpoint(self.path).model.state_dict()
        except CheckpointError as err:
            raise UserError(f"--init_from {self.path}: {err}") from err
        except (OSError, ValueError, RuntimeError, KeyError) as err:  # truncated or foreign weight files
            raise UserError(f"--init_from {self.path}: cannot read its weights ({type(err).__name__}: {err}); "
                            f"give {_KINDS}") from err


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of a safetensors directory (one file, or the shards its index names), headers checked:
    a missing or truncated file is refused before anything starts."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = sorted({path / n for n in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else [path / "model.safetensors"]
    for file in files:
        with safe_open(str(file), framework="pt"):  # reads and checks the header against the file's size
            pass
    return files


def _hf_state_dict(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from model.hf_compat import state_dict_from_hf

    pairs = []
    for name in _safetensors_files(path):
        with safe_open(str(name), framework="pt") as f:
            pairs += [(key, f.get_tensor(key).float()) for key in f.keys()]  # noqa: SIM118 (safe_open has no iter)
    return state_dict_from_hf(cfg, pairs)


def resolve(init_from: str) -> Source:
    """`--init_from` → the source (its config and tokenizer; the weights are read later), or one error line."""
    path = Path(init_from).expanduser().resolve()
    where = f"--init_from {init_from}"
    if not path.is_dir():
        raise UserError(f"{where}: {'not a directory' if path.exists() else 'no such directory'}; give {_KINDS}")
    refuse_custom_code(path, where)  # before transformers could ask whether to run the model's own code
    try:
        if (path / MANIFEST).is_file():
            manifest = Manifest.read(path)
            config = ModelConfig(**model_config(path))
            hashes = {"manifest": manifest.tokenizer_hash} if manifest.tokenizer_hash else {}
            return Source(path, "checkpoint", config, hashes, manifest.step)
        hashes = {n: sha256_file(path / n) for n in TOKENIZER_FILES if (path / n).is_file()}
        if (path / NORMLAB_EXPORT_CONFIG).is_file() or (path / "config.json").is_file():
            _safetensors_files(path)
        if (path / NORMLAB_EXPORT_CONFIG).is_file():
            meta = json.loads((path / NORMLAB_EXPORT_CONFIG).read_text())
            return Source(path, "export", ModelConfig(**meta["model"]), hashes, meta.get("step"))
        if (path / "config.json").is_file():
            import transformers

            from model.hf_compat import config_from_hf

            hf_cfg = transformers.AutoConfig.from_pretrained(path, **HF_READ)
            return Source(path, "huggingface", config_from_hf(hf_cfg), hashes, getattr(hf_cfg, "normlab_step", None))
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as err:  # (CheckpointError is a ValueError)
        raise UserError(f"{where}: cannot read it ({type(err).__name__}: {err}); give {_KINDS}") from err
    raise UserError(f"{where}: no config.json, {NORMLAB_EXPORT_CONFIG} or {MANIFEST} there; give {_KINDS}")


def inherit_model_fields(model: Any, defaults: Any, source: Source) -> list[str]:
    """Set each model field of the parsed config `model` that was not given (unset, or at the default the parser
    read from configs/default.yaml) to the source's value; return the fields given that differ from the source's
    (the surgery)."""
    changed = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in NOT_INHERITED:
            continue
        given, theirs = getattr(model, f.name, None), getattr(source.config, f.name)
        if given is None or given == getattr(defaults, f.name, None):
            setattr(model, f.name, theirs)
        elif given != theirs:
            changed.append(f.name)
    return changed


def check_tokenizer(source: Source, data_tokenizer: Path, data_sha256: str) -> None:
    """The source's tokenizer must be the one the data was prepared with: one line naming both otherwise."""
    if data_sha256 in source.tokenizer_hashes.values():
        return
    if not source.tokenizer_hashes:
        raise UserError(f"--init_from {source.path}: it has no tokenizer ({' or '.join(TOKENIZER_FILES)}) to check "
                        f"against the data's {data_tokenizer} (sha256 {data_sha256[:12]}…); put the model's "
                        "tokenizer beside its weights")
    theirs = ", ".join(f"{source.path / n if n != 'manifest' else 'its run'} (sha256 {h[:12]}…)"
                       for n, h in source.tokenizer_hashes.items())
    fix = f"normlab prepare --tokenizer {shlex.quote(str(source.path / next(iter(source.tokenizer_hashes))))} ..." \
        if source.kind != "checkpoint" else "train on that run's --data.path (or data prepared with its tokenizer)"
    raise UserError(f"--init_from {source.path}: its tokenizer {theirs} is not the prepared data's {data_tokenizer} "
                    f"(sha256 {data_sha256[:12]}…); prepare the data with the model's tokenizer: {fix}")


MAX_COMPARED_TOKENS = 4096  # of the first validation batch (whole rows): bounds the [tokens, vocab] logits kept


def first_val_tokens(datamodule: Any) -> torch.Tensor | None:
    """The inputs [B', T] of this rank's first validation batch (rows up to MAX_COMPARED_TOKENS), or None."""
    loader = datamodule.val_dataloader()
    loader = loader[0] if isinstance(loader, list) and loader else loader
    if not loader:
        return None
    batch = next(iter(loader))
    tokens = (batch["tokens"] if isinstance(batch, dict) else batch)[:, :-1]
    return tokens[: max(1, MAX_COMPARED_TOKENS // tokens.shape[1])]


class InitFrom(Callback):
    """Fills a LitLM's freshly built model from the source (`load_into`, called by `LitLM.configure_model`, before
    any strategy wraps or shards it further), then logs the step-0 distance (`on_train_start`). One of a fresh
    fit's callbacks (the CLI builds it once the source's tokenizer is checked against the data's)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.tokens: torch.Tensor | None = None  # this rank's first validation inputs
        self.source_logits: torch.Tensor | None = None  # rank 0: the source's logits on them (CPU)
        self.metrics: dict[str, float] = {}

    def load_into(self, lit: Any) -> None:
        trainer, model = lit.trainer, lit.model
        rank0 = trainer.global_rank == 0
        zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
        state = None
        with _outside_zero_init():  # rank 0 alone builds models here: they must not be partitioned (collectives)
            self.tokens = first_val_tokens(trainer.datamodule)
            if rank0 and self.tokens is not None and self.source.kind == "huggingface":
                self._compare_with_transformers(trainer.strategy.root_device)
            if rank0 or not zero3:
                state = self.source.state_dict()
            if rank0 and self.tokens is not None:
                self._source_logits(state, trainer.strategy.root_device)
        from training.checkpointing.surgery import changed_fields, transfer

        report = transfer(state, self.source.config, model, lit.config, writer=rank0 or not zero3)
        if rank0:
            changes = "; ".join(f"{k}: {a!r} → {b!r}" for k, a, b in changed_fields(self.source.config, lit.config))
            log.info("init_from %s (%s): %s%s", self.source.path, self.source.kind, report.summary(),
                     f"; surgery: {changes}" if changes else "")

    def _source_logits(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.source_logits = _logits_of(self.source.config, state, self.tokens, device)
        if "init/hf_logits" in self.metrics:
            diff = (self.source_logits - self.metrics.pop("init/hf_logits")).abs().max().item()
            self.metrics["init/hf_max_abs_logit_diff"] = diff
            log.info("init_from: converted model vs transformers on the first validation batch: max |Δlogit| %.3g",
                     diff)

    def _compare_with_transformers(self, device: torch.device) -> None:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(self.source.path, **HF_READ,
                                                               dtype=torch.float32).to(device).eval()
        with torch.no_grad():
            self.metrics["init/hf_logits"] = hf(self.tokens.to(device)).logits.float().cpu()
        del hf  # before the source's own weights are read: never two full copies at once

    def on_train_start(self, trainer: Any, lit: Any) -> None:
        """Every rank runs the model (ZeRO-3 gathers collectively); rank 0 logs the distance at step 0."""
        if self.tokens is None:
            log.warning("init_from: no validation data, so no step-0 distance to the source is logged")
            return
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            logits = lit.model(self.tokens.to(lit.device)).float().cpu()
        if trainer.global_rank == 0 and self.source_logits is not None:
            from training.checkpointing.surgery import distance

            self.metrics.update(distance(self.source_logits, logits))
            if trainer.logger is not None:
                trainer.logger.log_metrics(self.metrics, step=0)
            log.info("init_from: step 0 vs the source on the first validation batch: %s",
                     ", ".join(f"{k} {v:.4g}" for k, v in self.metrics.items()))
        self.source_logits = None


@contextlib.contextmanager
def _outside_zero_init() -> Iterator[None]:
    """Module construction as usual, inside `LitLM.configure_model` under ZeRO-3: Lightning runs it in
    `deepspeed.zero.Init`, which partitions every module built (a collective) — on rank 0 alone that would hang.
    DeepSpeed's own pause of the context (it initializes its engine inside Init the same way)."""
    try:
        from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    except ImportError:  # no DeepSpeed: nothing to pause
        yield
        return
    from training.compat import require

    require("deepspeed.runtime.zero.partition_parameters:shutdown_init_context")
    require("deepspeed.runtime.zero.partition_parameters:restore_init_context")
    shutdown_init_context()
    try:
        yield
    finally:
        restore_init_context()


def _logits_of(cfg: ModelConfig, state: dict[str, torch.Tensor], tokens: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """The source model's fp32 logits on `tokens` (built around `state`'s own tensors: no copy on the CPU)."""
    from model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.replace(kernels="auto"))
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device).eval()
    with torch.no_grad():
        return model(tokens.to(device)).float().cpu()


def prepare(subcommand: str, config: Any, defaults: Any) -> Source:
    """Before the classes are built: check `--init_from`, and give the model fields not set the source's values."""
    if subcommand != "fit":
        raise UserError(f"--init_from applies to `normlab fit` (a new run), not `normlab {subcommand}`")
    if config.branch_from is not None:
        raise UserError(f"--init_from {config.init_from} and --branch_from {config.branch_from}: give one of them "
                        "(--init_from takes weights only; --branch_from also the optimizer, step and data position)")
    source = resolve(config.init_from)
    changed = inherit_model_fields(config.model, defaults.model, source)
    if changed:
        log.info("init_from: model fields that differ from the source's (surgery): %s", ", ".join(changed))
    return source
