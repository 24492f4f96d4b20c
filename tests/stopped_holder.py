"""A lock held by a process stopped with SIGSTOP: what bounded waits are tested against."""

import contextlib
import os
import signal


@contextlib.contextmanager
def held_by_a_stopped_process(take):
    """Fork a child that enters `take()` (a context manager taking the lock) and stops itself while it
    holds it; yields once it holds it, SIGKILLs and reaps it at the end (its lock goes with it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with take():
                os.write(w, b"x")
                os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
