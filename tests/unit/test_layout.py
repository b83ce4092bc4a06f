"""The shape of ``mme_runtime``, read from the code itself: six layers that import only downwards,
no import cycle, small modules, and subpackage docstrings that name every module and the layers
they may import."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mme_runtime"
# Bottom to top. Hugging Face support plugs into the request path; the handler MMS names (and its
# defaults) sits between them and the process tree.
LAYERS = ("base", "operations", "models", "serving", "huggingface", "handler", "processes")
HANDLER_MODULES = ("handler_service", "inference_handler")
MAX_MODULE_LINES = 500  # one job a module: sized by what it holds (issue #34), never split for a count


def _modules() -> dict[str, Path]:
    """Every module, by dotted name: ``mme_runtime``'s and the handler's."""
    found = {".".join(path.relative_to(REPO).with_suffix("").parts): path for path in PACKAGE.rglob("*.py")}
    found.update({name: REPO / f"{name}.py" for name in HANDLER_MODULES})
    return found


def _layer(module: str) -> str | None:
    if module in HANDLER_MODULES:
        return "handler"
    parts = module.split(".")
    return parts[1] if parts[0] == "mme_runtime" and len(parts) > 1 and parts[1] in LAYERS else None


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, at the top or inside a function (a lazy import is an import too)."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}  # ``from package import module``
    return {name for name in imported if name in known and not name.endswith("__init__")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules) | {name.removesuffix(".__init__") for name in modules}
    return {
        name.removesuffix(".__init__"): _imports(path, known) - {name.removesuffix(".__init__")}
        for name, path in modules.items()
    }


def test_every_module_lives_in_a_layer() -> None:
    loose = [name for name in _graph() if name != "mme_runtime" and _layer(name) is None]
    assert loose == [], "put each module in a subpackage of mme_runtime (see mme_runtime/__init__.py)"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    def rank(module: str) -> int:
        layer = _layer(module)
        return -1 if layer is None else LAYERS.index(layer)

    return [
        f"{importer} ({_layer(importer)}) imports {imported} ({_layer(imported)})"
        for importer, imports in graph.items()
        for imported in imports
        if rank(importer) >= 0 and rank(imported) > rank(importer)
    ]


def test_no_import_runs_up_a_layer() -> None:
    assert _upward(_graph()) == []


def test_the_layering_check_catches_a_lazy_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from mme_runtime.processes import warm_start\n")
    imports = _imports(probe, {"mme_runtime.processes", "mme_runtime.processes.warm_start"})
    assert sorted(_upward({"mme_runtime.base.probe": imports})) == [
        "mme_runtime.base.probe (base) imports mme_runtime.processes (processes)",
        "mme_runtime.base.probe (base) imports mme_runtime.processes.warm_start (processes)",
    ]


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(imported) :], imported]))
            if imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_module_is_over_500_lines() -> None:
    long = {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, "split these by what they do"


@pytest.mark.parametrize("layer", [layer for layer in LAYERS if layer != "handler"])
def test_each_subpackage_names_its_modules_and_what_it_may_import(layer: str) -> None:
    docstring = importlib.import_module(f"mme_runtime.{layer}").__doc__ or ""
    named = set(re.findall(r"``(\w+)``", docstring))
    modules = {path.stem for path in (PACKAGE / layer).glob("*.py")} - {"__init__"}
    assert modules <= named, f"mme_runtime/{layer}/__init__.py does not name {sorted(modules - named)}"
    below = [other for other in LAYERS[: LAYERS.index(layer)] if other != "handler"]
    if below:
        declared = re.search(r"It may import: (.*?)\.\s*$", docstring, re.S)
        assert declared is not None, f"say which layers mme_runtime/{layer} may import"
        assert re.findall(r"``(\w+)``", declared.group(1)) == below
    else:
        assert "imports no other layer" in docstring
