"""normlab never runs a model's own code.

A Hugging Face directory whose `config.json` has an `auto_map` names classes defined in Python files that come
with the weights; `transformers` runs them only with `trust_remote_code=True`, and otherwise stops at an
interactive "Do you wish to run the custom code? [y/N]" — which nobody answers in a sweep or a batch job.
Every normlab command that reads a Hugging Face directory (`fit --init_from`, and `evaluate`, `export`,
`generate` on an exported model) refuses such a directory in one line before `transformers` sees it, and reads
every other one with `HF_READ` (local files only, `trust_remote_code=False`).
"""
from __future__ import annotations

import json
from pathlib import Path

from training.errors import UserError

HF_READ = {"local_files_only": True, "trust_remote_code": False}  # every `from_pretrained` normlab calls


def custom_classes(directory: Path) -> dict[str, object] | None:
    """The `auto_map` of `directory/config.json` (class → the custom code defining it), or None when it has none
    (or no readable config.json: the reader that follows reports that)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return None
    return auto_map if isinstance(auto_map, dict) else {"?": auto_map}


def refuse_custom_code(directory: Path, where: str) -> None:
    """One error line when `directory` is a model defined by its own code (`where`: what names it, e.g. the flag)."""
    auto_map = custom_classes(directory)
    if auto_map is None:
        return
    named = ", ".join(f"{cls} → {_where_defined(code)}" for cls, code in sorted(auto_map.items()))
    raise UserError(f"{where}: its config.json has an auto_map ({named}): the model is defined by its own Python "
                    "code, which normlab never runs (trust_remote_code=False); give a model that transformers "
                    "implements itself (Llama, Qwen3, OLMo 2 families), or one converted to such a config")


def _where_defined(code: object) -> str:
    """`auto_map`'s value for one class: "module.Class", or [slow, fast] for a tokenizer (either may be null)."""
    names = [code] if isinstance(code, str) else [c for c in code if isinstance(c, str)] \
        if isinstance(code, list) else []
    return names[0] if names else repr(code)
