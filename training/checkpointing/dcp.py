"""Distributed Checkpoint (DCP) directories, as FSDP2 writes them (training/fsdp2.py), read without running code.

A DCP directory (torch.distributed.checkpoint's `FileSystemWriter`) holds `.metadata` — a pickle saying which
chunks of which tensor sit where — and one `__<rank>_<n>.distcp` file per writing rank, a run of records, each the
`torch.save` of one tensor chunk or of one non-tensor value (an optimizer group's `lr`, `name`, `betas`). Beside
them normlab's `meta.pt` (rank 0): the rest of Lightning's checkpoint — loops, callbacks, LR schedulers, RNG.

torch's own reader unpickles `.metadata` with plain `pickle.load` and the non-tensor records with
`torch.load` with `weights_only` off: a crafted file would run code. Here nothing is read that way:
- `refuse_code(ckpt_dir)` checks every record of every `.distcp` file (its pickle opcodes, not run) and the
  metadata before a load, so every rank refuses a crafted file at the same point, with one line naming it;
- `read_metadata` unpickles `.metadata` with an unpickler that builds only DCP's own metadata classes (`_ALLOWED`);
- `load` reads the records inside `no_code_from_checkpoints()` (training/checkpointing/safe.py): torch.load is
  weights-only there, whatever DCP asks for.
"""
from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpointing.safe import allowed_types, no_code_from_checkpoints, refusal
from training.errors import CheckpointError
from training.run.layout import DCP_METADATA

SHARD_SUFFIX = ".distcp"
_DCP = "torch.distributed.checkpoint"


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) → object: what a `.metadata` pickle may build (found by unpickling real checkpoints with
    nothing allowed). Every one is plain data: DCP's dataclasses, torch.Size, dtypes, a memory-format enum, a path
    (the checkpoint id the writer recorded). `_StorageInfo` and `_MEM_FORMAT_ENCODING` are torch internals
    (catalogued in training/compat.py)."""
    from pathlib import PosixPath, PurePosixPath

    from torch.distributed.checkpoint import filesystem, metadata

    names = ["Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
             "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"]
    allowed = {(f"{_DCP}.metadata", n): getattr(metadata, n) for n in names}
    allowed[(f"{_DCP}.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update({("pathlib", c.__name__): c for c in (PosixPath, PurePosixPath)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only `_allowed()` and torch's dtypes; any other global is an UnpicklingError."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        return found


def read_metadata(ckpt_dir: Path) -> Any:
    """The `Metadata` of a DCP directory, unpickled with `_MetadataUnpickler`; a refused or unreadable file is one
    CheckpointError naming it."""
    path = Path(ckpt_dir) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise refusal(path, err) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"cannot read '{path}': it is truncated or not a DCP checkpoint's metadata ({err}); "
                              "use another checkpoint, e.g. the previous step directory") from err


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `read_metadata` restricted to plain data (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # (per-rank metadata files: never written by normlab)
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not a checkpoint normlab writes")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of their own."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: pos, io.SEEK_CUR: self.pos + pos, io.SEEK_END: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _records(ckpt_dir: Path, metadata: Any) -> Iterator[tuple[str, Any]]:
    """(relative path, _StorageInfo) of every record the metadata lists, file by file."""
    for info in sorted(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset)):
        yield info.relative_path, info


def refuse_code(ckpt_dir: Path) -> None:
    """Refuse a DCP directory whose metadata or any record names a type outside the allow-list (safe.py's, for
    records): one UnsafeCheckpointError naming the file. Reads each record's pickle, never its tensor data."""
    ckpt_dir = Path(ckpt_dir)
    metadata = read_metadata(ckpt_dir)
    handles: dict[str, Any] = {}
    try:
        for rel, info in _records(ckpt_dir, metadata):
            if Path(rel).name != rel or not rel.endswith(SHARD_SUFFIX) or info.transform_descriptors:
                raise CheckpointError(f"'{ckpt_dir / DCP_METADATA}' points at '{rel}' "
                                      f"{'through transforms ' if info.transform_descriptors else ''}— not a record "
                                      "of a checkpoint normlab writes; use another checkpoint")
            f = handles.get(rel) or handles.setdefault(rel, open(ckpt_dir / rel, "rb"))  # noqa: SIM115
            with allowed_types():
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(
                        io.BufferedReader(_Slice(f, info.offset, info.length)))
                except Exception as err:  # not a torch.save record
                    raise CheckpointError(f"cannot read '{ckpt_dir / rel}' at byte {info.offset}: it is truncated "
                                          f"or not a checkpoint ({err}); use another checkpoint") from err
            if unsafe:
                raise refusal(ckpt_dir / rel, ValueError(f"GLOBAL {unsafe[0]}"))
    finally:
        for f in handles.values():
            f.close()


def save(state: dict[str, Any], path: Path, rank: int) -> list[Path]:
    """`dcp.save` of `state` into the directory `path` (a collective: every rank writes its shards, files
    fsynced); returns the files this rank wrote. DCP gathers the ranks' failures and raises them on every rank:
    here each rank raises only its own (none on a rank whose writes succeeded), as a held write expects
    (training/checkpointing/save.py)."""
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True))
    except CheckpointException as err:
        own = err.failures.get(rank)
        if own is not None:
            raise own[0] from None
        return []
    written = sorted(Path(path).glob(f"__{rank}_*{SHARD_SUFFIX}"))
    return written + ([Path(path) / DCP_METADATA] if rank == 0 else [])


def load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """`dcp.load` into `state` in place (a collective unless `no_dist`), reading weights-only: a record that would
    build another type is a CheckpointError on every rank (DCP gathers the ranks' failures; the first is raised)."""
    with no_code_from_checkpoints():
        try:
            dcp.load(state, storage_reader=SafeReader(path), no_dist=no_dist)
        except CheckpointException as err:
            first = next(iter(exc for _, (exc, _trace) in sorted(err.failures.items())), err)
            if isinstance(first, CheckpointError):
                raise type(first)(str(first)) from None
            raise CheckpointError(f"cannot load the checkpoint {path}: {type(first).__name__}: {first}") from None


def model_state(ckpt_dir: Path, key: str = "state_dict") -> dict[str, torch.Tensor]:
    """The whole tensors of `key` (the weights, "state_dict"; an optimizer's state, "optimizer_0") of a DCP
    directory, assembled in this one process from every rank's shards (no process group needed): what evaluate,
    export and generate read. Keys as saved under `key` (`model.layers.0...`)."""
    metadata = read_metadata(ckpt_dir)
    prefix = f"{key}."
    template = {fqn.removeprefix(prefix): torch.empty(md.size, dtype=md.properties.dtype)
                for fqn, md in metadata.state_dict_metadata.items()
                if fqn.startswith(prefix) and isinstance(md, dcp.metadata.TensorStorageMetadata)}
    if not template:
        raise CheckpointError(f"'{ckpt_dir}' holds no '{key}' tensors: not a model checkpoint")
    refuse_code(ckpt_dir)
    state = {key: template}
    with warnings.catch_warnings():  # (DCP says it assumes one process: exactly what no_dist asks for)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, ckpt_dir, no_dist=True)
    return state[key]
