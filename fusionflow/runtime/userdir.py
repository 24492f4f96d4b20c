"""The user's own directory on this node for what FusionFlow's processes agree on between them:
shared loaders' rendezvous records (fusionflow/shared/rendezvous.py), decoded-image cache keepers' records and
lock files (cache/keeper.py) and the cores loaders have pinned workers to (runtime/cores.py).
`/tmp/fusionflow-<uid>`, or `$FUSIONFLOW_RUNTIME_DIR` where set (the same for every process that must meet).
Not `$XDG_RUNTIME_DIR` (used until 2026-11-29): a login shell has it and a batch job, a cron job or `docker exec`
has not, so a producer and its clients started from the two looked in two places and never met."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time

from fusionflow.runtime.procs import StoppedHolder


def directory() -> str:
    """The directory, created 0700; refused if it is not the user's alone."""
    path = os.path.abspath(os.environ.get("FUSIONFLOW_RUNTIME_DIR") or f"/tmp/fusionflow-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory of this user's with mode 0700 (it holds shared loaders' secrets and "
            f"core claims); it is mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}: remove it or fix it"
        )
    return path


def flock_within(fd: int, seconds: float, what: str) -> None:
    """An exclusive flock on `fd`, waited for at most `seconds` (polled): a holder stopped with SIGSTOP
    costs the caller what it wanted the lock for, never its run. Past the bound, or once the holder is seen
    stopped (`flock_holder`; since session 40: a GM waiting out a stopped holder skipped 10 s of polls a try),
    TimeoutError (an OSError) naming `what`."""
    now = time.monotonic()
    deadline, pause, watch = now + seconds, 0.001, StoppedHolder(lambda: flock_holder(fd), now)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{what} stayed locked over {seconds:.0f} s (its holder stopped?)") from None
            if (holder := watch.seen_stopped(now)) is not None:
                raise TimeoutError(f"{what} is locked by stopped process {holder}") from None
            time.sleep(pause)
            pause = min(0.02, pause * 2)


def flock_holder(fd: int) -> int | None:
    """The pid that took the flock on `fd`'s file (Linux's /proc/locks), None if none or not known."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:  # (a waiter's line has "->")
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def lock_file(path: str, seconds: float, what: str):
    """Hold an exclusive flock of the lock file `path` (made 0600 if missing; `flock_within`'s bound), yielding
    its descriptor. The lock is the file now at `path`: one removed (by `remove_locked`, under the lock) while
    this waited is opened again, so removing lock files is safe and they do not pile up."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            flock_within(fd, seconds, what)
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield fd
                return
        finally:
            os.close(fd)  # drops the flock


def remove_locked(path: str) -> None:
    """Remove the lock file `path`, while holding its lock (`lock_file`): waiters open the next one."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def env_number(name: str, default: float, kind=int, means: str = ""):
    """A number from environment variable `name` (`default` where unset), of `kind` (int or float): a value that is
    not one is refused naming the variable, its value and what it `means` (int("abc") said neither)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        a = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={raw!r} must be {a}{means}: fix or unset it") from None
