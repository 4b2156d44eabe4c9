"""Tiny stand-ins for published models, made here (no network): a byte-level BPE `tokenizer.json`, data prepared
with it, and Hugging Face model directories (`save_pretrained` of random `transformers` models of each family's
published structure) that carry that tokenizer, as a Hub download would."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from tests.helpers.multiproc import REPO

VOCAB = 320  # the models' embedding rows; the tokenizer has fewer pieces (as Qwen3's 151,669 of 151,936)
SHORT_RUN = {  # a seconds-long single-process fit; the tests add the source, name and what they vary
    "data": {"seq_len": 16, "batch_size": 4, "val_batches": 2},
    "optim": {"warmup_steps": 0, "lr": 1.0e-30, "min_lr": 0.0},
    "trainer": {"accelerator": "cpu", "max_steps": 1, "val_check_interval": 1, "log_every_n_steps": 1,
                "enable_progress_bar": False, "enable_model_summary": False},
    "checkpoint": {"every_n_steps": 1},
    "metrics": {"every_n_steps": 0},
}


def bpe_tokenizer(out: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A GPT-2-style byte-level BPE with an end-of-text token, saved as `out/tokenizer.json`."""
    from tests.test_data_tokenizers import train_bpe

    return train_bpe(texts, out, vocab_size=vocab_size) / "tokenizer.json"


def prepared_data(root: Path, tokenizer: Path, texts: list[str]) -> Path:
    from data.prepare import prepare

    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return prepare([root / "docs.jsonl"], output=root / "data", tokenizer=tokenizer, val_fraction=0.2)


def hf_model_dir(out: Path, kind: str, tokenizer: Path, seed: int = 0) -> Path:
    """A tiny random `transformers` model of `kind` (tests/test_published_shapes.py) saved with `tokenizer`."""
    from tests.test_published_shapes import tiny_hf_model

    hf = tiny_hf_model(kind, seed=seed, vocab_size=VOCAB)
    hf.save_pretrained(str(out), safe_serialization=True)
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out


def run_config(path: Path, **sections: dict) -> Path:
    """SHORT_RUN with `sections` merged over it, as a `-c` file."""
    config = {k: dict(v) for k, v in SHORT_RUN.items()}
    for key, values in sections.items():
        config.setdefault(key, {}).update(values)
    path.write_text(yaml.safe_dump(config))
    return path


def fit_args(config: Path, data: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return ["fit", "-c", str(config), "--data.path", str(data), "--runs_dir", str(runs), "--name", name, *extra]


__all__ = ["REPO", "VOCAB", "bpe_tokenizer", "fit_args", "hf_model_dir", "prepared_data", "run_config"]
