"""A local manager's seat at its job's global-manager table (runtime/gm/tables.py).

Joining: create the job's table (and spawn the GM, runtime/gm/manager.py) or attach to it,
claim a progress row, and listen on an abstract Unix socket (no file; gone with the process) whose
address is published in the row. Workers lent to this LM connect there and authenticate with the
job's secret (HMAC challenge, multiprocessing.connection), which only the table's 0600 segment holds.

The spec (`make_spec`): the loader's dataset, policy, worker_init_fn and its decoded-image cache's max_side
(a cached sample's rendering), pickled once per loader,
sent to a lent worker that does not have them yet (workers cache specs by hash, run the
worker_init_fn once per spec, and a worker whose owner has the same spec uses its own). If they do
not pickle, borrowing is off for this loader (`can_borrow` = 0, logged once); it still lends.

Release (`close`, from the LM's shutdown): free the row, close the socket; reclaim rows of LMs
that died; if the GM is gone and no LM is left, unlink the table (the GM would have).

Forked children inherit the listening socket; `close_inherited` (first thing in a worker) closes
it there, so a loader that has shut down never leaves a socket that accepts connections nobody
serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from fusionflow.runtime import messages as m
from fusionflow.runtime.authsock import accept, connect, listen, set_receive_timeout  # noqa: F401 (re-exported)
from fusionflow.runtime.gm import tables as gt
from fusionflow.runtime.gm.timing import GM_SILENT_S, GM_START_S, LIVENESS_S
from fusionflow.runtime.procs import command_line, is_stopped, pid_alive

log = logging.getLogger(__name__)
_LISTENERS: set[int] = set()  # fds of this process's listening sockets


def spawn(name: str) -> subprocess.Popen:
    """Start the GM (runtime/gm/manager.py) for table `name` in its own session, so no rank's exit
    or Ctrl-C takes it down. It runs as its own program, so nothing here imports the GM's module."""
    return subprocess.Popen(
        [sys.executable, "-m", "fusionflow.runtime.gm.manager", name],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def sweep_stale_tables(keep: str) -> None:
    """Remove other jobs' tables that every process of theirs left -- the GM's and each loader's, as when a job is
    SIGKILLed as a whole (OOM killer, scancel): only the GM unlinks a table otherwise. Run as a loader joins. Left
    alone: a table of another user, of another layout (an older FusionFlow's), not yet made, just made (its GM
    starting: `gm_exists`), or made in another PID namespace (a container sharing /dev/shm but not pids: its
    processes' pids mean nothing here)."""
    ns = gt.pid_namespace()
    for name in gt.table_names():
        if name == keep:
            continue
        try:
            t = gt.Tables.attach(name, timeout=0.0)
        except Exception:  # not ours to read, or not a table of this layout: not judged
            continue
        if t is None:
            continue
        try:
            if int(t.header["pid_ns"][0]) != ns:
                continue
            with t.locked():
                t.reclaim_dead()  # rows of loaders whose process is gone (and their rings' names)
            GMLink.unlink_if_stale(t)  # then the rule a joining loader applies to its own job's table
        except Exception:  # its lock held by a stopped process, or a table of another layout: left alone
            pass
        finally:
            t.close()


def close_inherited() -> None:
    """In a forked child: close the listening sockets inherited from the parent's loaders."""
    for fd in list(_LISTENERS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LISTENERS.clear()


def make_spec(dataset, policy, worker_init_fn, cache_side: int | None = None, warn: bool = True) -> bytes | None:
    """What a lent worker needs to run this loader's samples, pickled; None (logged if `warn`: a loader says it once,
    not at each epoch's start) if it does not pickle. `cache_side`: the loader's decoded-image cache's max_side, or
    None: a lent worker whose own spec differs renders the samples as a cached sample is rendered (CacheRendering),
    or uncached."""
    try:
        return pickle.dumps(m.Spec(dataset, policy, worker_init_fn, cache_side), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        if not warn:
            return None
        log.warning(
            "fusionflow: this loader's dataset, policy or worker_init_fn cannot be pickled (%r), so "
            "workers lent by other ranks cannot run its samples; it still lends its own idle workers",
            exc,
        )
        return None


class GMLink:
    def __init__(self, job: str, ring_name: str, spec: bytes | None):
        self.job, self.name = job, gt.table_name(job)
        self.gm_proc = None
        self.tables, self.lm = self._join()
        self.joined_at = time.monotonic()
        self.gm_lost = False
        self._checked_at = self.joined_at  # the latest look at the GM
        self._resumed_at = -math.inf  # when this process ran again after a pause (check_gm)
        self.yield_seen = 0
        self.target_seen = (0, 0)  # (own, job-wide) target sequence numbers applied
        self.spec = spec
        self.spec_hash = hashlib.sha256(spec).digest()[:16] if spec is not None else None
        self.address = f"ff-{self.name[len(gt.PREFIX) :]}-{self.lm}-{secrets.token_hex(6)}"
        try:
            self.listener = listen(self.address)
        except BaseException:  # give the row back: an ACTIVE row of a live pid would keep the GM up
            with contextlib.suppress(OSError), self.tables.locked():  # (else reclaimed when this process exits)
                self.tables.progress[self.lm]["state"] = gt.FREE
            self.tables.close()
            raise
        _LISTENERS.add(self.listener.fileno())
        row = self.tables.progress[self.lm]
        row["address"] = self.address.encode()
        row["ring"] = ring_name.encode()
        row["can_borrow"] = self.spec is not None
        # `listening` stays 0 until the LM's manager thread serves the socket (`serving`): a GM or a
        # lent worker knocking earlier would wait out its handshake timeout while workers start

    def _join(self):
        sweep_stale_tables(self.name)
        for _ in range(500):  # a closing GM unlinks its table within its linger time
            t = created = gt.Tables.create(self.name, self.job)
            if t is not None:
                self.gm_proc = spawn(self.name)
            else:
                t = gt.Tables.attach(self.name)
                if t is None:
                    continue  # unlinked between our create and attach: try again
            try:
                if created is None and self.unlink_if_stale(t):
                    continue
                if created is None and self._gm_died(t):
                    self.gm_proc = spawn(self.name)  # claims the table: lending comes back for loaders joining now
                lm = t.register(os.getpid())
            except TimeoutError:  # the table's lock held by a stopped process (tables.LOCK_S)
                t.close()
                raise
            if lm is not None:
                return t, lm
            full = int(t.header["state"][0]) != gt.CLOSING
            t.close()
            if full:
                raise ValueError(
                    f"the global manager of job {self.job!r} already serves {gt.MAX_LMS} loaders; "
                    "close loaders you no longer use, or pass global_manager=None"
                )
            time.sleep(0.01)  # its GM is closing: a new table comes next (until then, register says no)
        raise TimeoutError(f"could not join the global-manager table {self.name}")

    @staticmethod
    def unlink_if_stale(t: gt.Tables) -> bool:
        """A table left by an earlier job under the same name whose GM died (e.g. torchrun reusing a
        run id and port): unlink it so this job starts its own. Closes `t` if so. A GM that exists but is stopped
        (a debugger's pause, py-spy) is not a dead one: its job's loaders would be split over two tables -- unless
        it was closing (no loader left to split) when it stopped: its table would hold every later loader of the
        job in `_join`'s retries (5 s a start) for as long as it stays stopped."""
        with t.locked():
            closing = int(t.header["state"][0]) == gt.CLOSING and is_stopped(t.gm_pid)
            stale = (closing or not t.gm_exists()) and not t.active_rows()
            if stale:
                t.header["state"] = gt.CLOSING
                t.unlink()
        if stale:
            log.info("fusionflow: removed a stale global-manager table %s (its GM is gone)", t.name)
            t.close()
        return stale

    def _gm_died(self, t: gt.Tables) -> bool:
        """A live job's table (loaders registered) whose GM died -- killed, out of memory -- not merely stopped:
        made to look as a table just created (its GM starting), and True: the caller starts another GM. The
        loaders that saw the old one gone train on alone; those joining from now on lend and borrow again."""
        with t.locked():
            old, here = t.gm_pid, int(t.header["pid_ns"][0]) == gt.pid_namespace()  # (else its pids mean nothing)
            dead = here and old != 0 and not pid_alive(old)  # (a live one merely silent might come back: two GMs)
            if dead:
                t.header["gm_pid"], t.header["gm_heartbeat"], t.header["created"] = 0, 0.0, time.time()
        if dead:
            log.warning("fusionflow: the global manager of job %r (pid %d) is gone; starting another", self.job, old)
        return dead

    # ---------------------------------------------------------------- guests
    def accept(self) -> Connection | None:
        """A lent worker knocking: authenticate it (both ways) and return its connection."""
        return accept(self.listener, self.tables.secret, "this loader's lending socket")

    # ---------------------------------------------------------------- the tables
    def serving(self) -> None:
        """Called by the manager thread once it waits on the socket: peers may connect now."""
        self.tables.progress[self.lm]["listening"] = 1

    def publish(self, **fields) -> None:
        row = self.tables.progress[self.lm]
        active = fields.pop("active_since", None)
        if active is not None:
            n = min(len(active), gt.MAX_ACTIVE)
            row["active_since"][:n] = active[:n]
            row["n_active"] = n
        for key, value in fields.items():
            row[key] = value
        row["heartbeat"] = time.monotonic()

    def disable_borrowing(self) -> None:
        self.tables.progress[self.lm]["can_borrow"] = 0

    def yield_order(self) -> tuple[int, int, int] | None:
        """A new Yield order (seq, peer, count), or None."""
        a = self.tables.action[self.lm]
        seq = int(a["yield_seq"])
        if seq <= self.yield_seen:
            return None
        self.yield_seen = seq
        return seq, int(a["yield_peer"]), int(a["yield_count"])

    def ack_yield(self, seq: int, done: int) -> None:
        a = self.tables.action[self.lm]
        a["yield_done"] = done
        a["yield_ack"] = seq  # last: the GM reads done only once the ack shows

    def peer_address(self, peer: int) -> str | None:
        row = self.tables.progress[peer] if 0 <= peer < gt.MAX_LMS else None
        if row is None or row["state"] != gt.ACTIVE or not row["listening"]:
            return None
        return bytes(row["address"]).decode() or None

    def target(self) -> int | None:
        """A new elastic worker target (for this LM, or job-wide: whichever was set last), or None."""
        a, h = self.tables.action[self.lm], self.tables.header[0]
        own, job = (int(a["target_seq"]), int(a["target_workers"])), (int(h["target_seq"]), int(h["target_workers"]))
        new_own, new_job = own[0] > self.target_seen[0], job[0] > self.target_seen[1]
        self.target_seen = (own[0], job[0])
        if new_own and new_job:  # both set since the last look: their numbers say which was last (set_workers)
            return own[1] if own[0] > job[0] else job[1]
        return own[1] if new_own else job[1] if new_job else None

    def check_gm(self) -> bool:
        """Whether the GM is (still, or not yet known not to be) there; reports its loss once."""
        if self.gm_lost:
            return False
        now = time.monotonic()
        if now - self._checked_at < LIVENESS_S:  # looking at /proc every poll would cost more than it tells
            return True
        gap, self._checked_at = now - self._checked_at, now
        if gap > GM_SILENT_S / 2:  # this process did not run (the whole job stopped, resumed): the GM neither, so
            self.joined_at += gap  # its start and its silence count from the resume
            self._resumed_at = now
            return True
        pid = self.tables.gm_pid
        if pid == 0 and now - self.joined_at < GM_START_S:
            return True
        silent = min(self.tables.gm_silent_s(), now - self._resumed_at)
        if pid and pid_alive(pid) and silent < GM_SILENT_S:
            return True
        self.gm_lost = True
        self.disable_borrowing()  # a GM started later for the job (`_gm_died`) sends this loader no workers
        why = (
            "never started" if not pid else f"pid {pid}" if not pid_alive(pid) else f"pid {pid}, silent {silent:.0f} s"
        )
        log.warning(
            "fusionflow: the global manager of this job (%s) is gone; this loader keeps training with "
            "its own workers, without lending or borrowing",
            why,
        )
        return False

    def close(self) -> None:
        if self.tables is None:
            return
        t, self.tables = self.tables, None
        _LISTENERS.discard(self.listener.fileno())
        self.listener.close()
        try:
            orphaned = self._leave(t)
        except TimeoutError as exc:  # our row stays ACTIVE: the GM frees it once this process has exited
            orphaned = gm_gone = False
            # a stopped GM most likely holds the lock (it takes it 4 times a second) and serves no loader: ended, its
            # death frees the lock (else the job's last loader out left it and its table for good)
            if t.gm_pid and is_stopped(t.gm_pid) and self._end_silent_gm(t.gm_pid):
                with contextlib.suppress(TimeoutError):
                    orphaned, gm_gone = self._leave(t), True
            if not gm_gone:
                log.warning("fusionflow: %s; left without freeing this loader's row", exc)
        else:
            gm_gone = not t.gm_alive()
        if orphaned and (self.gm_proc is None or self.gm_proc.poll() is not None or gm_gone):
            t.unlink()
            if gm_gone:
                self._end_silent_gm(t.gm_pid)
        t.close()
        if self.gm_proc is not None and self.gm_proc.poll() is None:  # it lingers for the job's next loader: reaped
            threading.Thread(target=self.gm_proc.wait, name="fusionflow-gm-reaper", daemon=True).start()  # as it exits

    def _end_silent_gm(self, pid: int) -> bool:
        """The last loader out of a job whose GM is stopped or fell silent (hung) ends it: a stopped
        process never goes by itself, and no loader is left to need it. Only that job's GM process (one started by
        a loader, not by `gm serve`); whether it was ended here."""
        args = command_line(pid)  # [] once gone
        if not pid_alive(pid) or "fusionflow.runtime.gm.manager" not in args or self.name not in args:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            log.warning("fusionflow: ended this job's global manager (pid %d): stopped or silent", pid)
        if self.gm_proc is not None and self.gm_proc.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.gm_proc.wait(timeout=5.0)
        return True

    def _leave(self, t) -> bool:
        """Free our row (lock held); whether the table is orphaned and closing, for us to unlink."""
        with t.locked():
            t.progress[self.lm]["state"] = gt.FREE
            spawned_gone = self.gm_proc is not None and self.gm_proc.poll() is not None
            # a GM spawned for the table but not started yet (within START_S of it) claims it, lingers and closes it
            # itself: marking it CLOSING here held every loader joining meanwhile (the next epoch's, without
            # persistent workers; the loop after a `next(iter(loader))` peek) in `_join` until the GM's linger ended,
            # 2 s, or past its retries (lending lost for the run). Ours, gone without claiming it: not waited for.
            starting = t.gm_pid == 0 and t.gm_alive() and not spawned_gone
            unclaimed_and_empty = t.gm_pid == 0 and not t.active_rows() and not starting
            gm_gone = not t.gm_alive()  # dead, or silent for GM_SILENT_S (stopped, hung)
            orphaned = spawned_gone or unclaimed_and_empty or gm_gone
            if orphaned:  # nobody reclaims dead LMs' rows and rings if we do not
                t.reclaim_dead()
                orphaned = not t.active_rows()
            if orphaned:
                t.header["state"] = gt.CLOSING
        return orphaned
