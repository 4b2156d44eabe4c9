"""No code from a checkpoint runs, and an altered checkpoint is refused by its hash (training/checkpointing/safe.py,
manifest.py).

Real checkpoints of every kind normlab writes — a single-process `model.ckpt` and 2-rank DeepSpeed ZeRO-1/2/3
shards: the session's reference runs (tests/helpers/zero_runs.py, which tests/test_training_deepspeed.py checks),
copied — get a crafted object whose unpickling runs `touch MARKER` (what a malicious checkpoint does with
`os.system`); the manifest's sizes and sha256 are then updated to match, so only the unpickling guard can stop
it. Every command that reads a checkpoint must refuse it with one line, and the marker must never appear. Besides
the 4 shared runs, the module starts 7 normlab processes (4 of them 2-rank), almost all of their time start-up;
the one-process fits, and every other command, run in this process. An FSDP2 checkpoint (DCP) gets its payload as
a record of a `.distcp` file, which its metadata points at; one 2-rank resume of it more.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import REPO, run_normlab

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"
TIMEOUT = 900  # seconds per command: a 2-rank start-up takes minutes on a busy 2-core box
KINDS = {"single": [], "zero1": ["--trainer.strategy", "zero1", "--trainer.devices", "2"],
         "zero2": ["--trainer.strategy", "zero2", "--trainer.devices", "2"],
         "zero3": ["--trainer.strategy", "zero3", "--trainer.devices", "2"]}


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


STEP = 8  # the reference runs' last checkpoint (they save steps 4 and 8)


def fit_args(workdir: Path, name: str, kind: str, *extra: str) -> list[str]:
    """A fit of `kind` that would train past STEP: resumed or branched from a checkpoint, it has steps left."""
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
            str(workdir / "runs"), "--name", name, "--trainer.max_steps", str(STEP + 2), "--checkpoint.every_n_steps",
            "2", "--metrics.every_n_steps", "0", *KINDS[kind], *extra]


def step_dir(run: Path) -> Path:
    return run / "checkpoints" / f"step-{STEP:08d}"


def reseal(ckpt_dir: Path) -> None:
    """Record every file's current size and sha256 in the manifest, as if the checkpoint had been saved so."""
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    manifest["files"] = {rel: (ckpt_dir / rel).stat().st_size for rel in manifest["files"]}
    manifest["sha256"] = {rel: hashlib.sha256((ckpt_dir / rel).read_bytes()).hexdigest() for rel in manifest["files"]}
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def plant(file: Path, marker: Path) -> None:
    """Add the payload to a checkpoint file (normlab's own: it loads weights-only)."""
    import deepspeed  # noqa: F401 (a shard's DeepSpeed types are allowed once DeepSpeed is imported, as it reads them)

    from training.checkpointing.safe import safe_torch_load

    state = safe_torch_load(file)
    state["payload"] = Payload(marker)
    torch.save(state, file)


def payload_files(ckpt_dir: Path) -> list[Path]:
    """Where the payload goes: the files every rank reads (the model states; model.ckpt without DeepSpeed)."""
    return sorted(ckpt_dir.rglob("model.ckpt")) or sorted((ckpt_dir / "checkpoint").glob("*model_states.pt"))


@pytest.fixture(scope="module")
def runs(single_run, zero1_run, zero2_run, zero3_run) -> dict[str, Path]:
    """One clean run of each kind: the session's reference runs (read only: copy before changing anything)."""
    return {"single": single_run, "zero1": zero1_run, "zero2": zero2_run, "zero3": zero3_run}


@pytest.fixture(scope="module")
def crafted(runs, workdir) -> dict[str, tuple[Path, Path]]:
    """{kind: (run directory, marker)}: a copy of each run whose every checkpoint carries the payload, resealed.
    (The copy leaves out an `eval/` that a test of the reference runs may have written: none may appear.)"""
    out = {}
    for kind, run in runs.items():
        copy = Path(shutil.copytree(run, workdir / "crafted" / kind,
                                    ignore=lambda d, names, top=run: ["eval"] if Path(d) == top else []))
        marker = workdir / f"MARKER-{kind}"
        for ckpt in sorted((copy / "checkpoints").glob("step-*")):
            for file in payload_files(ckpt):
                plant(file, marker)
            reseal(ckpt)
        out[kind] = copy, marker
    return out


def assert_refused(output: str, rc: int, marker: Path, file: str) -> None:
    assert not marker.exists(), f"the checkpoint's payload ran:\n{output[-3000:]}"
    assert rc != 0 and "Traceback" not in output, output[-3000:]
    line = next((line for line in output.splitlines() if "refusing to load" in line), None)
    assert line is not None, output[-3000:]
    assert file in line and "posix.system" in line, line


def normlab_inprocess(args: list[str], capsys) -> tuple[int, str]:
    from training.cli import main

    rc = main(args)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def fit_refused(args: list[str], kind: str, workdir: Path, capsys) -> tuple[int, str]:
    """`normlab fit <args>` launched as `kind`: one process runs in this one (as `normlab_inprocess`: the same
    entry point, one process start-up fewer), 2 ranks as their own processes."""
    if kind == "single":
        return normlab_inprocess(args, capsys)
    proc = run_normlab(args, cwd=workdir, expect_ok=False, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", list(KINDS))
def test_plain_commands_refuse_a_crafted_checkpoint(kind, crafted, tmp_path, capsys):
    """evaluate (a step, and a run's history), export and generate: one line naming the file and the type."""
    run, marker = crafted[kind]
    ckpt = str(step_dir(run))
    file = payload_files(step_dir(run))[0].name
    for args in (["evaluate", "--checkpoint", ckpt], ["evaluate", "--checkpoint", str(run)],
                 ["export", "--checkpoint", ckpt, "--output", str(tmp_path / "hf")],
                 ["generate", "--checkpoint", ckpt, "--prompt", "the", "--max_new_tokens", "2"]):
        rc, output = normlab_inprocess(args, capsys)
        assert_refused(output, rc, marker, file)
        assert [line for line in output.splitlines() if "error" in line] == [
            line for line in output.splitlines() if "refusing to load" in line], output  # one error line
    assert not (tmp_path / "hf").exists() and not (run / "eval").exists()  # nothing written


def test_compare_reads_no_pickle(crafted, tmp_path, capsys):
    """`compare` reads TensorBoard events and manifests (JSON), never a pickled file."""
    run, marker = crafted["zero2"]
    rc, output = normlab_inprocess(["compare", str(run), "--metric", "train/loss", "--plot", str(tmp_path / "c.png")],
                                   capsys)
    assert rc == 0 and not marker.exists(), output[-3000:]


@pytest.mark.parametrize("kind", list(KINDS))
def test_fit_resume_refuses_a_crafted_checkpoint(kind, crafted, workdir, capsys):
    run, marker = crafted[kind]
    rc, output = fit_refused(fit_args(workdir, f"resumed-{kind}", kind, "--ckpt_path", str(step_dir(run))), kind,
                             workdir, capsys)
    assert_refused(output, rc, marker, payload_files(step_dir(run))[0].name)
    assert not list((workdir / "runs" / f"resumed-{kind}").glob("checkpoints/step-*"))


@pytest.mark.parametrize("kind", ["single", "zero3"])
def test_fit_branch_from_refuses_a_crafted_checkpoint(kind, crafted, workdir, capsys):
    run, marker = crafted[kind]
    rc, output = fit_refused(fit_args(workdir, f"branch-{kind}", kind, "--branch_from", str(step_dir(run))), kind,
                             workdir, capsys)
    assert_refused(output, rc, marker, payload_files(step_dir(run))[0].name)


@pytest.mark.parametrize("kind", ["single", "zero2"])
def test_fit_init_from_refuses_a_crafted_checkpoint(kind, crafted, workdir, capsys):
    """`fit --init_from` a crafted checkpoint (a Lightning file, DeepSpeed shards): refused, nothing runs."""
    run, marker = crafted[kind]
    rc, output = fit_refused(fit_args(workdir, f"init-{kind}", "single", "--init_from", str(step_dir(run))), "single",
                             workdir, capsys)
    assert_refused(output, rc, marker, payload_files(step_dir(run))[0].name)
    assert not list((workdir / "runs" / f"init-{kind}").glob("checkpoints/step-*"))


@pytest.mark.parametrize("kind, command", [("single", "validate"), ("single", "test"), ("zero2", "validate")])
def test_validate_and_test_refuse_a_crafted_checkpoint(kind, command, crafted, workdir, capsys):
    """Lightning's own `validate` / `test` with `--ckpt_path` a crafted checkpoint: refused in one line, nothing
    runs (the ZeRO-2 one on 1 rank, through DeepSpeed's inference engine, in a process of its own)."""
    run, marker = crafted[kind]
    args = [command, "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
            str(workdir / "runs"), "--name", f"{command}-{kind}", "--ckpt_path", str(step_dir(run))]
    if kind == "single":
        rc, output = normlab_inprocess(args, capsys)
    else:
        proc = run_normlab([*args, "--trainer.strategy", kind, "--trainer.devices", "1"], cwd=workdir,
                           expect_ok=False, timeout=TIMEOUT)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    assert_refused(output, rc, marker, payload_files(step_dir(run))[0].name)


@pytest.fixture(scope="module")
def crafted_dcp(fsdp2_run, workdir) -> tuple[Path, Path, str]:
    """(run directory, marker, file): a copy of the FSDP2 run whose step-8 checkpoint has one non-tensor record (an
    optimizer group's name) replaced by the payload, appended to its `.distcp` file and pointed at by the metadata,
    resealed."""
    from training.checkpointing import dcp

    run = Path(shutil.copytree(fsdp2_run, workdir / "crafted" / "fsdp2",
                               ignore=lambda d, names, top=fsdp2_run: ["eval"] if Path(d) == top else []))
    marker, ckpt = workdir / "MARKER-fsdp2", step_dir(run)
    metadata = dcp.read_metadata(ckpt)
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.fqn.endswith("param_groups.0.name"))
    record = io.BytesIO()
    torch.save(Payload(marker), record)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(record.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(record.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ckpt)
    return run, marker, info.relative_path


def test_every_command_refuses_a_crafted_fsdp2_checkpoint(crafted_dcp, workdir, tmp_path, capsys):
    """evaluate, export and generate (in this process), and a 2-rank FSDP2 resume: one line naming the `.distcp`
    file and the type; nothing runs, nothing is written."""
    run, marker, file = crafted_dcp
    ckpt = str(step_dir(run))
    for args in (["evaluate", "--checkpoint", ckpt], ["export", "--checkpoint", ckpt, "--output", str(tmp_path / "hf")],
                 ["generate", "--checkpoint", ckpt, "--prompt", "the", "--max_new_tokens", "2"]):
        rc, output = normlab_inprocess(args, capsys)
        assert_refused(output, rc, marker, file)
    proc = run_normlab(fit_args(workdir, "resumed-fsdp2", "single", "--trainer.strategy", "fsdp2",
                                "--trainer.devices", "2", "--ckpt_path", ckpt), cwd=workdir, expect_ok=False,
                       timeout=TIMEOUT)
    assert_refused(proc.stdout + proc.stderr, proc.returncode, marker, file)
    assert not (tmp_path / "hf").exists() and not list((workdir / "runs" / "resumed-fsdp2").glob("checkpoints/step-*"))


def test_universal_conversion_and_cache_refuse_code(runs, crafted, workdir, tmp_path):
    """Resuming a 2-rank ZeRO-2 checkpoint on 1 rank goes through DeepSpeed's universal format: a crafted shard
    is refused by the conversion, and a crafted universal cache (written by an earlier conversion) by the
    resume's scan, which runs before the cache's hashes are checked."""
    run, marker = crafted["zero2"]
    proc = run_normlab(fit_args(workdir, "universal-shard", "zero2", "--ckpt_path", str(step_dir(run)),
                                "--trainer.devices", "1"), cwd=workdir, expect_ok=False,
                       timeout=TIMEOUT)
    assert_refused(proc.stdout + proc.stderr, proc.returncode, marker, "mp_rank_00_model_states.pt")

    from training.checkpointing.safe import UnsafeCheckpointError
    from training.checkpointing.universal import UNIVERSAL_TAG, to_universal

    # the conversion itself (a subprocess running DeepSpeed's converter), behind the resume's own scan
    with pytest.raises(UnsafeCheckpointError, match=r"mp_rank_00_model_states\.pt.*posix\.system"):
        to_universal(step_dir(run))
    assert not marker.exists() and not list(step_dir(run).glob(f"*{UNIVERSAL_TAG}*"))  # nothing written

    clean = Path(shutil.copytree(step_dir(runs["zero2"]), tmp_path / step_dir(runs["zero2"]).name))
    to_universal(clean)  # the real cache, converted from clean shards
    marker = workdir / "MARKER-universal"
    plant(clean / UNIVERSAL_TAG / "zero" / "optimizer_state.pt", marker)
    proc = run_normlab(fit_args(workdir, "universal-cache", "zero2", "--ckpt_path", str(clean),
                                "--trainer.devices", "1"), cwd=workdir, expect_ok=False,
                       timeout=TIMEOUT)
    assert_refused(proc.stdout + proc.stderr, proc.returncode, marker, "optimizer_state.pt")


def test_deepspeeds_own_readers_are_weights_only(crafted):
    """DeepSpeed's checkpoint engine and zero_to_fp32 ask torch.load for weights_only=False; inside the guard
    (entered around every DeepSpeed read) they refuse the payload."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from training.checkpointing.safe import UnsafeCheckpointError, no_code_from_checkpoints

    run, marker = crafted["zero3"]
    shard = payload_files(step_dir(run))[0]
    with no_code_from_checkpoints(), pytest.raises(UnsafeCheckpointError, match=rf"{shard.name}.*posix\.system"):
        TorchCheckpointEngine().load(str(shard))
    with no_code_from_checkpoints(), pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        get_fp32_state_dict_from_zero_checkpoint(str(step_dir(run)))
    assert torch.load is not None and not getattr(torch.load, "_normlab_weights_only", False)  # scoped
    assert not marker.exists()


def test_allow_list_is_exactly_what_real_checkpoints_need(runs, tmp_path):
    """Every type in the allow-list is stored by a real checkpoint (ZeRO-1/2/3 shards, model.ckpt, the universal
    cache), and every file of them loads weights-only with it."""
    import deepspeed  # noqa: F401 (as when DeepSpeed reads its shards)

    from training.checkpointing.safe import _allowed, safe_torch_load
    from training.checkpointing.universal import to_universal

    universal = Path(shutil.copytree(step_dir(runs["zero1"]), tmp_path / step_dir(runs["zero1"]).name))
    to_universal(universal)
    files = [p for run in runs.values() for p in step_dir(run).rglob("*") if p.suffix in (".pt", ".ckpt")]
    files += list(universal.rglob("checkpoint_universal/**/*.pt"))
    needed = {name for f in files for name in torch.serialization.get_unsafe_globals_in_checkpoint(f)}
    assert needed == {f"{t.__module__}.{t.__qualname__}" for t in _allowed()}
    for f in files:
        safe_torch_load(f)


def flip_tensor_byte(file: Path) -> None:
    """Flip one bit in the middle of the largest tensor storage of a torch zip file (its size stays)."""
    with zipfile.ZipFile(file) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(file, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("kind, shard", [("single", "model.ckpt"),
                                         ("zero2", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt")])
def test_a_flipped_byte_is_refused_by_its_hash(kind, shard, runs, tmp_path, capsys):
    copy = Path(shutil.copytree(step_dir(runs[kind]), tmp_path / step_dir(runs[kind]).name))
    flip_tensor_byte(copy / shard)
    from training.checkpointing.safe import safe_torch_load

    safe_torch_load(copy / shard)  # still a readable checkpoint file: only the hash tells
    rc, output = normlab_inprocess(["evaluate", "--checkpoint", str(copy)], capsys)
    assert rc == 2 and f"'{shard}' was altered after it was saved" in output, output[-3000:]
    from training.checkpointing.branch import resolve_parent
    from training.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"'{shard}' was altered"):
        resolve_parent(str(copy))  # --branch_from (and --ckpt_path, through the same verify_files)


def test_manifest_records_every_files_sha256(runs):
    """The digests taken at save time (by each writing rank) equal hashlib's over the files on disk."""
    for run in runs.values():
        ckpt = step_dir(run)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}
        assert set(manifest["sha256"]) == set(manifest["files"]) == files
        for rel, digest in manifest["sha256"].items():
            assert digest == hashlib.sha256((ckpt / rel).read_bytes()).hexdigest(), rel
