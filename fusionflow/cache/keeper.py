"""One decoded-image cache per node and dataset: the keeper process that owns it, and how a loader
finds it.

The keeper is a small program of its own (`python -m fusionflow.cache.keeper`, started by the first
loader that asks; its launcher forks it and exits, so it is nobody's child and maps nothing of the
training process) that creates the cache segment, unlinks its name at once (nothing in
/dev/shm survives any SIGKILL: the memory goes with the last process that maps it), listens on an
abstract Unix socket and hands the segment's descriptor to every loader that attaches (SCM_RIGHTS,
after runtime/authsock.py's handshake both ways). It counts its loaders by their connections -- the
kernel closes a dead process's socket -- and exits when the last one has gone.

Rendezvous: the key is a hash of (uid, the dataset's fingerprint, max_side, admission); the keeper
writes {pid, address, secret} to `<userdir>/cache-<key>.json` (0600, runtime/userdir.py) and a
loader looks there under an flock of `cache-<key>.lock`, so two loaders starting together find one
keeper. A record whose pid is gone is stale and replaced.

Wire (pickled tuples on the authenticated connection): loader -> ("attach", entries) then, at close,
("detach",); keeper -> ("ok",) + the descriptor, or ("refused", why); ("bye", left).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import posix_ipc

from fusionflow.cache.store import CacheStore
from fusionflow.runtime.authsock import accept, connect, listen, set_receive_timeout
from fusionflow.runtime.procs import command_line, is_stopped, pid_alive
from fusionflow.runtime.shm import closed_in_foreign_children, recv_fd, send_fd
from fusionflow.runtime.userdir import directory, lock_file, remove_locked

log = logging.getLogger("fusionflow.cache")
START_S = 20.0  # a keeper that has not said it is ready by then is given up on
FIRST_CLIENT_S = 30.0  # a keeper nobody attaches to this long after it started exits
GONE_S = 5.0  # the last loader to detach waits this long for the keeper to exit
KEEPER_MODULE = "fusionflow.cache.keeper"  # the keeper's program: python -m KEEPER_MODULE <record> ...


def cache_key(fingerprint: str, max_side: int, admission: str) -> str:
    return hashlib.sha256(f"{os.getuid()}\0{fingerprint}\0{max_side}\0{admission}".encode()).hexdigest()[:24]


class KeeperLink:
    """A loader's attachment to its node's keeper: the connection (held open: it is how the keeper
    counts this loader) and the mapped store."""

    def __init__(self, conn: Connection, store: CacheStore, pid: int, record: str):
        self.conn, self.store, self.keeper_pid, self.record = conn, store, pid, record
        _LINKS.add(conn)

    def close(self) -> None:
        """Detach; the last loader waits (bounded) until the keeper has exited, so nothing is left
        running when close() returns. A keeper that does not answer because it is stopped is killed."""
        left = None
        try:
            set_receive_timeout(self.conn, 2)
            self.conn.send(("detach",))
            reply = self.conn.recv()
            left = reply[1] if reply and reply[0] == "bye" else None
        except (OSError, EOFError, BlockingIOError):
            pass
        self.conn.close()
        killed = left is None and end_if_stopped(self.keeper_pid, self.record)
        if left == 0 or killed:  # waited for (its segment goes with it)
            deadline = time.monotonic() + GONE_S
            while pid_alive(self.keeper_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            try:  # adopted by this process (PID 1 of a container, a subreaper): reap it
                os.waitpid(self.keeper_pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if killed or (left is None and not pid_alive(self.keeper_pid)):  # it could not remove its rendezvous files
            remove_record(self.record, self.keeper_pid)  # (killed by this loader, or gone before: SIGKILLed)


_LINKS = closed_in_foreign_children()  # this process's links' connections (a CPU worker closes them as owned fds)


def end_if_stopped(pid: int, record: str) -> bool:
    """Kill the keeper of `record` if it is stopped (SIGSTOP, a paused debugger; a loader that got no answer from it
    asks): stopped, it serves no loader and never sees its last one leave, so it would hold its cache's memory
    until continued -- past the job, with nobody left to continue it. The loaders that map the cache keep it; the
    next to attach starts a new keeper. True if it was ours and stopped (its command line names the record: not a
    process that reused the pid)."""
    cmd = command_line(pid) if is_stopped(pid) else []
    if KEEPER_MODULE not in cmd or record not in cmd:  # (`python -m fusionflow.cache.keeper <record> ...`)
        return False
    log.warning("the decoded-image cache's keeper (pid %d) is stopped; it is killed", pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def attach(
    key: str, entries: int, size: int, max_side: int, admission: str, path: str | None, check=None
) -> KeeperLink:
    """The node's cache for `key`: the running keeper's, or a new keeper's. Raises OSError (or
    ValueError for a keeper that refuses) when neither works; the caller falls back. `check()` runs
    before a new keeper is started (the room for a new segment)."""
    folder = directory()
    record, lock = os.path.join(folder, f"cache-{key}.json"), os.path.join(folder, f"cache-{key}.lock")
    with lock_file(lock, START_S + 10, lock):  # its holder starts a keeper in START_S at most
        rec = _read(record)
        if rec is not None and pid_alive(rec["pid"]):
            try:
                return _attach_to(rec, entries, record)
            except (OSError, EOFError):  # it is exiting (its last loader just left), or stopped: start another
                end_if_stopped(rec["pid"], record)
        try:
            if check is not None:
                check()
            _start_keeper(record, entries, size, max_side, admission, path)
        except BaseException:  # no keeper of this key runs: nobody else would remove its lock file
            rec = _read(record)
            if rec is None or not pid_alive(rec["pid"]):
                remove_locked(lock)
            raise
        return _attach_to(_read(record), entries, record)


def _read(record: str) -> dict | None:
    try:
        with open(record) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _attach_to(rec: dict, entries: int, record: str) -> KeeperLink:
    conn = connect(rec["address"], bytes.fromhex(rec["secret"]))
    try:
        conn.send(("attach", entries))
        reply = conn.recv()
        if reply[0] != "ok":
            raise ValueError(reply[1])
        fd = recv_fd(conn)
        try:
            set_receive_timeout(conn, 0)
            store = CacheStore(fd)
        except BaseException:
            os.close(fd)
            raise
        return KeeperLink(conn, store, rec["pid"], record)
    except BaseException:
        conn.close()
        raise


def _start_keeper(record: str, entries: int, size: int, max_side: int, admission: str, path: str | None) -> None:
    """Start a keeper as a program of its own (`python -m fusionflow.cache.keeper`): a fresh
    interpreter, so it maps nothing of the training process (its rings, other caches, its heap). That
    launcher forks the keeper and exits at once (reaped here), so the keeper is nobody's child; it says
    "ok" (or why not) on the pipe."""
    r, w = os.pipe()
    try:
        args = [record, entries, size, max_side, admission, path or "", w, os.getpid()]
        proc = subprocess.Popen(
            [sys.executable, "-m", KEEPER_MODULE, *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            pass_fds=(w,),
        )
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], START_S)
        answer = os.read(r, 4096).decode() if ready else "no answer"
    finally:
        os.close(r)
        try:
            proc.wait(START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if answer != "ok":
        raise OSError(f"the cache keeper did not start: {answer or 'it exited'}")


def main(argv: list[str]) -> None:
    """The launcher: fork the keeper, leave."""
    record, entries, size, max_side, admission, path, w, launcher = argv
    if os.fork() != 0:
        os._exit(0)
    _keeper_main(int(w), record, int(entries), int(size), int(max_side), admission, path or None, int(launcher))


def _keeper_main(
    w: int, record: str, entries: int, size: int, max_side: int, admission: str, path, launcher: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seg = segment(path)
        store = CacheStore.create(seg, entries, size, max_side, admission)
        store.close()
        secret = secrets.token_bytes(32)
        address = f"fusionflow-cache-{os.getuid()}-{secrets.token_hex(8)}"
        listener = listen(address)
        tmp = f"{record}.{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"pid": os.getpid(), "address": address, "secret": secret.hex()}, f)
        os.replace(tmp, record)
    except BaseException as exc:
        os.write(w, f"{type(exc).__name__}: {exc}".encode())
        os._exit(1)
    try:  # (the "ok" too: a loader interrupted while it waited for it closed the pipe, and the record is ours)
        os.write(w, b"ok")
        os.close(w)
        _serve(listener, secret, seg, entries, launcher)
    finally:
        _leave(listener, record)
        os._exit(0)


def _leave(listener, record: str) -> None:
    """The keeper's exit: no more connections, then its record and lock file go."""
    listener.close()
    remove_record(record, os.getpid())


def remove_record(record: str, pid: int) -> None:
    """The record and lock file of keeper `pid` go (unless a new keeper's record replaced it), under the lock: a
    loader waiting there finds no keeper and starts one."""
    lock = record[: -len(".json")] + ".lock"
    try:
        with lock_file(lock, START_S + 10, lock):
            if (_read(record) or {}).get("pid") == pid:
                os.unlink(record)
                remove_locked(lock)
    except OSError:  # the lock's holder stopped: the next loader replaces a record whose pid is gone
        pass


def segment(path: str | None) -> int:
    """A descriptor of a new, nameless file: in /dev/shm (named, then unlinked at once), or in `path`."""
    if path is not None:
        return os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600)
    name = "/ff_cache_" + secrets.token_hex(10)
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    posix_ipc.unlink_shared_memory(name)
    return seg.fd


def _serve(listener, secret: bytes, seg: int, entries: int, launcher: int) -> None:
    """Until its last client leaves; before the first, FIRST_CLIENT_S at most, and no longer than the loader that
    started it lives (one killed or interrupted for good while it attached: the keeper lingered 30 s)."""
    clients: list[Connection] = []
    started, ever = time.monotonic(), False
    while clients or (not ever and time.monotonic() - started < FIRST_CLIENT_S and pid_alive(launcher)):
        ready, _, _ = select.select([listener, *clients], [], [], 1.0)
        for conn in [c for c in ready if c is not listener]:
            try:
                msg = conn.recv()
            except (OSError, EOFError):
                msg = None
            clients.remove(conn)
            if msg is not None and msg[0] == "detach":
                try:
                    conn.send(("bye", len(clients)))
                except OSError:
                    pass
            conn.close()
        if listener in ready:
            conn = accept(listener, secret, "the decoded-image cache")
            if conn is None:
                continue
            if _welcome(conn, seg, entries):
                clients.append(conn)
                ever = True
            else:
                conn.close()


def _welcome(conn: Connection, seg: int, entries: int) -> bool:
    try:
        set_receive_timeout(conn, 2)
        msg = conn.recv()
        if msg[0] != "attach":
            return False
        if msg[1] != entries:
            conn.send(("refused", f"the node's cache for this dataset holds {entries} samples, not {msg[1]}"))
            return False
        conn.send(("ok",))
        send_fd(conn, seg)
        set_receive_timeout(conn, 0)
        return True
    except (OSError, EOFError, BlockingIOError):
        return False


if __name__ == "__main__":
    main(sys.argv[1:])
