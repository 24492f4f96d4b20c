"""The shared-memory batch ring: `depth` mini-batch slots that workers write samples into.

One POSIX shared-memory segment (posix_ipc) per loader, named ``/ff_<24 random hex>`` (not
guessable) and created with mode 0600. Layout, all C-contiguous:

    images  [depth, batch_size, *sample_shape]   policy's output dtype (uint8 or float32)
    labels  [depth, batch_size]                  int64

Reservation: the owner checks the free space of /dev/shm (statvfs) and then reserves every page of
the segment (posix_fallocate), so a ring that does not fit fails here, at creation, with a
`SharedMemoryError` naming the bytes needed and free and the fixes -- not later as a SIGBUS in a
worker that touches a page tmpfs cannot supply (ftruncate alone makes a sparse segment).

Ownership: the local manager creates it, keeps its descriptor and unlinks the name at once, as
torch's file-descriptor sharing strategy does: its own workers map the descriptor (inherited at
fork, or duplicated by multiprocessing for spawn/forkserver: `ChildFd`), workers lent to it receive
it over the lending socket (`send_fd`/`recv_fd`, SCM_RIGHTS). So no name is left in /dev/shm even
when the training process and its workers are SIGKILLed together; the memory goes with the last
process that maps it. (The global manager's table and the bridge ledger are still named: ranks
find them by name.)
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import socket
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import posix_ipc

from fusionflow.errors import SharedMemoryError

PREFIX = "/ff_"
SHM_DIR = "/dev/shm"  # where posix_ipc's segments live on Linux


@dataclass(frozen=True)
class RingLayout:
    depth: int
    batch_size: int
    sample_shape: tuple[int, ...]
    dtype: str

    @property
    def image_bytes(self) -> int:
        return self.depth * self.batch_size * int(np.prod(self.sample_shape)) * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.image_bytes + self.depth * self.batch_size * 8


class BatchRing:
    """A mapping of the ring segment; `images` and `labels` are numpy views into it.

    `BatchRing(layout)` creates and reserves the segment, unlinks its name at once and keeps its
    descriptor (`fd`) open: the descriptor goes to the processes that map it later (forked workers
    inherit it; lent workers receive it over their Unix socket), and no name is left in /dev/shm by a
    job killed, or interrupted (Ctrl-C) while the ring is being made.
    `BatchRing(layout, fd=fd)` maps a received descriptor; `BatchRing(layout, name)` attaches by name.
    """

    def __init__(self, layout: RingLayout, name: str | None = None, fd: int | None = None):
        self.layout = layout
        self.owner = name is None and fd is None
        self.fd = None
        if self.owner:
            name = PREFIX + secrets.token_hex(12)
            check_room(layout)
            seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=layout.nbytes)
            try:
                unlink(name)  # before anything that can fail or be interrupted: the descriptor is the handle
                reserve(seg.fd, layout)
            except BaseException:
                seg.close_fd()
                raise
            self.fd = seg.fd  # kept: the owner's handle (the name is gone)
            _OWNED_FDS.add(self.fd)
        elif fd is None:
            seg = posix_ipc.SharedMemory(name)
        self.name = name
        try:
            self._map = mmap.mmap(fd if fd is not None else seg.fd, layout.nbytes)
        except BaseException:
            self._map = None
            self.close()  # the owner's descriptor: nothing else refers to the segment
            raise
        finally:
            if fd is None and not self.owner:
                seg.close_fd()
        buf = np.frombuffer(self._map, np.uint8)
        shape = (layout.depth, layout.batch_size, *layout.sample_shape)
        self.images = buf[: layout.image_bytes].view(layout.dtype).reshape(shape)
        self.labels = buf[layout.image_bytes : layout.nbytes].view(np.int64).reshape(layout.depth, layout.batch_size)

    def close(self) -> None:
        """Drop this process's mapping and descriptor (views must not be used afterwards)."""
        self.images = self.labels = None
        if self.fd is not None:
            _OWNED_FDS.discard(self.fd)
            os.close(self.fd)
            self.fd = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported (e.g. a pinned tensor); the OS frees it at exit
                pass
            self._map = None


_OWNED_FDS: set[int] = set()  # this process's ring, cache and helper descriptors, closed in any forked child


def own_fd(fd: int) -> None:
    """A descriptor of this process that forked workers must not keep (they close it in
    `map_from_child_fd`): e.g. a decoded-image cache's segment and keeper socket, which a worker of
    another loader would otherwise keep alive."""
    _OWNED_FDS.add(fd)


def disown_fd(fd: int) -> None:
    _OWNED_FDS.discard(fd)


class ChildFd:
    """A ring descriptor for a worker process: a forked child uses the (inherited) number itself; a
    spawn/forkserver child gets a duplicate through multiprocessing's own fd passing, which happens
    while the Process object is pickled at start()."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup) -> ChildFd:
    return ChildFd(dup.detach())


def map_from_child_fd(layout: RingLayout, child_fd: ChildFd) -> BatchRing:
    """In a worker: map the ring from the descriptor it was handed, then close every ring
    descriptor inherited from the parent (its own included: the mapping keeps the memory), so a
    worker never keeps another loader's ring alive."""
    ring = BatchRing(layout, fd=child_fd.fd)
    close_owned_fds(child_fd.fd)
    return ring


_OUR_FORKS = [0, threading.Lock()]  # forks FusionFlow is making now: its children close what they inherit themselves
_ON_FOREIGN_FORK: list = []  # callables run first in the child of a fork FusionFlow did not make


@contextlib.contextmanager
def forking_ours():
    """Around FusionFlow's own fork of a worker or helper (they close the owned descriptors they do not need)."""
    with _OUR_FORKS[1]:
        _OUR_FORKS[0] += 1
    try:
        yield
    finally:
        with _OUR_FORKS[1]:
            _OUR_FORKS[0] -= 1


def on_foreign_fork(closer) -> None:
    """Run `closer()` in the child of every fork FusionFlow does not make, before the owned descriptors close."""
    _ON_FOREIGN_FORK.append(closer)


def _after_fork_in_child() -> None:
    """A child the script forks (its own helper, another library's workers) keeps nothing of the loaders': the
    owned descriptors (a cache's segment, its keeper's socket, the input helpers' memory) would keep them alive."""
    if _OUR_FORKS[0]:
        return
    _OUR_FORKS[1] = threading.Lock()  # (a lock held by another thread at the fork stays held in the child)
    for closer in _ON_FOREIGN_FORK:
        closer()
    close_owned_fds()


os.register_at_fork(after_in_child=_after_fork_in_child)


def closed_in_foreign_children() -> weakref.WeakSet:
    """A set for this process's open connections (multiprocessing Connections) to a FusionFlow process: the child of
    a fork FusionFlow did not make closes its inherited copies of them (the parent's stay open), through their
    Connection objects, which then know it. A copy kept open would keep the peer counting a process that closed
    or died (a SharedLoader's producer its client, a keeper its loader), for as long as the child lived."""
    conns: weakref.WeakSet = weakref.WeakSet()

    def close_in_child() -> None:
        for conn in list(conns):
            if not conn.closed:
                disown_fd(conn.fileno())  # closed here: a worker's close_owned_fds must not close its reused number
                conn.close()
        conns.clear()

    on_foreign_fork(close_in_child)
    return conns


def close_owned_fds(*more: int) -> None:
    """In a forked child: close the ring (and cache) descriptors inherited from the parent, and `more`."""
    for fd in _OWNED_FDS | set(more):
        try:
            os.close(fd)
        except OSError:
            pass
    _OWNED_FDS.clear()


def send_fd(conn, fd: int) -> None:
    """Send descriptor `fd` over a multiprocessing Connection on a Unix socket (SCM_RIGHTS)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        socket.send_fds(sock, [b"F"], [fd])


def recv_fd(conn) -> int:
    """Receive one descriptor sent with `send_fd` (the caller closes it)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise OSError(f"expected one ring descriptor from the borrower, got {len(fds)}")
    return fds[0]


def free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes an unprivileged process may still allocate under `path` (None: no such directory)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def _too_small(layout: RingLayout, free: int | None, why: str = "") -> SharedMemoryError:
    have = f"{SHM_DIR} has {_mb(free)} free" if free is not None else f"the free space of {SHM_DIR} is unknown"
    if why:
        have = f"{why}; {have}"
    return SharedMemoryError(
        f"the shared-memory batch ring needs {_mb(layout.nbytes)} (prefetch_factor={layout.depth} x "
        f"batch_size={layout.batch_size} samples of shape {layout.sample_shape} {layout.dtype}) but {have}. "
        f"Fixes: give the container a larger {SHM_DIR} (docker run --shm-size=2g, docker compose shm_size, "
        f"Kubernetes: an emptyDir with medium: Memory mounted at {SHM_DIR}), or lower batch_size or "
        f"prefetch_factor, or free space in {SHM_DIR} (`ls -l {SHM_DIR}`: segments of dead jobs)."
    )


def check_room(layout: RingLayout) -> None:
    """Fail before creating anything when /dev/shm cannot hold the ring."""
    free = free_bytes()
    if free is not None and free < layout.nbytes:
        raise _too_small(layout, free)


def reserve(fd: int, layout: RingLayout) -> None:
    """Allocate every page of the segment now (tmpfs honours posix_fallocate), so running out of
    shared memory is an error here and never a SIGBUS in a worker."""
    try:
        allocate(fd, 0, layout.nbytes)
    except OSError as exc:
        raise _too_small(layout, free_bytes(), f"reserving it failed ({exc.strerror})") from None


def allocate(fd: int, offset: int, length: int) -> None:
    """posix_fallocate of [offset, offset + length); nothing where there is none (not Linux) or the
    filesystem cannot (then the file stays sparse); OSError when the pages cannot be had."""
    if length <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def sigbus_error(who: str, nbytes: int) -> SharedMemoryError:
    """What a process that died of SIGBUS means: shared memory the system could not back."""
    return SharedMemoryError(
        f"{who} died of SIGBUS: a process touched shared memory that could not be backed (the batch ring "
        f"needs {nbytes} bytes; {SHM_DIR} has {free_bytes()} bytes free now). This is not the fault of a "
        f"sample. Give the container a larger {SHM_DIR} (docker run --shm-size=2g) or lower batch_size or "
        "prefetch_factor."
    )
