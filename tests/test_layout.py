"""Imports inside torchtrace/ go one way: no module imports, directly or through others, one that imports it; and the
layer folders import only the layers below them on the data path (``LAYERS``).

Every ``import torchtrace...`` / ``from torchtrace... import`` counts, at module level or inside a function (an
import moved into a function still closes the loop when it runs), and so does ``importlib.import_module`` with a
literal name (how optional parts are loaded); only imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchtrace"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (``from torchtrace import _x`` names the module ``_x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def owner(dotted: str) -> str | None:
        while dotted not in modules and "." in dotted:
            dotted = dotted.rpartition(".")[0]
        return dotted if dotted in modules else None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            module = owner(target)
            if module is not None:
                found.add(module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the torchtrace modules it imports, for every ``torchtrace/**/*.py``; a compiled module
    (``torchtrace/**/*.c``) imports none."""
    paths = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    compiled = {_module_name(path) for path in PACKAGE.rglob("*.c")}
    graph = {name: _imported(path, set(paths) | compiled) for name, path in paths.items()}
    graph.update((name, set()) for name in compiled)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a loop (strongly connected, Tarjan), sorted; a module that
    imports itself is a group of one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                connect(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.add(other)
                if other == module:
                    break
            if len(group) > 1 or module in graph[module]:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return sorted(sorted(group) for group in groups)


def loop(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest path through ``group`` from its first module back to it."""
    start = group[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for other in sorted(graph[module] & set(group)):
                if other == start:
                    return [*paths[module], start]
                if other not in paths:
                    paths[other] = [*paths[module], other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"{sorted(group)} holds no loop")  # pragma: no cover - Tarjan's groups always do


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "torchtrace._handle" in graph["torchtrace"]  # from torchtrace._handle import ...
    assert "torchtrace._core.signals" in graph["torchtrace._handle"]  # from torchtrace import _signals
    assert "torchtrace._otlp.exporters" in graph["torchtrace._handle"]  # inside a function


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["d"]]
    assert loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles inside torchtrace/: " + "; ".join(
        f"{', '.join(group)} (e.g. {' -> '.join(loop(graph, group))})" for group in cycles
    )


# The data path in folders: each layer imports only itself and the layers named here (below it on the path). The
# package's root modules (``instrument()``'s handle, the command line) wire the layers together and may import any;
# ``BASE`` modules (names, version, the compiled helpers) are importable from every layer.
LAYERS: dict[str, set[str]] = {
    "_core": set(),  # options and the types every layer shares
    "_capture": {"_core"},  # inside the model's forward and backward
    "_pipeline": {"_core", "_capture"},  # raw forwards and steps resolved into calls, handed to sinks
    "_sinks": {"_core"},  # records, summary, metrics, SDK spans: they read calls, never the capture
    "_otlp": {"_core"},  # encoders and senders: the same
    "_offline": {"_core", "_sinks"},  # trace files read back; the summary table is the sinks' own
}
BASE = {"torchtrace.attributes", "torchtrace.version", "torchtrace._native"}


def _layer(module: str) -> str | None:
    """The layer folder of ``module``, or None for the package's root modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        layer = _layer(module)
        if layer is None:
            continue
        allowed = LAYERS[layer] | {layer}
        for other in sorted(imported - BASE):
            other_layer = _layer(other)
            if other_layer not in allowed:
                found.append(f"{module} -> {other} ({layer} may import {', '.join(sorted(allowed))})")
    return found


def test_every_module_of_the_package_sits_in_a_layer_or_wires_them() -> None:
    roots = {module for module in import_graph() if _layer(module) is None and module.count(".") <= 1}
    wiring = {"torchtrace", "torchtrace.__main__", "torchtrace._handle", "torchtrace._fork", "torchtrace._demo"}
    public = {"torchtrace.cli", "torchtrace.instrumentation", "torchtrace.testing", "torchtrace._run"}
    assert roots == wiring | public | BASE


def test_layer_violations_are_found() -> None:
    graph = {"torchtrace._sinks.a": {"torchtrace._capture.b", "torchtrace.attributes"}, "torchtrace._capture.b": set()}
    assert layer_violations(graph) == ["torchtrace._sinks.a -> torchtrace._capture.b (_sinks may import _core, _sinks)"]


def test_layers_import_only_the_layers_below_them() -> None:
    violations = layer_violations(import_graph())
    assert not violations, "imports against the data path:\n" + "\n".join(violations)


def _private_names_imported(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each ``from torchtrace.x.y import _name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtrace."):
            found += [
                (node.module, alias.name)
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.endswith("__")
            ]
    return found


def test_no_private_name_is_imported_across_a_folder() -> None:
    """A name with a leading underscore is its folder's business: another folder, the root included, imports only
    public names (a module itself, ``from torchtrace._core import signals``, is a public name of its folder)."""
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        folder = importer.rpartition(".")[0] if path.name != "__init__.py" else importer
        for module, name in _private_names_imported(path):
            if module.rpartition(".")[0] != folder and f"{module}.{name}" not in BASE:
                crossing.append(f"{importer}: from {module} import {name}")
    assert not crossing, "\n".join(crossing)
