"""Processes: whether one is alive (as the owners of shared resources need to know it), what
starting one by fork needs of the libraries loaded in this process, and ending a whole session (a
child that led one, and whatever it started)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing import context as mp_context
from multiprocessing import reduction

from fusionflow.runtime.shm import forking_ours, on_foreign_fork

log = logging.getLogger(__name__)


OURS = "fusionflow-"  # the name prefix of every process a loader starts (CPU workers, DALI input helpers)


def _forget_ours() -> None:
    """In the child of a fork the script makes (`on_foreign_fork`): multiprocessing's records of the loaders'
    processes, inherited from the parent, are dropped. At the child's exit multiprocessing SIGTERMs every daemon
    process it holds a record of -- here the parent's workers, which the parent then restarts -- and fails to
    join them (they are not the child's), with a traceback."""
    children = getattr(multiprocessing.process, "_children", None)  # the stdlib's record (private; since 3.4)
    for proc in list(children or ()):
        if proc.name.startswith(OURS):
            children.discard(proc)


on_foreign_fork(_forget_ours)


def run_every(*steps) -> None:
    """Call each of `steps` in order even when an earlier one raised -- a Ctrl-C landing in one step of a
    shutdown must not leave the later steps' processes and segments behind -- then raise the first error; a
    later step's error (not a second Ctrl-C) is logged, since only the first propagates."""
    first = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # KeyboardInterrupt included: the rest still runs, then it propagates
            if first is not None and not isinstance(exc, KeyboardInterrupt):
                log.error("a later shutdown step failed too (after %r)", first, exc_info=exc)
            first = exc if first is None else first
    if first is not None:
        raise first


def parent_gone(parent_pid: int) -> bool:
    """In a process the training process (`parent_pid`) started: whether that process is gone. Its parent is the
    training process under fork and spawn; under forkserver it is the fork server, so the training process is
    looked up by its pid."""
    return os.getppid() != parent_pid and not pid_alive(parent_pid)


def parent_gone_within(parent_pid: int, seconds: float) -> bool:
    """`parent_gone`, waited for up to `seconds` (a process ending: its children are re-parented once it has exited)."""
    deadline = time.monotonic() + seconds
    while not (gone := parent_gone(parent_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone


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


def is_stopped(pid: int) -> bool:
    """True while `pid` is stopped (SIGSTOP, SIGTSTP, a debugger's trace stop): alive, and holding
    whatever it holds, but running nothing until it is continued."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class StoppedHolder:
    """A lock's holder, looked up while a waiter polls the lock: `seen_stopped(now)` is its pid once it was found
    stopped at two looks 10 x CHECK_S apart (a profiler's sampling stop, py-spy's, is shorter), else None. The first
    look comes CHECK_S after the wait began (a holder keeps such locks for microseconds). `find()`: the holder's
    pid or None (cache/record_lock.py: F_GETLK; runtime/userdir.py: /proc/locks)."""

    CHECK_S = 0.01

    def __init__(self, find, began: float):
        self.find, self.look_at, self.seen = find, began + self.CHECK_S, None

    def seen_stopped(self, now: float) -> int | None:
        if now <= self.look_at:
            return None
        self.look_at, pid = now + 10 * self.CHECK_S, self.find()
        stopped, before = (pid if pid is not None and is_stopped(pid) else None), self.seen
        self.seen = stopped
        return stopped if stopped is not None and stopped == before else None


def end_processes(processes, grace: float) -> None:
    """Join `processes` (multiprocessing.Process, already asked to stop) for up to `grace` seconds in all,
    then terminate() those still running, then kill(): each step waits up to 1 s (interrupted: at once)."""
    deadline = time.monotonic() + grace
    try:
        for proc in processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # interrupted too (a Ctrl-C in the grace): none is left running
        for proc in processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)


def stop_after_read(processes) -> None:
    """SIGUSR1 to each of `processes` still running: at shutdown, a worker running a task reads its STOP only after
    it, and the task is nobody's now (the iteration ended, or raised, e.g. at `timeout`): not worth the stop grace.
    The worker ends at once, or when the dataset read in hand returns (runtime/sample.py end_after_read: a file the
    read writes is not cut); a SIGTERM (end_processes after the grace, multiprocessing's exit) ends it at once."""
    for proc in processes:
        if proc.is_alive() and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C (SIGINT) held back while the block runs, then delivered as the handler in place would have it: an
    interrupt inside a fork (in its at-fork handlers: logging's lock left held, and a later DALI build hung on
    it) or between a process's start and its record (a process nobody stops) would leave either behind. Only
    in the main thread, where Python runs signal handlers; elsewhere, or under a handler Python did not set, a
    no-op. A child forked in the block inherits the recording handler until it sets its own (our workers ignore
    SIGINT first thing: Ctrl-C is the training process's)."""
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old is None:
        yield
        return
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and old is signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)
        elif got and callable(old):
            old(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt here


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


def command_line(pid: int) -> list[str]:
    """`pid`'s argv as /proc shows it ([] once it is gone, or for a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def live_processes() -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/pid/stat after the command name) of every process but zombies:
    fields[1] is the parent's pid, fields[3] the session's."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[0] != "Z":
            out.append((int(name), fields))
    return out


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a process started with `start_new_session=True` leads
    the session of its pid, and everything it starts stays in it unless it calls setsid itself)."""
    return [pid for pid, fields in live_processes() if int(fields[3]) == sid]


def kill_session(sid: int, wait_s: float = 5.0) -> list[int]:
    """SIGKILL every process of session `sid` and wait up to `wait_s` for them to go; returns those
    still there (none, normally). For a child that led its own session: what it started must not
    outlive it, even when it died without stopping them."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [pid for pid in session_pids(sid) if pid != os.getpid()]
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


@contextlib.contextmanager
def _spawning():
    mp_context.set_spawning_popen(object())  # what a Process start sets while it pickles the child's arguments
    try:
        yield
    finally:
        mp_context.set_spawning_popen(None)


@contextlib.contextmanager
def starting_worker(dataset, spec):
    """Around a CPU worker process's start (WorkerPool.start_worker): OpenCV quiet for the fork, a Ctrl-C
    deferred until the worker is listed, the fork marked FusionFlow's own, pickling errors named."""
    with opencv_quiet_for_fork(), interrupts_deferred(), forking_ours(), pickling_named(dataset, spec):
        yield


@contextlib.contextmanager
def pickling_named(dataset, spec):
    """Around a worker's start by spawn or forkserver: a pickling error of its arguments names which of the
    dataset, the policy and the worker_init_fn cannot be pickled and how to fix it (the bare error named an
    attribute deep inside, or a lambda, and not what was passed). Other errors pass unchanged."""
    try:
        yield
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        parts = {"worker_init_fn": spec.worker_init_fn, "policy": spec.policy, "dataset": dataset}  # small first
        for name, value in parts.items():
            try:  # as the start pickles them (a multiprocessing Lock travels to a spawned child, not elsewhere)
                with _spawning():
                    reduction.ForkingPickler.dumps(value)
            except Exception as why:
                raise TypeError(
                    f"the {name} ({type(value).__name__}) cannot be pickled for workers started by spawn or "
                    f"forkserver ({type(why).__name__}: {why}): open files, locks and handles in __getitem__ rather "
                    "than __init__, define classes and functions at module level (no lambdas or local ones), or "
                    "use multiprocessing_context='fork'"
                ) from exc
        raise
