"""Reading checkpoint files without running code from them.

A `.pt`/`.ckpt` file is a pickle, and unpickling can call any function the file names (`os.system` included).
normlab trusts nothing in a checkpoint: every file it reads — Lightning's `model.ckpt`, DeepSpeed's model and
optimizer shards of every ZeRO stage, the universal-format cache — is read by `torch.load(weights_only=True)`,
PyTorch's restricted unpickler, which builds tensors, containers and primitives, plus only the few classes in
`_allowed()` below. A file that names anything else is refused with one line naming the file and the type, before
any of it is built (`UnsafeCheckpointError`).

Three entry points:
- `refuse_code(ckpt_dir)`: every pickled file of a checkpoint directory is scanned (its pickle opcodes, not
  run) before a multi-rank load, so every rank refuses the same file at the same point — a rank that failed
  inside DeepSpeed's loader alone would leave the others waiting in its next collective;
- `safe_torch_load(path)`: normlab's own reads (evaluate, export, generate, the run history, Lightning's
  checkpoint IO via `SafeCheckpointIO`, `fit --init_from`);
- `no_code_from_checkpoints()`: DeepSpeed reads its checkpoints at some twenty call sites that all pass
  `weights_only=False` to `torch.load` — its checkpoint engine, but also zero_to_fp32, the universal loader
  and ds_to_universal, which bypass the engine — so inside this context `torch.load` itself reads weights-only
  (catalogued in training/compat.py). It is entered only around DeepSpeed's checkpoint reads.
"""
from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from data.atomic import atomic_write
from training.errors import CheckpointError


def _allowed() -> list[Any]:
    """The non-tensor classes normlab's checkpoints hold, each needed by a real checkpoint (found by loading one
    of every ZeRO stage, a Lightning file and a universal cache with weights_only=True and nothing allowed).
    Only DeepSpeed's shards store them, and every DeepSpeed reader imports DeepSpeed first: without it imported,
    nothing is allowed (and a Lightning file's read does not import DeepSpeed, whose import prints a warning)."""
    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # (internal classes: catalogued in training/compat.py)
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        LossScaler,  # ZeRO optimizer shards: `loss_scaler` (static scale 1.0 in fp32/bf16; its attributes only)
        ZeroStageEnum,  # ZeRO optimizer shards: `zero_stage` (an IntEnum)
        fragment_address,  # ZeRO-1/2 optimizer shards: `param_slice_mappings` (a namedtuple of two ints)
    ]


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose unpickling would build a type outside the allow-list (it could run code)."""


_GLOBAL = re.compile(r"GLOBAL (\S+)|global[s]?:? \[?['\"]?([\w.]+)")


def refusal(path: Any, err: Exception) -> CheckpointError:
    """One line for a file the restricted unpickler refused (`err`), naming the file and the type. A plain
    pickle (not torch.save's format) is refused before the unpickler reaches any type — its error names an
    opcode — so the type is then read from the file's pickle opcodes."""
    found = _GLOBAL.search(str(err))
    if found:
        what = next(g for g in found.groups() if g)
    else:
        names = unsafe_globals(Path(path)) if isinstance(path, (str, os.PathLike)) and Path(path).is_file() else []
        what = names[0] if names else f"content the weights-only reader refuses ({_torch_reason(err)})"
    return UnsafeCheckpointError(
        f"refusing to load '{path}': it holds {what}, which is not a tensor nor one of the few types normlab "
        "checkpoints contain — unpickling it could run code. Nothing from it was run; load only checkpoints "
        "written by normlab (see docs/checkpoints.md)")


def _torch_reason(err: Exception) -> str:
    """The line of torch's weights-only error that says what it met (not its advice around it)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation",
                                                        "Please file an issue"))]
    return (useful or lines or [type(err).__name__])[0][:200]


def unsafe_globals(path: Path) -> list[str]:
    """The globals a plain pickle file names that `torch.load(weights_only=True)` (with `_allowed()`) refuses,
    those outside torch first (the most telling: `torch.storage._load_from_bytes`, a plain pickle's tensor
    storage, is refused too, as it unpickles without restriction)."""
    from training.compat import require

    require("torch._weights_only_unpickler:_get_allowed_globals")
    unpickler = importlib.import_module("torch._weights_only_unpickler")  # (catalogued in training/compat.py)
    allowed = {*unpickler._get_allowed_globals(), *(f"{c.__module__}.{c.__qualname__}"
                                                                 for c in _allowed())}
    refused = [name for name in pickle_globals(path) if name not in allowed]
    return sorted(refused, key=lambda name: name.split(".")[0] == "torch")


def pickle_globals(path: Path) -> list[str]:
    """The globals (`module.name`) a plain pickle file names, each once, read opcode by opcode
    (pickletools: nothing is built or run). STACK_GLOBAL takes its module and name from the two strings pushed
    before it, directly or through the memo. A zip archive, or an unreadable tail, gives what was found."""
    import pickletools

    found: list[str] = []
    strings: list[str] = []
    memo: dict[int, Any] = {}
    top: Any = None  # the string the last opcode pushed, if it pushed one
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                pushed, new = None, False
                if op.name in ("GLOBAL", "INST"):
                    found.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif "UNICODE" in op.name and isinstance(arg, str):
                    pushed, new = arg, True
                elif op.name == "MEMOIZE":  # stores the top of the stack, which stays there
                    memo[len(memo)], pushed = top, top
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[arg], pushed = top, top
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed, new = memo.get(arg), True
                if new and isinstance(pushed, str):
                    strings.append(pushed)
                top = pushed
    except (ValueError, EOFError, OSError):  # not a pickle from here on (a zip archive, a truncated file)
        pass
    return list(dict.fromkeys(found))


def refuse_code(ckpt_dir: Path) -> None:
    """Refuse `ckpt_dir` if any of its pickled files (DeepSpeed shards, model.ckpt, the universal cache) names a
    type outside the allow-list: one UnsafeCheckpointError naming the file and the type. Reads only each file's
    pickle record, never its tensors, and unpickles nothing."""
    if (Path(ckpt_dir) / "latest").is_file():  # a DeepSpeed directory: its shards' types are allowed (see _allowed)
        import deepspeed  # noqa: F401
    for path in sorted(p for p in Path(ckpt_dir).rglob("*") if p.suffix in (".pt", ".ckpt") and p.is_file()):
        with allowed_types():
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception as err:  # not a zip-format torch file: torch.load will say what it is
                raise CheckpointError(f"cannot read '{path}': it is truncated or not a checkpoint ({err}); use "
                                      "another checkpoint, e.g. the previous step directory") from err
        if unsafe:
            raise refusal(path, ValueError(f"GLOBAL {unsafe[0]}"))


@contextmanager
def allowed_types() -> Iterator[None]:
    """Within the block, weights-only loads also accept `ALLOWED` (scoped: no process-wide registration)."""
    with torch.serialization.safe_globals(_allowed()):
        yield


# How a file torch.save wrote begins: a zip archive (the default format), or a pickle (the legacy one).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _check_is_torch_file(path: Any) -> None:
    """A file that is no torch checkpoint at all (a YAML file given as one) is named as such, before torch's
    weights-only unpickler reports it as an unsupported pickle (which would read as "it could run code")."""
    if not isinstance(path, (str, os.PathLike)) or not Path(path).is_file():
        return
    with open(path, "rb") as f:
        head = f.read(4)
    if not any(head.startswith(magic) for magic in _TORCH_MAGIC):
        raise CheckpointError(f"'{path}' is not a checkpoint file (it is neither a zip archive nor a pickle, as "
                              "torch.save writes them); give a step directory (<run>/checkpoints/step-XXXXXXXX), the "
                              "model.ckpt inside one, or `last`")


def _load(load: Callable[..., Any], f: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs["weights_only"] = True  # whatever the caller asked for
    _check_is_torch_file(f)
    with allowed_types():
        try:
            return load(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise refusal(getattr(f, "name", f), err) from None


def safe_torch_load(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """`torch.load` of `path` that runs no code from the file: a refused type, or a file that is not a readable
    checkpoint, is a CheckpointError naming it."""
    try:
        return _load(torch.load, str(path), map_location=map_location, mmap=mmap)
    except CheckpointError:
        raise
    except Exception as err:  # truncated zip, wrong file type, …
        raise CheckpointError(f"cannot read '{path}': it is truncated or not a checkpoint ({err}); use another "
                              "checkpoint, e.g. the previous step directory") from err


@contextmanager
def no_code_from_checkpoints() -> Iterator[None]:
    """Within the block, every `torch.load` in this process is weights-only with `_allowed()` (see the module
    docstring: DeepSpeed's readers ask for weights_only=False). Nests."""
    from training.compat import patched, require

    require("torch:load")
    load = torch.load
    if getattr(load, "_normlab_weights_only", False):  # already inside the block
        yield
        return

    def weights_only_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        return _load(load, f, *args, **kwargs)

    weights_only_load._normlab_weights_only = True  # type: ignore[attr-defined]
    with patched(torch, "load", weights_only_load):
        yield


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO for `model.ckpt` (without DeepSpeed), reading weights-only and writing through a
    temporary file beside the destination.

    Lightning's own save serializes the whole checkpoint into memory, then has fsspec stage it in a temporary
    file under $TMPDIR before moving it into place: a node whose /tmp is smaller than one checkpoint cannot save
    at all, and its disk-full error names the runs disk. Here the file goes to a temporary file in its own directory
    (the same filesystem, whose free space the save's error reports) through `data.atomic.atomic_write`, which
    fsyncs it and renames it over the name."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if not Path(path).is_file():
            raise CheckpointError(f"checkpoint '{path}' not found")
        return safe_torch_load(path, map_location=map_location or "cpu")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (a local file only), "
                            f"got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file beside it, fsynced and renamed; removed if the save fails (a full disk gets its space
        # back). Written through the file object, so the archive inside is named the same at every save.
        with atomic_write(path, "wb") as f:
            torch.save(checkpoint, f)


def _ds_to_universal(argv: list[str]) -> None:
    """DeepSpeed's universal-format converter (its own command line), reading weights-only; its worker
    processes are forked, and inherit the guard."""
    from deepspeed.checkpoint import ds_to_universal

    from training.compat import require

    require("deepspeed.checkpoint.ds_to_universal:main")
    require("deepspeed.checkpoint.ds_to_universal:parse_arguments")
    sys.argv = ["ds_to_universal", *argv]
    with no_code_from_checkpoints():
        ds_to_universal.main(ds_to_universal.parse_arguments())


if __name__ == "__main__":  # python -m training.checkpointing.safe <ds_to_universal arguments> (training/strategy.py)
    try:
        _ds_to_universal(sys.argv[1:])
    except CheckpointError as err:
        sys.exit(f"error: {err}")
