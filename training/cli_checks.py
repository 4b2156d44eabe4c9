"""Checks of `normlab fit | validate | test` input that no constructor makes, run before anything is built or
written: the `-c` files as files, and trainer settings Lightning accepts but that cannot train (or would train
something else than asked). Each failure is one UserError naming the flag or file, the value and the fix.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from training import safe_yaml
from training.errors import UserError

log = logging.getLogger(__name__)

_CONFIG_FLAGS = ("-c", "--config")
# {-c value: sha256} a sweep recorded for the run it starts (training/sweep/launch.py): the fit refuses a file that no
# longer has its hash, so the run's record always says what it read, even when a file is edited as it starts.
CONFIG_HASHES_ENV = "NORMLAB_CONFIG_SHA256"


def config_files(argv: list[str]) -> list[str]:
    """The values of `-c` / `--config` (also `--config=FILE`) in `argv`."""
    found = []
    for i, arg in enumerate(argv):
        if arg in _CONFIG_FLAGS and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.split("=", 1)[1])
    return found


def check_config_files(argv: list[str]) -> None:
    """Every `-c FILE` that names a file holds a YAML mapping of UTF-8 text, and has the digest a sweep recorded
    for it when it started this run (`CONFIG_HASHES_ENV`, set by training/sweep/launch.py), if any; the config
    files it names (`optim: opt.yaml`) are read as YAML too. Every one is read through the bounded YAML loader
    first (training/safe_yaml.py), as jsonargparse reads them unbounded after. (A value that is not a file is left
    to the parser, which also takes inline YAML there.)"""
    expected = json.loads(os.environ.get(CONFIG_HASHES_ENV) or "{}")
    for name in config_files(argv):
        path = Path(name)
        if not path.is_file():
            continue
        where = f"-c {name}"
        if name in expected and config_digest(path) != expected[name]:
            raise UserError(f"-c {edited_name(path)} was edited after "
                            "`normlab sweep` recorded this run's config: a sweep trains one config; restore the file, "
                            "or give the edited spec a new name")
        config = _read_config(path, where)
        if config is None:
            raise UserError(f"{where}: the file is empty; give a YAML mapping of config groups (e.g. "
                            "`optim: {lr: 0.001}`), or drop the -c")
        if not isinstance(config, dict):
            raise UserError(f"{where}: holds a YAML {type(config).__name__}, not a mapping of config groups (e.g. "
                            "`optim: {lr: 0.001}`)")
        _check_nested(path, config, where, {path.resolve()})


def _read_config(path: Path, where: str) -> Any:
    """The YAML of a config file, or one UserError naming it (`where`): not UTF-8, not YAML, an alias bomb."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: not a UTF-8 text file (byte {err.start} is {data[err.start]:#04x}); give a "
                        "YAML config file") from None
    try:
        return safe_yaml.load(text, where)
    except yaml.YAMLError as err:
        raise UserError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


def _check_nested(path: Path, config: Any, where: str, seen: set[Path]) -> None:
    """The config files `config` (read from `path`) names, and theirs, read as `_read_config` reads a -c file."""
    for nested in nested_config_files(path, config):
        if nested.resolve() in seen:
            continue
        nested_where = f"{nested} (named in {where})"
        _check_nested(nested, _read_config(nested, nested_where), nested_where, seen | {nested.resolve()})


# A string value of a config ending so, naming a file, is a nested config: jsonargparse reads `optim: opt.yaml`
# (or `trainer: ...`, `model: ...`) as that file's contents, relative to the directory of the file naming it.
NESTED_SUFFIXES = (".yaml", ".yml", ".json")


def nested_config_files(path: Path, config: Any) -> list[Path]:
    """The files that string values anywhere in `config` (the YAML of `path`) name, with a config file's suffix:
    relative to `path`'s directory (as jsonargparse resolves them), else to the current one."""
    found: list[Path] = []
    pending = [config]
    while pending:  # (iterative: the depth is bounded by the loader, but a walk needs no stack)
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, list):
            pending += value
        elif isinstance(value, str) and value.endswith(NESTED_SUFFIXES):
            candidate = next((p for p in (path.parent / value, Path(value)) if p.is_file()), None)
            if candidate is not None and candidate not in found:
                found.append(candidate)
    return sorted(found)


def _parsed(path: Path) -> Any:
    """The YAML of `path`, or None when it is not readable YAML (then it names no other file)."""
    try:
        return safe_yaml.load(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):  # (UserError is a ValueError)
        return None


def edited_name(path: str | Path) -> str:
    """`path` as an edit names it: with the config files it names, when there are any (an edit of either changes
    its `config_digest`)."""
    path = Path(path)
    nested = nested_config_files(path, _parsed(path)) if path.is_file() else []
    return f"{path} (or a config file it names: {', '.join(map(str, nested))})" if nested else str(path)


def config_digest(path: str | Path, seen: frozenset[Path] = frozenset()) -> str:
    """The sha256 a sweep records for a `-c` file, and a fit checks: of the file's bytes and of every config file
    it names (and those name): an edit of `opt.yaml` behind `optim: opt.yaml` changes a run's config as much as an
    edit of the file itself. A file that names none has the sha256 of its bytes. Raises OSError if unreadable."""
    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    seen = seen | {path.resolve()}
    nested = [p for p in nested_config_files(path, _parsed(path)) if p.resolve() not in seen]
    if not nested:
        return digest
    parts = [digest, *(f"{p}={config_digest(p, seen)}" for p in nested)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def check_trainer(subcommand: str, trainer: Any, optim: Any, warn: bool = True) -> None:
    """The `trainer.*` values (and their interplay with `optim.*`) that Lightning accepts but normlab cannot run:
    no steps, no micro-batches per step, a negative clip (Lightning reads it as "no clipping"), a schedule with no
    end. A warm-up that the run never finishes is trained as given, with a warning (when `warn`: one rank says it)."""
    accumulate = trainer.accumulate_grad_batches
    if not (isinstance(accumulate, int) and accumulate >= 1):
        raise UserError(f"--trainer.accumulate_grad_batches {accumulate} must be an integer >= 1 (micro-batches per "
                        "optimizer step)")
    clip = trainer.gradient_clip_val
    if clip is not None and not clip >= 0:
        raise UserError(f"--trainer.gradient_clip_val {clip} must be >= 0 (0 or null: no clipping)")
    if subcommand != "fit":
        return
    max_steps = trainer.max_steps
    if max_steps == 0:
        raise UserError("--trainer.max_steps 0 trains no step: give the step to end at (>= 1)")
    if optim.decay_steps is None and max_steps == -1 and trainer.max_epochs == -1:
        raise UserError("--trainer.max_steps -1 with --trainer.max_epochs -1 never ends, so the LR schedule has no "
                        "end: set --optim.decay_steps, or a --trainer.max_steps")
    if warn and optim.decay_steps is None and 0 < max_steps <= optim.warmup_steps < math.inf:
        log.warning("optim.warmup_steps %d is not below trainer.max_steps %d: the LR never finishes its warm-up "
                    "(it ends at %.3g of optim.lr); lower --optim.warmup_steps to train at the LR given",
                    optim.warmup_steps, max_steps, max_steps / optim.warmup_steps)


def unknown_option(message: str, options: list[str], argv: list[str], command: str) -> str | None:
    """For a parse error `message` about options the parser does not know — `unrecognized arguments: --x 1` (a flag)
    or `... does not accept option 'x'` / `Option 'x' is not accepted` (a key of a -c file, or of a group given as
    YAML) — the one line naming each, the -c file it came from, and the nearest of `options` (the parser's flags,
    `--group.key`); else None."""
    prefix = "unrecognized arguments:"
    if message.startswith(prefix):
        flags = [word.split("=", 1)[0] for word in message[len(prefix):].split() if word.startswith("-")]
        return "; ".join(f"{flag} is not an option of normlab {command}{_did_you_mean(flag, options, '--')}"
                         for flag in flags) + f" (normlab {command} --help lists the options)" if flags else None
    found = (re.search(r"(?:Group '([^']+)' )?does not accept option '([^']+)'", message)
             or re.search(r"()Option '([^']+)' is not accepted", message))
    if found is None:
        return None
    group, key = found.groups()  # (a group's own check names the key within it)
    key = f"{group}.{key}" if group and not key.startswith(f"{group}.") else key
    files = [name for name in config_files(argv) if key in _flat_keys(_parsed(Path(name)))]
    where = f"-c {files[-1]}: " if files else ""
    return (f"{where}{key} is not an option of normlab {command}{_did_you_mean(key, options, '')} (normlab "
            f"{command} --help lists the options)")


def _did_you_mean(typed: str, options: list[str], dashes: str) -> str:
    """`: did you mean --group.key?` for the option nearest `typed` (hyphens read as underscores; a bare name such
    as `--max-steps` matched against the options' last parts), or "" when none is near."""
    keys = [o.lstrip("-") for o in options]
    name = typed.lstrip("-").replace("-", "_")
    by_full = difflib.get_close_matches(name, keys, n=1, cutoff=0.75)
    leaves: dict[str, list[str]] = {}
    for key in keys:
        leaves.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    leaf = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.8)
    by_leaf = leaves[leaf[0]] if leaf and len(leaves[leaf[0]]) == 1 else []
    best = (by_full or by_leaf) if "." in name else (by_leaf or by_full)
    return f": did you mean {dashes}{best[0]}?" if best else ""


def _flat_keys(config: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a nested mapping, its groups' included (`model`, `model.norm`)."""
    if not isinstance(config, dict):
        return set()
    keys: set[str] = set()
    for key, value in config.items():
        keys |= {f"{prefix}{key}"} | _flat_keys(value, f"{prefix}{key}.")
    return keys
