"""Whether a process is alive, as the owners of shared resources need to know it."""

from __future__ import annotations

import os


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
