"""Every file a reader trusts is hashed: on a DeepSpeed resume each rank verifies the files it reads (and the ranks
agree on the outcome; on an FSDP2 resume each its share of the files), and the universal-format cache, written
after the step's manifest, has a manifest of its own that every rank checks before the universal loader reads it
(training/checkpointing/resume.py, universal.py).

Real 2-rank ZeRO-2/ZeRO-3 and FSDP2 checkpoints: the session's reference runs (tests/helpers/zero_runs.py), copied.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_normlab
from tests.test_safe_loading import flip_tensor_byte
from training.checkpointing.resume import rank_files
from training.checkpointing.universal import CACHE_MANIFEST, LATEST, UNIVERSAL_TAG, to_universal, verify_cache
from training.errors import CheckpointError
from training.run.manifest import Manifest, verify_files

pytestmark = pytest.mark.slow  # the reference runs (shared with the other DeepSpeed tests), and two fits

STEP = 8  # the reference runs' last checkpoint
TIMEOUT = 900


def copy_step(run: Path, tmp_path: Path) -> Path:
    src = run / "checkpoints" / f"step-{STEP:08d}"
    return Path(shutil.copytree(src, tmp_path / src.name))


def fit(workdir: Path, name: str, ckpt: Path, devices: int) -> tuple[int, str]:
    proc = run_normlab(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.path",
                        str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", name,
                        "--trainer.max_steps", str(STEP + 2), "--optim.continuation", "hold",
                        "--checkpoint.every_n_steps", "2",
                        "--metrics.every_n_steps", "0", "--trainer.strategy", "zero2", "--trainer.devices",
                        str(devices), "--ckpt_path", str(ckpt)], cwd=workdir, expect_ok=False, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind, own", [("zero2", ("optim",)), ("zero3", ("optim", "model"))])
def test_each_rank_verifies_the_files_it_reads(kind, own, zero2_run, zero3_run, tmp_path):
    """Rank R of the world size that wrote the checkpoint checks every file but the other ranks' ZeRO shards; on
    another world size rank 0 (which converts every shard) checks all and the others no shard. A flipped byte in
    rank 1's shard is found by rank 1's check, not rank 0's."""
    ckpt = copy_step({"zero2": zero2_run, "zero3": zero3_run}[kind], tmp_path)
    manifest = Manifest.read(ckpt)
    assert manifest.world_size == 2
    shards = {r: {f"checkpoint/zero_pp_rank_{r}_mp_rank_00_{what}_states.pt" for what in own} for r in (0, 1)}
    everything = set(manifest.files)
    assert shards[0] | shards[1] <= everything
    for r in (0, 1):
        mine = rank_files(manifest, r, 2)
        assert set(mine.files) == set(mine.sha256) == everything - shards[1 - r], r
    assert rank_files(manifest, 0, 1) == manifest  # world size 1: rank 0 converts, reading every shard
    assert set(rank_files(manifest, 2, 3).files) == everything - shards[0] - shards[1]

    shard = sorted(shards[1])[0]
    flip_tensor_byte(ckpt / shard)
    verify_files(ckpt, rank_files(manifest, 0, 2))  # not rank 0's to read
    with pytest.raises(CheckpointError, match=f"'{shard}' was altered"):
        verify_files(ckpt, rank_files(manifest, 1, 2))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ranks_share_out_the_files_of_a_dcp_checkpoint(world, fsdp2_run, tmp_path):
    """FSDP2's DCP shards are read by whichever rank DCP's plan picks, at any world size: each rank verifies every
    world-th file, the shares are disjoint and cover the checkpoint (the ranks agree on the outcome before the
    load), and a flipped byte is found by the one rank whose share holds it."""
    ckpt = copy_step(fsdp2_run, tmp_path)
    manifest = Manifest.read(ckpt)
    shares = [set(rank_files(manifest, r, world).files) for r in range(world)]
    assert set().union(*shares) == set(manifest.files) and sum(map(len, shares)) == len(manifest.files)
    assert all(set(rank_files(manifest, r, world).sha256) == shares[r] for r in range(world))
    with open(ckpt / "__1_0.distcp", "r+b") as f:
        f.seek(f.seek(0, 2) // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))
    owner = next(r for r in range(world) if "__1_0.distcp" in shares[r])
    for r in range(world):
        if r == owner:
            with pytest.raises(CheckpointError, match="'__1_0.distcp' was altered"):
                verify_files(ckpt, rank_files(manifest, r, world))
        else:
            verify_files(ckpt, rank_files(manifest, r, world))


def test_a_lightning_checkpoint_is_verified_whole_by_every_rank(single_run, tmp_path):
    manifest = Manifest.read(copy_step(single_run, tmp_path))
    assert rank_files(manifest, 1, 2) == manifest


def test_the_universal_cache_has_its_own_manifest(zero2_run, tmp_path):
    """The conversion writes the cache's sizes and sha256 last; an altered, truncated or missing cache file is
    refused in one line naming it; a cache without a manifest is converted again."""
    ckpt = copy_step(zero2_run, tmp_path)
    to_universal(ckpt)
    cache = json.loads((ckpt / CACHE_MANIFEST).read_text())
    on_disk = {str(p.relative_to(ckpt)) for p in (ckpt / UNIVERSAL_TAG).rglob("*") if p.is_file()} | {LATEST}
    assert set(cache["files"]) == set(cache["sha256"]) == on_disk
    for rel, digest in cache["sha256"].items():
        assert digest == hashlib.sha256((ckpt / rel).read_bytes()).hexdigest(), rel
    assert cache["step"] == STEP and "manifest.json" not in cache["files"]
    verify_cache(ckpt)

    target = max((ckpt / UNIVERSAL_TAG).rglob("*.pt"), key=lambda p: p.stat().st_size)
    rel = str(target.relative_to(ckpt))
    flip_tensor_byte(target)
    with pytest.raises(CheckpointError, match=f"'{rel}' was altered") as err:
        verify_cache(ckpt)
    assert "\n" not in str(err.value) and CACHE_MANIFEST in str(err.value)  # one line, with the fix
    to_universal(ckpt)  # a cache with a manifest is kept as it is ...
    with pytest.raises(CheckpointError, match=f"'{rel}'"):
        verify_cache(ckpt)
    (ckpt / CACHE_MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"no readable {CACHE_MANIFEST}"):
        verify_cache(ckpt)
    to_universal(ckpt)  # ... and one without is converted anew
    verify_cache(ckpt)


def test_resumes_refuse_an_altered_cache_and_a_shard_only_one_rank_reads(zero2_run, zero_workdir, tmp_path):
    """End to end: a 1-rank resume through an altered universal cache stops before loading it; a 2-rank resume
    whose rank-1 shard was altered stops on both ranks with rank 1's one-line error (rank 0 does not read that
    shard, and does not wait for rank 1 in the next collective)."""
    ckpt = copy_step(zero2_run, tmp_path / "cache")
    to_universal(ckpt)
    target = max((ckpt / UNIVERSAL_TAG).rglob("*.pt"), key=lambda p: p.stat().st_size)
    flip_tensor_byte(target)
    rc, output = fit(zero_workdir, "altered-cache", ckpt, devices=1)
    assert rc == 2 and f"'{target.relative_to(ckpt)}' was altered" in output, output[-3000:]

    ckpt = copy_step(zero2_run, tmp_path / "shard")
    shard = "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_tensor_byte(ckpt / shard)
    rc, output = fit(zero_workdir, "altered-shard", ckpt, devices=2)
    assert rc == 2 and f"'{shard}' was altered" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
