"""The package boundaries the README states, checked statically on every import statement (also those inside
functions, which an import-time check would miss): `data/` never imports `training/`; `model/` imports neither
`data/` nor `training/` nor a training framework; no module cycles; and `training/` is built in layers (LAYERS),
each of which imports only the layers below it."""
from __future__ import annotations

import ast
import re
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


PACKAGES = ("model", "data", "training")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(source: str, package: tuple[str, ...]) -> list[str]:
    """The modules `source` imports when it runs, functions included: `if TYPE_CHECKING:` blocks are left out
    (they never run), and `from pkg import name` names both `pkg.name` and `pkg` (`import_graph` keeps the one
    that is a module). A package's own `__init__`, which Python runs before any of its submodules, is not counted:
    every submodule would otherwise form a cycle with an `__init__` that re-exports it."""
    tree = ast.parse(source)
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and ast.unparse(node.test).endswith("TYPE_CHECKING") for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        found += _named_by_string(node)
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            found += [f"{module}.{alias.name}" for alias in node.names] + [module]
    return found


# "package.module:function": how an entry point or a registry names code it imports when run (`normlab`'s COMMANDS)
_ENTRY = re.compile(r"^((?:model|data|training)(?:\.\w+)+):\w+$")


def _named_by_string(node: ast.AST) -> list[str]:
    """Modules imported by name at run time: `importlib.import_module("x.y")` with a literal name, and a literal
    "x.y:function" (imported when it is run). Hiding an import in a string does not hide it from the checks."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module") \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return [node.args[0].value]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and (match := _ENTRY.match(node.value)):
        return [match.group(1)]
    return []


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    modules = {module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        imported = {m for m in runtime_imports(path.read_text(), path.relative_to(REPO).parts[:-1]) if m in modules}
        # `from pkg import sub`: an edge to the submodule only, not also to `pkg` (see runtime_imports)
        graph[name] = {m for m in imported if not any(n.startswith(m + ".") for n in imported)} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """No two of normlab's modules import each other, directly or through others — lazy imports inside functions
    included: under `python -m training.cli` a cycle through the entry module loads it twice (`__main__` and
    `training.cli`), and a cycle fixes an import order that a later top-level import can break."""
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_lazy_cycle():
    graph = import_graph()
    source = "def run():\n    from training.lightning_cli import NormlabCLI\n"
    assert "training.lightning_cli" in runtime_imports(source, ("training",))
    graph["training.subcommands"] = graph["training.subcommands"] | {"training.lightning_cli"}
    assert any({"training.subcommands", "training.lightning_cli"} <= set(c) for c in cycles(graph))
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model.config import ModelConfig\n"
    assert "model.config" not in runtime_imports(typed, ("model",))


# The layers, from the ground up: a module may import its own part of the tree (a package imports itself freely)
# and any part of a lower layer; parts of one layer never import each other. A part is a top-level module or a
# sub-package of `training/`, or `model` / `data` as a whole.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("model", "data"),
    ("training.errors", "training.stats", "training.plotting", "training.subcommands", "training.health_tags"),
    ("training.safe_yaml",),  # the one YAML reader, of every layer above
    ("training.run", "training.optim", "training.compat", "training.distributed", "training.cli_checks"),
    ("training.cluster", "training.precision", "training.loggers"),  # run-time services of a fit
    ("training.console", "training.checkpointing", "training.study", "training.coordcheck"),
    ("training.strategy", "training.fsdp2", "training.eval", "training.export", "training.generate"),
    ("training.callbacks", "training.lit_module"),  # the loop's parts
    ("training.lightning_cli",),  # the loop, wired
    ("training.sweep",),  # the applications on top of the trainer
    ("training.compare",),
    ("training.cli",),  # the entry layer: `normlab <command>`
)


def part(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "training" else parts[0]


def layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not run down the layers: `a -> b` where b's layer is not below a's."""
    layers = layer_of()
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if part(a) != part(b) and part(b) != "training" and layers[part(b)] >= layers[part(a)])


def test_every_part_of_the_tree_has_a_layer():
    assert sorted({part(m) for m in import_graph()} - set(layer_of()) - {"training"}) == []


def test_no_import_runs_against_the_layers():
    assert backward_imports(import_graph()) == []


def test_the_layer_check_sees_a_backward_import_and_one_named_by_string():
    graph = import_graph()
    graph["training.run.dir"] = graph["training.run.dir"] | {"training.sweep.state"}
    assert backward_imports(graph) == ["training.run.dir -> training.sweep.state"]
    source = ('import importlib\ndef f():\n    importlib.import_module("training.sweep.runner")\n'
              'LAUNCH = "training.sweep.slurm:submit"\n')
    assert {"training.sweep.runner", "training.sweep.slurm"} <= set(runtime_imports(source, ("training",)))


def test_every_package_has_an_init():
    """setuptools' find_packages ships only directories with an `__init__.py`: one without would import here (a
    namespace package) and be missing from a wheel."""
    assert [str(d.relative_to(REPO)) for package in PACKAGES for d in sorted((REPO / package).rglob("*"))
            if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").is_file()] == []
