"""The package's modules import each other without a cycle.

Read from the source (ast), so imports inside functions count too: a cycle hidden in a function-local
import still ties two layers together, and only works as long as nobody moves the import to the top.
Imports under ``if TYPE_CHECKING:`` are not run, so they do not count.
"""

import ast
from pathlib import Path

import fusionflow

PACKAGE = Path(fusionflow.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, me: str, is_package: bool, modules: set[str]):
    """The package modules `tree` imports (explicitly: a submodule's parent packages are not counted)."""

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (m for child in node.orelse for m in visit(child))
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = me.split(".") if is_package else me.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    yield sub
                elif source in modules:
                    yield source
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(tree)


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set(_imports(tree, name, path.name == "__init__.py", modules)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search with three colours)."""
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle


def test_graph_sees_function_local_imports():
    graph = import_graph()
    assert "fusionflow.runtime.gm.tables" in graph["fusionflow.runtime.gm.manager"]
    assert "fusionflow.loader" in graph["fusionflow"]  # the lazy FusionFlowLoader inside __getattr__


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
