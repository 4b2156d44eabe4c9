"""training/compat.py: every catalogued private API still exists in the installed libraries, the tested ranges are
the ones pyproject.toml pins, another version is refused loudly, a patch is undone when its block ends, and no
private touch of another package (nor unittest.mock) is in normlab's code outside the catalogue."""
from __future__ import annotations

import ast
import importlib
import inspect
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


def test_a_patched_attribute_is_restored_even_on_error():
    owner = SimpleNamespace(own=1)
    with compat.patched(owner, "own", 2), compat.patched(owner, "new", 3):
        assert (owner.own, owner.new) == (2, 3)
    assert owner.own == 1 and not hasattr(owner, "new")
    with pytest.raises(KeyError), compat.patched(owner, "own", 2):
        raise KeyError
    assert owner.own == 1


# -- no private touch outside the catalogue ----------------------------------------------------------------------
LIBRARIES = ("lightning", "pytorch_lightning", "deepspeed", "torch", "datasets", "transformers", "lm_eval",
             "tokenizers", "sentencepiece", "safetensors")
SOURCES = ("training", "model", "data")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_by_normlab(trees: list[ast.Module]) -> set[str]:
    """The private names normlab gives a meaning itself: functions, classes and module or class-level names,
    `self._x` / `cls._x`, and attributes set on its own functions."""
    names = set()
    for tree in trees:
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and (
                            n.value.id in ("self", "cls") or n.value.id in functions):
                        names.add(n.attr)
    return {n for n in names if _private(n)}


def private_touches() -> dict[str, list[str]]:
    """{private name of another package: [file:line]} — read, written or called as `x._name` (a name normlab never
    defines itself), or imported `from <library> import _name`."""
    files = [p for folder in SOURCES for p in sorted((REPO / folder).rglob("*.py"))]
    trees = [ast.parse(p.read_text()) for p in files]
    own = _defined_by_normlab(trees)
    found: dict[str, list[str]] = {}
    for path, tree in zip(files, trees, strict=True):
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
                names = [a.name for a in node.names if _private(a.name)]
            for name in names:
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def private_overrides() -> dict[str, list[str]]:
    """{private method of a library class: [normlab class overriding it]} (abstract methods, which a library
    asks its subclasses to write, aside)."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "training").rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(
            ".__init__"))
        for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]:
            for name in [n for n in vars(cls) if _private(n) and n != "_abc_impl"]:
                bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in LIBRARIES and name in vars(b)]
                if bases and not getattr(vars(bases[0])[name], "__isabstractmethod__", False):
                    found.setdefault(name, []).append(f"{cls.__module__}.{cls.__qualname__}")
    return found


def _catalogued() -> set[str]:
    return {part for target in compat.PATCHES for part in target.partition(":")[2].split(".") if _private(part)}


def test_every_private_touch_is_in_the_catalogue():
    missing = {name: where for name, where in {**private_touches(), **private_overrides()}.items()
               if name not in _catalogued()}
    assert not missing, f"private APIs used outside training/compat.py's PATCHES (add each there): {missing}"


def test_the_scan_sees_a_private_touch(tmp_path):
    assert {"_restore_zero_state", "_copy_recovery_script", "_parser"} <= set(private_touches())
    assert {"_setup_model_and_optimizer", "_get_train_description"} <= set(private_overrides())
    tree = ast.parse("def f(engine):\n    engine._new_private_api()\n")
    assert "_new_private_api" not in _defined_by_normlab([tree])


def test_the_docs_list_every_entry():
    text = (REPO / "docs" / "compat.md").read_text()
    assert [t for t in compat.PATCHES if f"`{t}`" not in text] == []


def test_no_production_module_uses_unittest_mock():
    """Patches are catalogued and made with `compat.patched`; `unittest.mock` is for tests."""
    users = [str(p.relative_to(REPO)) for folder in SOURCES for p in sorted((REPO / folder).rglob("*.py"))
             if any(name.split(".")[0] == "unittest" for name in _imports(p))]
    assert users == []


def _imports(path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
