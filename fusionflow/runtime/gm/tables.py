"""The global manager's tables: one POSIX shared-memory segment per job and node, mode 0600.

    header                          magic, state, the GM's pid, the job's secret
    progress[MAX_LMS]  (LMs write)  per local manager: pid, iteration, Waiting tiny-batches, the start
                                    times of its Active ones (+ its mean tiny-batch time, so readers
                                    turn them into fractions done), idle/own/lent/borrowed workers,
                                    its listening address and ring name
    action[MAX_LMS]    (GM writes)  per local manager: a Yield order (lend Count workers to a peer),
                                    with a sequence number the lender acknowledges; a Borrow notice
                                    (Count workers are coming from a peer), a record for `gm status`
                                    (the borrower learns of guests from their connections); the
                                    elastic worker target

Name: ``/ff_gm_<sha256(job, uid)[:20]>`` (`table_name`): every loader of one job on one node finds the
same table. Whoever creates the segment (O_CREX) initialises it and writes the magic last; others wait
for the magic. Registration (claiming a row) and the GM's decision to exit hold an flock on the
segment, so a loader never registers into a table its GM is about to unlink.

Readers and writers never lock rows: every field is a naturally aligned scalar, a reader may see a
row mid-update and acts on it only through rules that tolerate one stale poll (a lender lends at
most the workers it has idle when the order arrives; sequence numbers are written last).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import secrets
import time
from contextlib import contextmanager

import numpy as np
import posix_ipc

from fusionflow.runtime.cores import local_ranks
from fusionflow.runtime.gm.timing import GM_SILENT_S, START_S
from fusionflow.runtime.procs import is_stopped, pid_alive
from fusionflow.runtime.shm import SHM_DIR, unlink
from fusionflow.runtime.userdir import flock_within

PREFIX = "/ff_gm_"
MAGIC = 0x46_46_47_4D_0004  # "FFGM" v4 (layout changes bump it; 4: the job's name in the header)
MAX_LMS = 64
MAX_ACTIVE = 64
LOCK_S = 10.0  # the longest anyone waits for the table's lock (its holder stopped)
FREE, ACTIVE = 0, 1  # progress row states
CLOSING = 1  # header state (0: open)

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("state", "<i4"),
        ("gm_pid", "<i8"),
        ("created", "<f8"),
        ("secret", "S32"),
        ("registered_total", "<i8"),
        ("target_seq", "<i8"),
        ("target_workers", "<i4"),
        ("gm_heartbeat", "<f8"),  # CLOCK_MONOTONIC of the GM's latest poll (0: none yet)
        ("job", "S192"),  # the job's name (global_manager=, or job_key's under torchrun): `gm status` lists them
        ("pid_ns", "<u8"),  # its creator's PID namespace: pids in the table mean something only there
    ],
    align=True,
)  # job-wide elastic target
PROGRESS = np.dtype(
    [
        ("state", "<i4"),
        ("pid", "<i8"),
        ("heartbeat", "<f8"),
        ("reg", "<i8"),  # registration number: tells a reused row's new LM from the old one
        ("iteration", "<i8"),  # mini-batches completed so far
        ("waiting", "<i4"),  # tiny-batches queued, not yet started, that CPU workers may take
        ("n_active", "<i4"),
        ("active_since", "<f8", (MAX_ACTIVE,)),  # CLOCK_MONOTONIC start of each running one
        ("task_seconds", "<f8"),  # running mean of one tiny-batch's time (0: none finished yet)
        ("idle", "<i4"),
        ("workers", "<i4"),
        ("lent", "<i4"),
        ("guests", "<i4"),
        ("guests_total", "<i8"),  # borrowed workers ever accepted
        ("lent_total", "<i8"),  # own workers ever lent
        ("can_borrow", "<i1"),
        ("listening", "<i1"),  # 1 once its manager thread serves `address` (written after the address)
        ("address", "S80"),
        ("ring", "S40"),
    ],
    align=True,
)
ACTION = np.dtype(
    [
        ("yield_seq", "<i8"),
        ("yield_peer", "<i4"),
        ("yield_count", "<i4"),  # GM writes
        ("yield_ack", "<i8"),
        ("yield_done", "<i4"),  # LM writes: seq handled, workers actually lent
        ("borrow_seq", "<i8"),
        ("borrow_peer", "<i4"),
        ("borrow_count", "<i4"),  # GM writes
        ("target_seq", "<i8"),
        ("target_workers", "<i4"),  # elastic capacity (GM API writes)
    ],
    align=True,
)


def job_key() -> str | None:
    """The job this process belongs to under torchrun (None outside torchrun or with one local rank)."""
    if local_ranks() <= 1:
        return None
    return "torchrun:{}:{}:{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    )


def pid_namespace() -> int:
    """This process's PID namespace (0 if unknown): containers sharing /dev/shm need not share pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def table_names() -> list[str]:
    """The global-manager tables' names in /dev/shm (every user's)."""
    try:
        return ["/" + n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX.lstrip("/"))]
    except OSError:
        return []


def jobs_on_this_node() -> dict[str, str]:
    """{job name: table name} of this user's global-manager tables on the node (those it can open)."""
    out = {}
    for name in table_names():
        try:
            t = Tables.attach(name, timeout=0.0)
        except Exception:  # another user's (0600), another layout's (an older FusionFlow's), or not yet made
            continue
        if t is not None:
            try:
                if int(t.header["state"][0]) != CLOSING and not t.left_over():
                    out[bytes(t.header["job"][0]).decode(errors="replace")] = t.name
            finally:
                t.close()
    return out


def table_name(job: str) -> str:
    return PREFIX + hashlib.sha256(f"{job}\0{os.getuid()}".encode()).hexdigest()[:20]


def _layout():
    off_p = HEADER.itemsize
    off_a = off_p + MAX_LMS * PROGRESS.itemsize
    return off_p, off_a, off_a + MAX_LMS * ACTION.itemsize


class Tables:
    """A mapping of a job's tables. `create` or `attach`; `close` drops the mapping, `unlink` the name."""

    def __init__(self, name: str, seg: posix_ipc.SharedMemory):
        off_p, off_a, size = _layout()
        self.name, self._fd = name, seg.fd
        self._map = mmap.mmap(seg.fd, size)
        buf = np.frombuffer(self._map, np.uint8)
        self.header = buf[: HEADER.itemsize].view(HEADER)[0:1]
        self.progress = buf[off_p:off_a].view(PROGRESS)
        self.action = buf[off_a:size].view(ACTION)

    @classmethod
    def create(cls, name: str, job: str = "") -> Tables | None:
        """Create and initialise the segment (`job`: the name it is the table of); None if it already exists."""
        try:
            seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=_layout()[2])
        except posix_ipc.ExistentialError:
            return None
        t = cls(name, seg)
        h = t.header[0]
        h["created"] = time.time()
        h["secret"] = secrets.token_hex(16).encode()
        h["job"] = job.encode()[: HEADER["job"].itemsize]
        h["pid_ns"] = pid_namespace()
        t.header["magic"] = MAGIC  # last: attachers wait for it
        return t

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> Tables | None:
        """Map an existing segment once its creator has initialised it; None if there is none."""
        try:
            seg = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            return None
        if seg.size < _layout()[2]:  # its creator has not sized it yet
            deadline = time.monotonic() + timeout
            while os.fstat(seg.fd).st_size < _layout()[2]:
                if time.monotonic() > deadline:
                    seg.close_fd()
                    raise TimeoutError(f"global-manager table {name} was never sized")
                time.sleep(0.005)
        t = cls(name, seg)
        deadline = time.monotonic() + timeout
        while int(t.header["magic"][0]) != MAGIC:
            if time.monotonic() > deadline:
                t.close()
                raise TimeoutError(f"global-manager table {name} was never initialised (magic missing)")
            time.sleep(0.005)
        return t

    @contextmanager
    def locked(self):
        """The table's lock (held for microseconds), waited for at most LOCK_S: a holder stopped with
        SIGSTOP costs each caller what it wanted the lock for (TimeoutError, an OSError), never its run."""
        flock_within(self._fd, LOCK_S, f"the global-manager table {self.name}")
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def secret(self) -> bytes:
        return bytes(self.header["secret"][0])

    @property
    def removed(self) -> bool:
        """Whether this mapping's segment has been unlinked (its job's GM has ended; a new one makes another)."""
        return os.fstat(self._fd).st_nlink == 0

    @property
    def gm_pid(self) -> int:
        return int(self.header["gm_pid"][0])

    def register(self, pid: int) -> int | None:
        """Claim a free progress row for a local manager; None if the table is closing or full."""
        with self.locked():
            if int(self.header["state"][0]) == CLOSING:
                return None
            for lm in range(MAX_LMS):
                row = self.progress[lm]
                if row["state"] == FREE:
                    self.progress[lm] = np.zeros((), PROGRESS)
                    self.action[lm] = np.zeros((), ACTION)
                    self.header["registered_total"] += 1
                    row["pid"] = pid
                    row["reg"] = int(self.header["registered_total"][0])
                    row["heartbeat"] = time.monotonic()
                    row["state"] = ACTIVE
                    return lm
        return None

    def active_rows(self) -> list[int]:
        return np.flatnonzero(self.progress["state"] == ACTIVE).tolist()

    def reclaim_dead(self) -> list[int]:
        """Free the rows of LMs whose process is gone, and unlink their rings' names if any were left (lock held)."""
        dead = [lm for lm in self.active_rows() if not pid_alive(int(self.progress[lm]["pid"]))]
        for lm in dead:
            ring = bytes(self.progress[lm]["ring"]).decode()
            if ring:
                unlink(ring)
            self.progress[lm]["state"] = FREE
        return dead

    def gm_alive(self) -> bool:
        """The GM is running (its process lives, is not stopped, and its heartbeat is recent), or was spawned and has
        not claimed the table yet."""
        pid = self.gm_pid
        if pid:
            return pid_alive(pid) and not is_stopped(pid) and self.gm_silent_s() < GM_SILENT_S
        return time.time() - float(self.header["created"][0]) < START_S

    def left_over(self) -> bool:
        """Its GM is gone and no loader is registered: no job runs on it, and the job's next loader replaces it
        (link.py `unlink_if_stale`), so a worker target written into it would be lost."""
        return not self.gm_exists() and not self.active_rows()

    def gm_silent_s(self) -> float:
        """Seconds since the GM's latest poll (0 before its first: the pid and START_S judge then)."""
        beat = float(self.header["gm_heartbeat"][0])
        return time.monotonic() - beat if beat else 0.0

    def close(self) -> None:
        self.header = self.progress = self.action = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        """Remove the table's name -- only while it still names this mapping's segment: a later job's loader may
        have replaced a table it judged stale by a new one under the same name, which must stay findable."""
        if self._fd is None:
            return
        try:
            named = os.stat(os.path.join(SHM_DIR, self.name.lstrip("/")))
        except FileNotFoundError:
            return
        mine = os.fstat(self._fd)
        if (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino):
            unlink(self.name)

    def gm_exists(self) -> bool:
        """The GM serves (`gm_alive`), or its process is stopped (SIGSTOP, a debugger's ptrace) rather than dead: the
        table is a job's, not a stale one. (A live pid with a silent heartbeat that is not stopped is taken for a
        pid reused since the GM died.)"""
        return self.gm_alive() or (self.gm_pid != 0 and is_stopped(self.gm_pid))
