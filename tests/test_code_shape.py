"""The package's shape, checked from the source (ast): no file over 400 lines, no function body over
60 lines, except the allowlist below, each entry with its reason. docs/architecture.md's "Code shape"
section repeats the allowlist, and an entry that no longer exceeds its limit must leave the list (so
it only shrinks)."""

import ast
import inspect
from pathlib import Path

import fusionflow

PACKAGE = Path(fusionflow.__file__).resolve().parent
ROOT = PACKAGE.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# "path" for a file, "path::Qualified.name" for a function; path relative to the repository root
ALLOWED: dict[str, str] = {}


def _body_lines(fn) -> int:
    """A function's length: its body's lines, from the first statement after the docstring to its
    end. The signature is not counted (the formatter puts one parameter a line once they do not fit
    on one: a DataLoader-compatible signature is long by necessity, not by logic), nor the docstring."""
    body = fn.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1


def _functions(node, prefix=""):
    """(qualified name, body lines) of every function and method, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, _body_lines(child)
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def oversized() -> dict[str, str]:
    """Every file and function over its limit: name -> what it measures."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found[rel] = f"{lines} lines (limit {MAX_FILE_LINES})"
        for name, n in _functions(ast.parse(text, rel)):
            if n > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = f"{n} lines (limit {MAX_FUNCTION_LINES})"
    return found


def test_no_file_or_function_over_its_limit_outside_the_allowlist():
    over = oversized()
    unlisted = {name: size for name, size in over.items() if name not in ALLOWED}
    assert not unlisted, (
        f"split these, or add them to ALLOWED with a reason (and to docs/architecture.md's Code shape "
        f"section): {unlisted}"
    )


def test_the_allowlist_only_holds_what_still_needs_it():
    stale = sorted(set(ALLOWED) - set(oversized()))
    assert not stale, (
        f"within the limits now: remove from ALLOWED and docs/architecture.md's Code shape section: {stale}"
    )


def test_every_allowlist_entry_has_a_reason_and_is_in_the_architecture_note():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Code shape") :]
    section = section[: section.find("\n## ")] if "\n## " in section else section
    for name, reason in ALLOWED.items():
        assert reason.strip(), name
        assert name in section and reason in section, (
            f"docs/architecture.md's code shape section must list {name!r} ({reason})"
        )


def test_the_measure_counts_nested_and_qualified_functions():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert dict(_functions(tree)) == {"A.f": 3, "A.f.g": 1}
    signature_and_docstring = ast.parse(
        'def f(\n    a,\n    b,\n):\n    """Doc.\n\n    More."""\n    x = a\n    return x\n'
    )
    assert dict(_functions(signature_and_docstring)) == {"f": 2}


def test_the_loader_is_composed_not_mixed_in():
    """FusionFlowLoader holds its parts (fusionflow/loader/front.py's docstring names them); no base class
    spreads its state over other files."""
    from fusionflow.loader import FusionFlowLoader

    assert FusionFlowLoader.__bases__ == (object,)


def _protocol_members(proto) -> dict:
    """A Protocol's own methods: name -> signature."""
    return {
        name: inspect.signature(value)
        for name, value in vars(proto).items()
        if callable(value) and not name.startswith("_")
    }


def test_every_worker_kind_satisfies_the_board_s_worker_kind_protocol():
    """runtime/board.py writes the contract down as a Protocol; each kind's class has every member,
    callable with the protocol's arguments, by position and by name (checked on the classes: a kind
    is not constructed here)."""
    from fusionflow.accel.accelerator import AcceleratorWorker
    from fusionflow.remote.kind import RemoteWorkers
    from fusionflow.runtime import board
    from fusionflow.runtime.worker_pool import WorkerPool

    proto = board.WorkerKind
    assert getattr(proto, "_is_protocol", False) and getattr(proto, "_is_runtime_protocol", False)
    assert proto.__module__ == board.__name__
    members = _protocol_members(proto)
    assert set(members) == {"start", "stop", "busy_with_stale"}
    for cls in (WorkerPool, AcceleratorWorker, RemoteWorkers):
        assert issubclass(cls, proto), cls
        for name, want in members.items():
            impl = getattr(cls, name, None)
            assert callable(impl), f"{cls.__name__}.{name} is missing"
            have = inspect.signature(impl)
            params = list(want.parameters.values())
            have.bind(*[object()] * len(params))  # raises TypeError when incompatible
            have.bind(object(), **{p.name: object() for p in params[1:]})
            assert have.return_annotation in (want.return_annotation, inspect.Signature.empty), (cls, name)


# Private names read on purpose off something other than `self`/`cls`, each with its reason
# (path -> {"base.attr" or "getattr(base, '_attr')": reason}): other projects' privates, and a class reading
# its companion's in the same module.
ALLOWED_PRIVATE: dict[str, dict[str, str]] = {
    "fusionflow/cache/keeper.py": {
        "os._exit": "the double-forked keeper and its intermediate leave without running the parent's atexit "
        "hooks or flushing its buffers (Python's documented exit for a forked child)",
    },
    "fusionflow/ops/exact.py": {
        "img._new": "Pillow: Image.point without its per-entry round(), falling back to the public call",
    },
    "fusionflow/policy/torchvision_tables.py": {
        "t._AUGMENTATION_SPACE": "torchvision keeps its auto-augmentation op tables private; we convert them",
        "t._policies": "torchvision's AutoAugment sub-policies, private too",
    },
    "fusionflow/accel/dali_fork.py": {
        "getattr(pipe, '_pipe')": "DALI's pipeline backend: a forked child takes it from the Pipeline unshut (DALI has "
        "no public way to drop a pipeline without Shutdown, which joins the parent's threads)",
        "pipe._pipe": "the same backend, cleared so that DALI's exit hook and __del__ find nothing to shut down",
    },
    "fusionflow/accel/dali_host.py": {
        "getattr(pipe, '_shutdown')": "DALI's pipeline teardown, called when present (its close is not enough)",
    },
    "fusionflow/accel/dali_graph.py": {
        "pipe._first_iter": "DALI 2.4's first schedule_run runs prefetch_queue_depth iterations; fed one run "
        "at a time (feed_input), each schedule_run must run exactly one",
        "self._pipe._ops": "DALI keeps the built graph's operators there and counts them nowhere public: "
        "`graph_nodes`, what each run's Run walks",
    },
    "fusionflow/timm/batch.py": {
        "mixup._params_per_batch": "timm's Mixup draws a batch's (lambda, cutmix) only there: called, so the "
        "draws are timm's own",
    },
    "fusionflow/runtime/worker.py": {
        "torch_worker._worker_info": "what torch.utils.data.get_worker_info() returns: DataLoader's worker sets it "
        "there, and so must ours for datasets and worker_init_fns that read it",
        "getattr(torch_worker, '_generate_state')": "DataLoader's NumPy seed for a worker (base seed, worker id), "
        "used when present",
        "os._exit": "the watchdog thread ends an orphaned worker whatever its main thread is doing (no cleanup "
        "is owed: the ring has no name)",
    },
    "fusionflow/runtime/procs.py": {
        "getattr(multiprocessing.process, '_children')": "the stdlib's record of the processes it SIGTERMs at "
        "exit: a child the script forks drops the loaders' processes from it (they are not its children)",
    },
    "fusionflow/runtime/targets.py": {
        "hasattr(obj, '_fields')": "how a namedtuple is told from a tuple (Python's own protocol)",
        "kind._fields": "a namedtuple's field names (Python's own protocol): how its class travels by value",
        "getattr(kind, '_fields')": "a namedtuple's field names (Python's own protocol): the class found matches",
    },
    "fusionflow/shared/client.py": {
        f"{base}.{attr}": "the client's epoch iterator (same module) drives the client's connection and copies"
        for base in ("c", "self._c")
        for attr in ("_send", "_recv", "_dropped", "_out", "_alloc", "_copy")
    },
}
SELF = ("self", "cls")


def _defined_here(tree) -> set[str]:
    """The private names a module defines: functions, classes, globals, attributes it assigns, arguments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def _private_reads_in(tree, rel: str) -> list[str]:
    """Imports of another module's private name; private attributes read off anything but self/cls
    (an attribute, or by name through getattr/hasattr/setattr), unless ALLOWED_PRIVATE lists them; and
    self's private attributes this module never defines (a base class's, from another module)."""
    allowed, mine, found = ALLOWED_PRIVATE.get(rel, {}), _defined_here(tree), []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in SELF and _private(node.attr):
            if node.attr not in mine:  # a base class's private state, from another module
                what = f"{ast.unparse(node.value)}.{node.attr}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusionflow"):
            found += [
                f"{rel}:{node.lineno} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) not in SELF:
            what = f"{ast.unparse(node.value)}.{node.attr}" if _private(node.attr) else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
            name, base = node.args[1], ast.unparse(node.args[0])
            if node.func.id in ("getattr", "hasattr", "setattr") and isinstance(name, ast.Constant):
                if isinstance(name.value, str) and _private(name.value) and base not in SELF:
                    what = f"{node.func.id}({base}, {name.value!r})"
        if what is not None and what not in allowed:
            found.append(f"{rel}:{node.lineno} reads {what}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reads() -> list[str]:
    """Each place a module imports another module's private name, or reads a private attribute that
    it does not define itself (a name-based reading: `x._y` is fine where this module assigns `_y`)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found += _private_reads_in(ast.parse(path.read_text(), rel), rel)
    return found


def test_no_module_reads_another_module_s_private_names():
    reads = private_reads()
    assert not reads, "give these a public name, or a method on their owner:\n" + "\n".join(reads)


def test_the_private_name_check_sees_imports_and_foreign_attributes():
    src = "from fusionflow.x import _a\nclass C:\n    def f(self, o):\n        self._own = o._theirs + self._own\n"
    assert _private_reads_in(ast.parse(src), "m.py") == ["m.py:1 imports fusionflow.x._a", "m.py:4 reads o._theirs"]
    # a name this module also assigns on self does not make another object's attribute its own
    same_name = "class D:\n    def g(self, loader):\n        self._runtime = loader._runtime\n"
    assert _private_reads_in(ast.parse(same_name), "m.py") == ["m.py:3 reads loader._runtime"]
    subclass = "class E(Base):\n    def g(self):\n        return self._base_state\n"
    assert _private_reads_in(ast.parse(subclass), "m.py") == ["m.py:3 reads self._base_state"]
    by_name = "def h(pipe):\n    return getattr(pipe, '_shutdown', None)\n"
    assert _private_reads_in(ast.parse(by_name), "m.py") == ["m.py:2 reads getattr(pipe, '_shutdown')"]
