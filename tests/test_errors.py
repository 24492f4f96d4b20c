"""Every runtime error FusionFlow can raise is importable from `fusionflow`, so a training script can
catch it without knowing which internal module defines it."""

import ast
from pathlib import Path

import fusionflow
from fusionflow.errors import FusionFlowError

PACKAGE = Path(fusionflow.__file__).resolve().parent


def _error_classes_defined_in_package() -> dict[str, Path]:
    """Names of classes anywhere under fusionflow/ that derive (by base-class name, transitively)
    from FusionFlowError. Read from the source, so no module (torch, DALI) has to be importable."""
    bases: dict[str, tuple[set[str], Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                }
                bases[node.name] = (names, path)
    found = {"FusionFlowError": PACKAGE / "errors.py"}
    grew = True
    while grew:
        grew = False
        for name, (names, path) in bases.items():
            if name not in found and names & found.keys():
                found[name] = path
                grew = True
    return found


def test_every_fusionflow_error_is_exported():
    defined = _error_classes_defined_in_package()
    assert {"WorkerStartError", "SampleKilledWorkersError", "BridgeError", "NativeBuildError"} <= defined.keys()
    for name, path in defined.items():
        assert name in fusionflow.__all__, f"{name} (defined in {path.relative_to(PACKAGE.parent)}) is not exported"
        cls = getattr(fusionflow, name)
        assert isinstance(cls, type) and issubclass(cls, FusionFlowError), name


def test_errors_keep_their_old_import_paths():
    from fusionflow import native
    from fusionflow.runtime import local_manager

    assert local_manager.WorkerStartError is fusionflow.WorkerStartError
    assert local_manager.SampleKilledWorkersError is fusionflow.SampleKilledWorkersError
    assert native.BridgeError is fusionflow.BridgeError
    assert issubclass(native.NativeBuildError, fusionflow.BridgeError)


def test_sample_killed_workers_error_names_the_samples():
    err = fusionflow.SampleKilledWorkersError("killed 3 workers", [4, 7])
    assert err.indices == [4, 7] and "killed 3 workers" in str(err)


def test_a_workers_exception_sends_its_small_plain_attributes_only():
    """errno/filename and what the class's __init__ set, when small and plain: nothing large travels with a
    failure (a dataset or a buffer held by an exception stays in the worker)."""
    from fusionflow.errors import exception_attributes

    class Http(Exception):
        def __init__(self, message, code, body):
            super().__init__(message)
            self.code, self.body, self.tags, self.big = code, body, ("a", 1), b"x" * 100_000

    assert exception_attributes(Http("no", 404, object())) == {"code": 404, "tags": ("a", 1)}
    assert exception_attributes(FileNotFoundError(2, "No such file", "/a.jpg")) == {
        "errno": 2, "strerror": "No such file", "filename": "/a.jpg", "filename2": None,
    }  # fmt: skip
