"""training/compat.py: every patched private API still exists in the installed libraries, the tested ranges are
the ones pyproject.toml pins, another version is refused loudly, and a patch is undone when its block ends."""
from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from tests.helpers.multiproc import REPO
from training import compat

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


@pytest.mark.parametrize("target", sorted(compat.PATCHES))
def test_every_patched_api_exists_in_the_installed_version(target):
    compat.require(target)  # the installed versions are in the tested range
    assert compat.exists(target), f"{target} is gone: re-read the patch in training/compat.py"


def test_a_missing_attribute_is_noticed():
    assert not compat.exists("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._no_such_method")


def test_pyproject_pins_the_tested_ranges():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.match(r"[a-z]+", d).group(): d for d in deps}
    assert pins["lightning"] == f"lightning{compat.LIGHTNING}"
    assert pins["deepspeed"] == f"deepspeed{compat.DEEPSPEED}"


def test_another_version_is_refused_naming_the_patch_and_the_fix(monkeypatch):
    target = "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.max_steps"
    monkeypatch.setattr(compat, "_installed", lambda package: "2.7.0")
    with pytest.raises(compat.CompatError, match=r"_TrainingEpochLoop\.max_steps .*lightning>=2\.6,<2\.7.*lightning "
                                                 r"2\.7\.0 is installed: pip install 'lightning>=2\.6,<2\.7'"):
        compat.require(target)
    monkeypatch.setattr(compat, "_installed", lambda package: "2.6.9")
    compat.require(target)


def test_checkpoint_write_patch_is_undone():
    written = []
    io = SimpleNamespace(save_checkpoint=lambda checkpoint, path: written.append(("io", path)))
    original = io.save_checkpoint

    def hold(write):
        return lambda *args: written.append(("held", args[1])) or write(*args)

    with compat.hold_checkpoint_writes(SimpleNamespace(checkpoint_io=io), False, hold):
        io.save_checkpoint({}, "a")
    io.save_checkpoint({}, "b")
    assert written == [("held", "a"), ("io", "a"), ("io", "b")] and io.save_checkpoint is original
