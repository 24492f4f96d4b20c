"""Processes: whether one is alive (as the owners of shared resources need to know it), and what
starting one by fork needs of the libraries loaded in this process."""

from __future__ import annotations

import contextlib
import os
import sys


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; False once it has exited, including as a zombie its parent has not
    reaped yet (it will never release anything again)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def opencv_quiet_for_fork():
    """Around a fork: OpenCV's thread pool (pthreads) held at one thread, then restored. A child
    forked while the pool's threads were busy or just finished inherits its locks and condition
    variables with no threads behind them, and hangs for good in `cv2.setNumThreads` (measured: 27
    of 30 forks right after a parallel `cv2.GaussianBlur` in the parent). Setting one thread in the
    parent first joins the pool's threads, so the child starts from a quiet pool. Costs ~2 ms per
    fork; does nothing where OpenCV is not loaded."""
    cv2 = sys.modules.get("cv2")
    if cv2 is None:
        yield
        return
    before = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(before)
