"""How a SharedLoaderClient finds its producer, and what they say to each other.

The rendezvous: a producer named `name` listens on an abstract Unix socket at a random address and
writes {pid, address, secret} to `<dir>/shared-<name>.json`, mode 0600 (the prefix keeps a name such as
`cores` off the directory's other files), where `<dir>` is runtime/userdir.py's
(`/tmp/fusionflow-<uid>`, whatever the process's environment), a 0700 directory that must be the user's
own (a directory another user could write is refused). So only the user's processes learn the
secret, and every connection proves it both ways (runtime/authsock.py); the producer also checks
the peer's uid (SO_PEERCRED). Nothing is in /dev/shm: the ring's name is unlinked at birth and its
descriptor is handed over the socket, and the socket vanishes with the producer. A file left by a
SIGKILLed producer is stale (its pid is gone): the next producer of that name, or a client that
finds it, removes it.

The wire: small pickled tuples on the authenticated connection (the same user's processes on
both ends, after the HMAC handshake); pixels never -- they are in the ring the client maps read-only
from the descriptor it receives (SCM_RIGHTS) right after HELLO.

    client -> producer   ("attach", pid)  ("ready",)  ("release", epoch, seq, slot)  ("drop", epoch)  ("ping",)
    producer -> client   ("hello", Hello)  ("epoch", epoch, batches)  ("batch", epoch, seq, slot, n, targets)
                         ("end", epoch, batches)  ("pong",)  ("finished", epochs)  ("error", text)

`targets` is None when the labels are the ring's int64 row, else the batch's targets as the dataset
gave them (a list, pickled: targets only). A client counts (for min_clients, and as an epoch's
recipient) from "ready" on: one that refuses the producer's terms (its batch size) never did.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from fusionflow.errors import SharedLoaderError
from fusionflow.runtime.authsock import HANDSHAKE_S, connect, hang_up, set_receive_timeout
from fusionflow.runtime.procs import pid_alive
from fusionflow.runtime.shm import RingLayout, closed_in_foreign_children, disown_fd, own_fd, recv_fd
from fusionflow.runtime.userdir import directory, lock_file, remove_locked

log = logging.getLogger("fusionflow.shared")
LOCK_S = 10.0  # the longest a producer waits for its name's lock (a holder stopped with SIGSTOP)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"name={name!r} must be 1-64 characters of letters, digits, '.', '_' or '-' (starting with a "
            "letter or digit): it names the shared loader on this node, e.g. name='sweep1'"
        )
    return name


@dataclass(frozen=True)
class Hello:
    """What a client learns when it attaches: the producer, the ring, the epochs' shape, and where
    this client starts."""

    name: str
    pid: int
    layout: RingLayout
    batch_size: int  # the producer's mini-batch (its ring rows)
    drop_last: bool
    batches: int  # the producer's mini-batches per epoch
    samples: int  # samples per epoch (before any on_error='skip')
    running: tuple | None  # (epoch, batches published) of the epoch under way, else None


def path_of(name: str) -> str:
    return os.path.join(directory(), f"shared-{name}.json")  # prefixed: `cores` must not be cores.json


def publish(name: str, address: str, secret: bytes) -> dict | None:
    """Publish this process as producer `name` (0600) unless a live producer of that name is published: then
    its record, and nothing written. Under the name's lock file, so two producers starting together cannot
    both publish (the second's record would replace the first's, which then waits for clients forever)."""
    with _locked(name):
        existing = read(name, locked=True)
        if existing is None:
            path = path_of(name)
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "address": address, "secret": secret.hex()}, f)
            os.replace(tmp, path)
        return existing


def read(name: str, locked: bool = False) -> dict | None:
    """The producer's record, or None when there is none (a stale record of a dead pid is removed; `locked`: the
    name's lock is held by the caller)."""
    path = path_of(name)
    try:
        with open(path) as f:
            rec = json.load(f)
        rec["secret"] = bytes.fromhex(rec["secret"])
    except (OSError, ValueError, KeyError):
        return None
    if not pid_alive(int(rec["pid"])):
        _remove_if(name, int(rec["pid"])) if locked else remove(name, int(rec["pid"]))
        return None
    return rec


def remove(name: str, pid: int) -> None:
    """Remove `name`'s record if it is still `pid`'s (a newer producer's stays), and then its lock file."""
    try:
        with _locked(name) as lock:  # no record left (another client removed it first): its lock file goes too
            if _remove_if(name, pid) or not os.path.exists(path_of(name)):
                remove_locked(lock)
    except OSError:  # the lock's holder stopped: a stale record is removed by the next reader
        pass


def _remove_if(name: str, pid: int) -> bool:
    path = path_of(name)
    try:
        with open(path) as f:
            if int(json.load(f)["pid"]) != pid:
                return False
        os.unlink(path)
        return True
    except (OSError, ValueError, KeyError):
        return False


@contextlib.contextmanager
def _locked(name: str):
    lock = os.path.join(directory(), f"shared-{name}.lock")
    with lock_file(lock, LOCK_S, f"the shared loader name {name!r} ({lock})"):
        yield lock


def attach(name: str, timeout: float):
    """(connection, Hello, ring) of producer `name`, waiting up to `timeout` s for it to appear."""
    deadline, said = time.monotonic() + timeout, False
    while True:
        rec = read(name)
        if rec is not None:
            try:
                conn = connect(rec["address"], rec["secret"])
                break
            except OSError:  # starting or just gone: look again
                pass
        if time.monotonic() >= deadline:
            raise SharedLoaderError(
                f"no SharedLoader named {name!r} is serving on this node (waited {timeout:g} s for "
                f"{path_of(name)}): start it first (SharedLoader(loader, name={name!r}) or "
                f"`python -m fusionflow serve --name {name} ...`), or check the name"
            )
        if not said and time.monotonic() > deadline - timeout + 1.0:
            said = True
            log.warning("fusionflow: waiting up to %g s for SharedLoader %r to start", timeout, name)
        time.sleep(0.05)
    try:
        conn.send(("attach", os.getpid()))
        set_receive_timeout(conn, HANDSHAKE_S)
        kind, hello = conn.recv()
        ring = ReadOnlyRing(hello.layout, recv_fd(conn))
        set_receive_timeout(conn, 0)
        own_fd(conn.fileno())  # a child the script forks (a validation DataLoader's workers) closes its copy
        _CONNS.add(conn)
    except (OSError, EOFError, ValueError) as exc:
        conn.close()
        why = "it hung up: it is ending (it finished, failed or was closed)" if isinstance(exc, EOFError) else repr(exc)
        raise SharedLoaderError(
            f"SharedLoader {name!r} (pid {rec['pid']}) did not complete the attach: {why}"
        ) from None
    return conn, hello, ring


_CONNS = closed_in_foreign_children()  # this process's clients' connections


def release(conn, ring) -> None:
    """A client's end of the rendezvous: its connection and its ring mapping. The connection is shut down before
    it is closed: a copy a forked child still holds (one forked before this code closed them in such children, or
    by a fork the process made some other way) would keep it open, and the producer waiting for this client."""
    if not conn.closed:
        disown_fd(conn.fileno())
        hang_up(conn)
    conn.close()
    ring.close()


def read_only_fd(fd: int) -> int:
    """A new descriptor of the same (unlinked) shared-memory file, opened read-only: whoever gets it
    can map the ring for reading and not for writing."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class ReadOnlyRing:
    """A client's read-only mapping of a producer's ring: `images` and `labels` views (not writable)."""

    def __init__(self, layout: RingLayout, fd: int):
        try:
            self._map = mmap.mmap(fd, layout.nbytes, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        buf = np.frombuffer(self._map, np.uint8)
        shape = (layout.depth, layout.batch_size, *layout.sample_shape)
        self.images = buf[: layout.image_bytes].view(layout.dtype).reshape(shape)
        self.labels = buf[layout.image_bytes : layout.nbytes].view(np.int64).reshape(layout.depth, layout.batch_size)

    def close(self) -> None:
        self.images = self.labels = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported; the OS frees it at exit
                pass
            self._map = None
