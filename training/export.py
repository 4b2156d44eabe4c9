"""`normlab export`: a checkpoint → a Hugging Face model directory (or normlab's own safetensors format).

The Hugging Face directory holds `config.json` (model_type llama | qwen3 | olmo2), `model.safetensors`,
`generation_config.json` and the tokenizer (`tokenizer.json` for `AutoTokenizer`, plus the original
sentencepiece `tokenizer.model`). Weights go through `model.hf_compat`, the same name table the parity tests
check. A config with no `transformers` equivalent is refused with the field that prevents it; `--format
safetensors` writes `normlab_config.json` + `model.safetensors` instead, loadable by every normlab command.
The directory appears atomically: it is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from data.layout import load_tokenizer
from model import Transformer
from model.hf_compat import hf_family, to_hf
from model.mup import to_standard
from training.checkpointing.load import NORMLAB_EXPORT_CONFIG, Loaded, load_checkpoint
from training.errors import UserError


def _special_tokens(tokenizer_path: Path) -> dict[str, tuple[str, int]]:
    if tokenizer_path.suffix == ".json":
        return _hf_special_tokens(tokenizer_path)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    ids = {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
    return {k: (sp.id_to_piece(i), i) for k, i in ids.items() if i >= 0}


def _hf_special_tokens(tokenizer_path: Path) -> dict[str, tuple[str, int]]:
    """The special tokens of a `tokenizer.json` as normlab used them (ids from the prepared meta.json)."""
    from tokenizers import Tokenizer

    tok = load_tokenizer(tokenizer_path)
    raw = Tokenizer.from_file(str(tokenizer_path))
    ids = {"unk": tok.unk_id, "bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    return {k: (raw.id_to_token(i), i) for k, i in ids.items() if i >= 0}


def write_hf_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """The tokenizer for `AutoTokenizer`: a Hugging Face `tokenizer.json` as it is (with its special tokens
    named), or a `tokenizers` BPE equivalent of the sentencepiece model (same ids for any text), saved for
    AutoTokenizer.

    Built directly rather than through transformers' Llama converter, which prepends "▁" to every text —
    normlab's tokenizer is trained without that dummy prefix, so the converter would change the ids.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    if tokenizer_path.suffix == ".json":
        specials = {f"{k}_token": piece for k, (piece, _) in _special_tokens(tokenizer_path).items()}
        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), **specials).save_pretrained(str(out))
        return

    extracted = SentencePieceExtractor(str(tokenizer_path)).extract(models.BPE)
    tok = Tokenizer(models.BPE(vocab=extracted["vocab"], merges=extracted["merges"], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = _special_tokens(tokenizer_path)
    tok.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece, _ in specials.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": piece for k, (piece, _) in specials.items()})
    fast.save_pretrained(str(out))
    shutil.copyfile(tokenizer_path, out / "tokenizer.model")


def _write_hf(loaded: Loaded, out: Path, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    ids = {f"{k}_token_id": i for k, (_, i) in _special_tokens(loaded.tokenizer_path).items()} \
        if loaded.tokenizer_path else {}
    ids = {k: v for k, v in ids.items() if k != "unk_token_id"}
    hf = to_hf(loaded.model)
    for key, value in ids.items():
        setattr(hf.config, key, value)
    hf.config.normlab_step = loaded.step
    hf.generation_config = GenerationConfig(**ids)
    hf.to(dtype).save_pretrained(str(out), safe_serialization=True)


def hf_equivalent(model: Transformer) -> Transformer:
    """`model` as Hugging Face can run it — a config with a `transformers` equivalent (model/hf_compat.py), a μP
    model with its multipliers folded into the weights (same logits, model/mup.py) — or one UserError line naming
    the field that prevents it. (model/ raises ValueError, since it cannot import training.errors: the refusal is
    bad input, said so here.)"""
    try:
        hf_family(model.cfg)
        return to_standard(model)
    except ValueError as err:
        raise UserError(str(err)) from None


def _write_safetensors(loaded: Loaded, out: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous() for k, v in loaded.model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    meta = {"format_version": 1, "step": loaded.step, "model": loaded.model.cfg.to_dict()}
    (out / NORMLAB_EXPORT_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    if loaded.tokenizer_path:
        shutil.copyfile(loaded.tokenizer_path, out / loaded.tokenizer_path.name)


def export(checkpoint: str | Path, output: str | Path, dtype: str = "float32", fmt: str = "hf",
           overwrite: bool = False) -> Path:
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise UserError(f"--output '{output}' is a file, not a directory; choose a directory path")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise UserError(f"'{output}' already exists and is not empty; choose another --output or pass --overwrite")
    loaded = load_checkpoint(checkpoint)
    if fmt == "hf":
        loaded.model = hf_equivalent(loaded.model)  # before writing anything
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")  # beside the output: the rename stays atomic
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if fmt == "hf":
            _write_hf(loaded, tmp, torch_dtype)
            if loaded.tokenizer_path:
                write_hf_tokenizer(loaded.tokenizer_path, tmp)
        else:
            _write_safetensors(loaded, tmp, torch_dtype)
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    except OSError as err:  # an unwritable place, a full disk: name the output, not the temporary directory
        raise UserError(f"cannot write --output '{output}' ({err.strerror or err}); nothing was written there: "
                        "choose a directory you can write to (with room for the model)") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--format", dest="fmt", default="hf", choices=["hf", "safetensors"],
                    help="hf: a transformers directory (Llama, Qwen3, OLMo 2 configs); safetensors: normlab's own")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    out = export(args.checkpoint, args.output, args.dtype, args.fmt, args.overwrite)
    print(f"exported {args.checkpoint} → {out} ({args.fmt}, {args.dtype})")
    return 0
