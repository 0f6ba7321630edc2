"""Imports inside torchtrace/ go one way: no module imports, directly or through others, one that imports it.

Every ``import torchtrace...`` / ``from torchtrace... import`` counts, at module level or inside a function (an
import moved into a function still closes the loop when it runs), and so does ``importlib.import_module`` with a
literal name (how optional parts are loaded); only imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchtrace"


def _module_name(path: Path) -> str:
    return "torchtrace" if path.name == "__init__.py" else f"torchtrace.{path.stem}"


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
    """Module -> the torchtrace modules it imports, for every ``torchtrace/*.py``; a compiled module
    (``torchtrace/*.c``) imports none."""
    paths = {_module_name(path): path for path in sorted(PACKAGE.glob("*.py"))}
    compiled = {f"torchtrace.{path.stem}" for path in PACKAGE.glob("*.c")}
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
    assert "torchtrace._signals" in graph["torchtrace._handle"]  # from torchtrace import _signals
    assert "torchtrace._exporters" in graph["torchtrace._handle"]  # inside a function


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
