"""The package boundaries the README states, checked statically on every import statement (also those inside
functions, which an import-time check would miss): `data/` never imports `training/`; `model/` imports neither
`data/` nor `training/` nor a training framework."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "data": ("training",),
    "model": ("data", "training", "lightning", "pytorch_lightning", "deepspeed"),
}


def imported_modules(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, a module of `package` (relative imports resolved)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            found.append((node.lineno, ".".join(filter(None, [base, node.module or ""]))))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_across_its_boundary(package):
    offenders = [f"{path.relative_to(REPO)}:{line}: {name}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for line, name in imported_modules(path.read_text(), path.relative_to(REPO).parts[:-1])
                 if name.split(".")[0] in FORBIDDEN[package]]
    assert not offenders, offenders


def test_the_check_sees_imports_inside_functions():
    source = "import os\ndef f():\n    from ..training import checkpoint\n    import training.cli\n"
    assert [name for _, name in imported_modules(source, ("data",))] == ["os", "training", "training.cli"]
