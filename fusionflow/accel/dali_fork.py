"""DALI pipelines in a process forked from the one that built them (a script's own os.fork, a fork-context
multiprocessing child): their executor threads exist only in the parent. Left as they are, the child's exit runs
DALI's own hook (`_shutdown_pipelines`) or a pipeline's `__del__`, whose Shutdown joins threads the child does not
have: it hangs, or aborts ("terminate called after throwing std::system_error"). Since a loader keeps its idle
pipeline between epochs (accel/session.py), one exists whenever such a fork happens. In the child, every pipeline
this process built lets go of its backend without shutting it down: the backend is kept alive for good (an
intentional leak of the parent's copy, never destroyed here), so neither hook nor `__del__` touches it."""

from __future__ import annotations

import ctypes
import os
import weakref

_BUILT: weakref.WeakSet = weakref.WeakSet()  # the DALI Pipeline objects built in this process


def track(pipe) -> None:
    """A DALI Pipeline just built here (DaliPolicyPipeline._build)."""
    _BUILT.add(pipe)


def _forget_in_child() -> None:
    for pipe in list(_BUILT):
        backend = getattr(pipe, "_pipe", None)
        if backend is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))  # its destructor would join the parent's threads
            pipe._pipe = None  # Pipeline._shutdown: nothing to shut down
    _BUILT.clear()


os.register_at_fork(after_in_child=_forget_in_child)
