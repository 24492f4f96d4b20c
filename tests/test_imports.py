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


# Which packages each package may import (besides itself): loader -> runtime/accel/remote/shared ->
# scheduling/ops/policy, never back. The loader drives the runtime, the GPU wing and the remote
# workers; the shared loader drives a loader object it is given, without importing the loader
# package; all of them build on the runtime, which builds on the pure layers. `fusionflow` (the public
# API), `__main__` and `tools` stand above everything.
BASE = {"errors", "native"}
MAY_IMPORT = {
    "timm": {"loader", "policy", "datasets"} | BASE,  # timm's create_loader over the loader
    "loader": {"accel", "remote", "shared", "cache", "runtime", "scheduling", "ops", "policy", "datasets"} | BASE,
    "shared": {"runtime", "scheduling", "ops", "policy", "datasets"} | BASE,
    "cache": {"runtime", "ops", "policy", "datasets"} | BASE,  # the decoded-image cache: its store, keeper, reader
    "accel": {"runtime", "scheduling", "ops", "policy", "datasets"} | BASE,
    "remote": {"runtime", "scheduling", "ops", "policy", "datasets"} | BASE,
    "runtime": {"scheduling", "ops", "policy", "datasets"} | BASE,
    "ops": {"policy"} | BASE,
    "scheduling": BASE,
    "policy": {"errors", "native"},  # native: the draw's Philox kernel (policy/philox.py)
    "datasets": {"errors"},
    "native": {"errors"},
    "errors": set(),
}
TOP = {"", "__main__", "tools"}  # the public API, the command line and the tools may import anything


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_downwards():
    """loader -> runtime/accel/remote/shared -> scheduling/ops/policy, never back (docs/architecture.md)."""
    wrong = []
    for module, deps in sorted(import_graph().items()):
        mine = _package(module)
        if mine in TOP:
            continue
        assert mine in MAY_IMPORT, f"{module}: a new package; say in MAY_IMPORT what it may import"
        for dep in sorted(deps):
            theirs = _package(dep)
            if theirs not in (mine, "") and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module} imports {dep}")
            if theirs == "" and dep != "fusionflow":
                wrong.append(f"{module} imports {dep}")
    # `from fusionflow import X` reaches the public API (the loader, the shared loader, ...): below the
    # top, only the root's own light modules may be taken that way
    for module, names in sorted(_root_imports().items()):
        if _package(module) not in TOP:
            wrong += [f"{module} imports fusionflow.{n}" for n in names if n not in BASE]
    assert not wrong, "imports against the package direction:\n" + "\n".join(wrong)


def _root_imports() -> dict[str, set[str]]:
    """module -> the names it imports from the package root (`from fusionflow import X`)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        names = {
            alias.name
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module == "fusionflow" and not node.level
            for alias in node.names
        }
        if names:
            out[_module_name(path)] = names
    return out


def test_the_package_top_level_holds_few_modules():
    """The public API, the command line, the errors and the native build helper; the rest lives in a
    package that says what it is."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top


def test_nothing_outside_tests_imports_from_tests():
    root = PACKAGE.parent
    offenders = []
    for path in [*PACKAGE.rglob("*.py"), *(root / "experiments").rglob("*.py"), *(root / "examples").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "tests" or n.startswith("tests.") or n in TEST_MODULES for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rstrip("/") == "tests":
                offenders.append(f"{path.relative_to(root)}:{node.lineno} (a path into tests/)")
    assert not offenders, offenders


TEST_MODULES = {p.stem for p in (PACKAGE.parent / "tests").glob("*.py")}
