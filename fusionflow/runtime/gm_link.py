"""A local manager's seat at its job's global-manager table (runtime/gm_tables.py).

Joining: create the job's table (and spawn the GM, runtime/global_manager.py) or attach to it,
claim a progress row, and listen on an abstract Unix socket (no file; gone with the process) whose
address is published in the row. Workers lent to this LM connect there and authenticate with the
job's secret (HMAC challenge, multiprocessing.connection), which only the table's 0600 segment holds.

The spec: this LM's dataset and policy, pickled once at join, sent to a lent worker that does not
have them yet (workers cache specs by hash, and a worker whose owner has the same spec uses its
own). A dataset that does not pickle disables borrowing for this LM (`can_borrow` = 0, logged once);
it still lends.

Release (`close`, from the LM's shutdown): free the row, close the socket; if the GM is gone and
no LM is left, unlink the table (the GM would have).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import secrets
import socket
import struct
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from fusionflow.runtime import gm_tables as gt

log = logging.getLogger(__name__)
GM_START_S = 10.0  # a GM that has not shown up by then is reported lost
HANDSHAKE_S = 2


class GMLink:
    def __init__(self, job: str, ring_name: str, dataset, policy):
        self.job, self.name = job, gt.table_name(job)
        self.gm_proc = None
        self.tables, self.lm = self._join()
        self.joined_at = time.monotonic()
        self.gm_lost = False
        self._checked_at = 0.0
        self.yield_seen = self.target_seen = 0
        try:
            self.spec = pickle.dumps((dataset, policy), protocol=pickle.HIGHEST_PROTOCOL)
            self.spec_hash = hashlib.sha256(self.spec).digest()[:16]
        except Exception as exc:
            log.warning("fusionflow: this loader's dataset or policy cannot be pickled (%r), so workers lent by "
                        "other ranks cannot run its samples; it still lends its own idle workers", exc)
            self.spec, self.spec_hash = None, None
        self.address = f"ff-{self.name[len(gt.PREFIX):]}-{self.lm}-{secrets.token_hex(6)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(64)
        self.listener.setblocking(False)
        row = self.tables.progress[self.lm]
        row["address"] = self.address.encode()
        row["ring"] = ring_name.encode()
        row["can_borrow"] = self.spec is not None

    def _join(self):
        for _ in range(50):
            t = gt.Tables.create(self.name)
            if t is not None:
                from fusionflow.runtime.global_manager import spawn
                self.gm_proc = spawn(self.name)
            else:
                t = gt.Tables.attach(self.name)
                if t is None:
                    continue  # unlinked between our create and attach: try again
                if self._stale(t):
                    continue
            lm = t.register(os.getpid())
            if lm is not None:
                return t, lm
            full = int(t.header["state"][0]) != gt.CLOSING
            t.close()
            if full:
                raise ValueError(f"the global manager of job {self.job!r} already serves {gt.MAX_LMS} loaders; "
                                 "close loaders you no longer use, or pass global_manager=None")
            time.sleep(0.01)  # its GM is closing: a new table comes next
        raise TimeoutError(f"could not join the global-manager table {self.name}")

    @staticmethod
    def _stale(t: gt.Tables) -> bool:
        """A table left by an earlier job under the same name whose GM died (e.g. torchrun reusing a
        run id and port): unlink it so this job starts its own. Closes `t` if so."""
        from fusionflow.runtime.global_manager import START_S
        with t.locked():
            pid = t.gm_pid
            dead = (pid and not gt.pid_alive(pid)) or (not pid and time.time() - float(t.header["created"][0]) > START_S)
            stale = dead and not t.active_rows()
            if stale:
                t.header["state"] = gt.CLOSING
                t.unlink()
        if stale:
            log.info("fusionflow: removed a stale global-manager table %s (its GM is gone)", t.name)
            t.close()
        return stale

    # ---------------------------------------------------------------- guests
    def accept(self) -> Connection | None:
        """A lent worker knocking: authenticate it (both ways) and return its connection."""
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        try:
            sock.setblocking(True)
            timeout = struct.pack("ll", HANDSHAKE_S, 0)  # a stalled peer cannot hang the manager thread
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            conn = Connection(sock.detach())
            secret = self.tables.secret
            deliver_challenge(conn, secret)
            answer_challenge(conn, secret)
        except Exception as exc:
            log.warning("fusionflow: refused a connection to this loader's lending socket: %r", exc)
            try:
                conn.close()
            except NameError:
                sock.close()
            return None
        s = socket.socket(fileno=os.dup(conn.fileno()))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        s.close()
        return conn

    # ---------------------------------------------------------------- the tables
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
        if not 0 <= peer < gt.MAX_LMS or self.tables.progress[peer]["state"] != gt.ACTIVE:
            return None
        return bytes(self.tables.progress[peer]["address"]).decode() or None

    def target(self) -> int | None:
        """A new elastic worker target, or None."""
        a = self.tables.action[self.lm]
        seq = int(a["target_seq"])
        if seq <= self.target_seen:
            return None
        self.target_seen = seq
        return int(a["target_workers"])

    def check_gm(self) -> bool:
        """Whether the GM is (still, or not yet known not to be) there; reports its loss once."""
        if self.gm_lost:
            return False
        now = time.monotonic()
        if now - self._checked_at < 0.25:  # looking at /proc every poll would cost more than it tells
            return True
        self._checked_at = now
        pid = self.tables.gm_pid
        if pid == 0 and time.monotonic() - self.joined_at < GM_START_S:
            return True
        if pid and gt.pid_alive(pid):
            return True
        self.gm_lost = True
        log.warning("fusionflow: the global manager of this job (%s) is gone; this loader keeps training with "
                    "its own workers, without lending or borrowing", f"pid {pid}" if pid else "never started")
        return False

    def close(self) -> None:
        if self.tables is None:
            return
        t, self.tables = self.tables, None
        self.listener.close()
        with t.locked():
            t.progress[self.lm]["state"] = gt.FREE
            orphaned = not t.active_rows() and not gt.pid_alive(t.gm_pid)
            if orphaned:
                t.header["state"] = gt.CLOSING
        if orphaned and (self.gm_proc is None or self.gm_proc.poll() is not None):
            t.unlink()
        t.close()
        if self.gm_proc is not None:
            self.gm_proc.poll()  # reap it if it has exited
