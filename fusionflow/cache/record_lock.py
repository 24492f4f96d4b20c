"""The decoded-image cache's record lock: byte 0 of its segment, a POSIX record lock (fcntl), taken by every process
that claims, publishes or counts (cache/store.py), and held for microseconds.

A holder stopped with SIGSTOP -- a worker of a paused job sharing the cache -- must not stop every other worker: a
waiter gives up past its bound, or at once when it sees the holder stopped at two looks 0.1 s apart (F_GETLK names
the holder; runtime/procs.py `StoppedHolder`), and its caller gives up that fill, publication or
count. A record lock belongs to the process, not the thread, and closing any descriptor of the file drops it: one
re-entrant lock per process (`threads()`) keeps its threads out of each other's sections and out of a store's close.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from contextlib import contextmanager

from fusionflow.runtime.procs import StoppedHolder

LOCK_S = 10.0  # the longest a process waits for the record lock (its holders keep it for microseconds)...
FILL_LOCK_S = 0.05  # ...for a fill's claim, which is optional: a busy lock costs that fill only
_FLOCK = "hhqqi4x"  # Linux's struct flock: l_type, l_whence, l_start, l_len, l_pid (and padding)
_THREADS = threading.RLock()


def threads() -> threading.RLock:
    """This process's lock over its threads' sections (a new one in a forked child)."""
    return _THREADS


@contextmanager
def locked(fd: int, bound: float | None = None):
    """The record lock of the segment behind `fd`, waited for at most `bound` (None: LOCK_S); TimeoutError past it,
    or once its holder is seen stopped."""
    bound = LOCK_S if bound is None else bound
    if not _THREADS.acquire(timeout=bound):
        raise TimeoutError(f"another thread held the decoded-image cache's lock over {bound} s")
    try:
        _take(fd, bound)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0, os.SEEK_SET)
    finally:
        _THREADS.release()


def holder(fd: int) -> int | None:
    """The pid of the process holding the record lock (fcntl F_GETLK), None if free or unknown."""
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    try:
        kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError:
        return None
    return None if kind == fcntl.F_UNLCK or pid <= 0 else pid


def _take(fd: int, bound: float) -> None:
    deadline, pause, watch = None, 0.0002, None
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
            return
        except (BlockingIOError, PermissionError):
            now = time.monotonic()
            deadline = deadline or now + bound
            watch = watch or StoppedHolder(lambda: holder(fd), now)
            if now > deadline:
                raise TimeoutError(f"the decoded-image cache's lock was held over {bound} s") from None
            if (pid := watch.seen_stopped(now)) is not None:
                raise TimeoutError(f"the decoded-image cache's lock is held by stopped process {pid}") from None
            time.sleep(pause)
            pause = min(0.01, pause * 2)


def _new_lock_after_fork() -> None:  # a fork while another thread held it must not leave the child locked
    global _THREADS
    _THREADS = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_after_fork)
