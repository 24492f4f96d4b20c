"""The lending agent: this loader's side of worker lending under a global manager (runtime/gm/manager.py).

It exists only when a job is given; a loader without one has no agent at all. The manager thread
drives it: `step()` on every turn of its loop, `waitables()` / `handle(ready)` in its one wait.

  * Progress: `publish` writes this LM's progress row on every turn; the GM's orders are read when
    it rings (a BELL on the GM's connection to this LM's socket, the "doorbell"; otherwise every
    `GM_IDLE_S`).
  * Lending: a Yield order sends up to Count idle own workers a LEND (they connect to the
    borrower's socket and report HOME when returned, runtime/worker_pool.py); lent workers get no
    tasks here meanwhile. A lent worker that dies is restarted like any other.
  * Borrowing: workers lent *to* this LM ("guests") arrive on its socket (`GMLink.accept`), get the
    ring, seed and spec (the handshake), then take tiny-batches like own workers -- but only of the
    mini-batches submitted before they arrived (the iteration they were lent for). When none is left
    for a guest, it is sent RETURN. A guest whose connection drops has its tasks requeued as a dead
    worker's -- with no death counted once its owner has left or died (it stops its lent workers then).
  * A guest whose tiny-batch runs past the stuck bound (stopped, swapping) is SIGKILLed here by its
    pid (SO_PEERCRED; a borrower may reuse the ring slot, so it must never write again): its
    connection drops, its tasks run again here, its owner restarts it as a dead worker.
  * Elastic capacity: a new worker target from the GM goes to the pool; surplus idle workers retire.
"""

from __future__ import annotations

import logging
import os
import signal

from fusionflow.runtime import messages as m
from fusionflow.runtime.authsock import peer_pid, recv_whole
from fusionflow.runtime.counters import count_stuck_kill
from fusionflow.runtime.gm import tables as gt
from fusionflow.runtime.procs import pid_alive
from fusionflow.runtime.shm import send_fd
from fusionflow.runtime.worker_conn import WorkerConn

log = logging.getLogger(__name__)
GM_IDLE_S = 0.1  # with a GM: progress heartbeat, elastic target and GM liveness at least this often


class LendingAgent:
    def __init__(self, board, job: str, spec: bytes | None):
        from fusionflow.runtime.gm.link import GMLink

        self.board, self.pool = board, None  # the pool is attached once it exists (it needs our spec hash)
        self.link = GMLink(job, board.ring.name, spec)
        self.guests: list[WorkerConn] = []
        self.bell = None  # the GM's connection to our socket (it rings when it writes us an order)
        self.lent_total = self.guests_total = 0  # published: what the GM reads of this LM's loans
        self._guests: list[WorkerConn] = []  # the manager thread's snapshot for its current wait
        self._bell = None
        board.counters.global_manager = "active"

    @classmethod
    def join(cls, board, job: str, spec: bytes | None) -> LendingAgent | None:
        """The agent of job `job`, or None when its table cannot be joined in time (its lock held by a
        stopped process, gm/tables.py LOCK_S): the loader then trains without lending, saying so."""
        try:
            return cls(board, job, spec)
        except TimeoutError as exc:
            log.warning("fusionflow: %s; this loader runs without worker lending", exc)
            board.counters.global_manager = "lost"
            return None

    @property
    def spec_hash(self) -> bytes | None:
        return self.link.spec_hash

    def serving(self) -> None:
        """The manager thread starts: the listener is in every wait from now on."""
        self.link.serving()

    # ---------------------------------------------------------------- the GM's orders (lock held)
    def step(self) -> float:
        """Publish progress, carry out the GM's orders; returns how long the manager thread may sleep."""
        link, pool = self.link, self.pool
        target = link.target()  # (this loader's row: set by `gm workers` whether or not the GM still runs)
        if target is not None and target != pool.target_workers:
            pool.target_workers = target
            self.board.cond.notify_all()  # the main thread starts missing workers
        pool.retire_surplus()
        if not link.check_gm():
            self.board.counters.global_manager = "lost"
            self.publish()
            return 1.0
        order = link.yield_order()
        done = self._lend(*order) if order is not None else 0
        self.publish()  # before the ack: the GM reads the lender's counts once the ack shows
        if order is not None:
            link.ack_yield(order[0], done)
        return GM_IDLE_S

    def _lend(self, seq: int, peer: int, count: int) -> int:
        """A Yield order: send up to `count` idle own workers to LM `peer`; returns how many went."""
        link, trace = self.link, self.board.trace
        address = link.peer_address(peer)
        lend = m.pack_message(m.Lend(peer, address, link.tables.secret, link.lm))
        done = 0
        for w in self.pool.workers:
            if address is None or done >= count:
                break
            if w is not None and w.idle:
                try:
                    w.conn.send_bytes(lend)
                except OSError:
                    continue
                w.lent_to = peer
                done += 1
                if trace is not None:
                    trace.lent(w.worker_id, peer)
        self.lent_total += done
        self.board.counters.workers_lent += done
        return done

    def publish(self) -> None:
        board, pool = self.board, self.pool
        # the current iteration: the oldest incomplete mini-batch -- what a lent worker would serve
        current = board.queue.current_key()
        busy = [
            w
            for w in [*pool.workers, *self.guests]
            if w is not None
            and w.alive
            and w.lent_to is None
            and w.outstanding
            and (w.outstanding[0][1].generation, w.outstanding[0][1].seq) == current
        ]
        own = [w for w in pool.kept_workers() if w.alive]
        self.link.publish(
            iteration=board.completed_batches,
            waiting=board.queue.waiting(current),
            active_since=[w.head_since for w in busy],
            task_seconds=pool.task_seconds,
            idle=sum(1 for w in own if w.idle),
            workers=len(own),
            lent=sum(1 for w in own if w.lent_to is not None),
            guests=len(self.guests),
            lent_total=self.lent_total,
            guests_total=self.guests_total,
        )

    # ---------------------------------------------------------------- guests (lock held)
    def busy_with_stale(self, generation: int) -> bool:
        return any(work.generation != generation for g in self.guests for _tid, work in g.outstanding)

    def return_finished_guests(self) -> None:
        """After a dispatch: a ready guest with nothing left of the iteration it came for goes home."""
        for g in [g for g in self.guests if g.alive and g.ready]:
            if g.alive and not g.outstanding:
                self._return_guest(g)

    def _return_guest(self, g: WorkerConn) -> None:
        """Send a lent worker home (lock held)."""
        try:
            g.conn.send_bytes(m.pack_control(m.RETURN))
        except OSError:
            pass
        self._drop_guest(g)

    def kill_guest(self, g: WorkerConn, why: str, suspect: bool = True) -> None:
        """(lock held or not) SIGKILL a guest by its pid (SO_PEERCRED at accept): one that made no progress
        or stopped mid-message must never write into a slot reused after its tiny-batches are requeued.
        Its connection then drops (`_on_lost` requeues: the task it ran counts a death if `suspect`, as for
        a stuck one, not for a straggler, whose sample was only slow); its owner replaces it."""
        g.killed_for, g.kill_counts = why, suspect
        log.warning("fusionflow worker %s lent to this loader %s; killing it", g.worker_id, why)
        count_stuck_kill(self.board.counters)
        if g.peer_pid is not None:
            try:
                os.kill(g.peer_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _drop_guest(self, g: WorkerConn) -> None:
        g.alive = False
        g.conn.close()
        if g in self.guests:
            self.guests.remove(g)

    # ---------------------------------------------------------------- the manager thread's wait
    def waitables(self) -> list:
        """(lock held) The doorbell, the guests' connections and the listener; remembered for `handle`."""
        self._guests, self._bell = list(self.guests), self.bell
        return [g.conn for g in self._guests] + [self.link.listener] + ([self._bell] if self._bell is not None else [])

    def handle(self, ready) -> bool:
        """Whether `ready` (of the last `waitables()`) was the agent's; if so, it is handled."""
        if ready is self.link.listener:
            conn = self.link.accept()
            if conn is not None:
                g = WorkerConn(None, None, conn)
                g.peer_pid = peer_pid(conn)  # the same user's process (the handshake's HMAC and uid)
                with self.board.cond:
                    self.guests.append(g)
            return True
        if ready is self._bell:
            self._drain_bell(ready)
            return True
        g = next((g for g in self._guests if ready is g.conn), None)
        if g is None:
            return False
        if g.alive:
            self._on_message(g)
        return True

    def _drain_bell(self, bell) -> None:
        """The GM rang: the loop's next `step` reads the order. A closed bell means the GM is gone."""
        try:
            while bell.poll():
                bell.recv_bytes()
        except (EOFError, OSError):
            with self.board.cond:
                if self.bell is bell:
                    self.bell = None
            bell.close()

    def _on_message(self, g: WorkerConn) -> None:
        try:
            msg = recv_whole(g.conn)
        except TimeoutError as exc:  # stopped mid-message: killed, it must never write into a slot reused later
            with self.board.cond:
                self.kill_guest(g, f"stopped in the middle of a message ({exc})")
            self._on_lost(g)
            return
        except (EOFError, OSError):
            self._on_lost(g)
            return
        with self.board.cond:
            self._on_guest_message(g, m.kind_of(msg), msg)
            self.board.cond.notify_all()

    def _handshake(self, g: WorkerConn, kind: int, msg: bytes) -> bool:
        """HELLO / NEED of a guest's handshake (lock held); whether `msg` was one (see worker.serve_borrower)."""
        link, board = self.link, self.board
        if kind not in (m.HELLO, m.NEED):
            return False
        try:
            if kind == m.HELLO:
                hello = m.unpack_message(msg, m.Hello)
                g.worker_id = f"lm{hello.owner_lm}:w{hello.worker_id}"
                if link.tables is not None and 0 <= hello.owner_lm < len(link.tables.progress):  # its owner as of now:
                    row = link.tables.progress[hello.owner_lm]  # a loss after it left is no death
                    g.owner = (hello.owner_lm, int(row["reg"]), int(row["pid"]))
                g.conn.send_bytes(
                    m.pack_message(m.Setup(board.ring.name, self.pool.spec.layout, self.pool.spec.seed, link.spec_hash))
                )
                send_fd(g.conn, board.ring.fd)  # the ring has no name: it maps this descriptor
            elif link.spec is None:
                self._return_guest(g)
            else:  # once per worker and loader; the socket's send timeout bounds a peer that stops reading
                g.conn.send_bytes(m.pack_pickled(m.SPEC, link.spec))
        except OSError as exc:  # it died or its owner stopped it mid-handshake: it held no task
            log.info("fusionflow: worker %s left during its handshake (%r)", g.worker_id, exc)
            self._on_lost(g)
        return True

    def _on_guest_message(self, g: WorkerConn, kind: int, msg: bytes) -> None:
        """A lent worker's handshake and completions, or the GM's doorbell (lock held)."""
        if self._handshake(g, kind, msg):
            return
        if kind == m.BELL:  # not a worker: the GM's doorbell
            self.guests.remove(g)
            if self.bell is not None:
                self.bell.close()
            self.bell = g.conn
        elif kind == m.LEAVING:  # its owner called it back (shutting down): what it had queued is not suspect
            self._drop_guest(g)
            self.pool.requeue_outstanding(g, "", suspect=False)
        elif kind == m.READY:
            self.guests_total += 1
            self.board.counters.workers_borrowed += 1
            g.serve_upto = self.board.queue.current_key()  # the iteration it was lent for
            if g.serve_upto is None:  # it finished meanwhile: send the worker home at once
                self._return_guest(g)
            else:
                g.ready = True
        elif kind == m.FATAL:
            log.warning(
                "fusionflow: a worker lent to this loader cannot run its samples, so borrowing is off for it:\n%s",
                m.unpack_fatal(msg)[0],
            )
            self.link.disable_borrowing()
            self._return_guest(g)
        elif kind == m.DONE:
            self.pool.on_done(g, msg)
            self.board.counters.borrowed_tiny_batches += 1

    def _on_lost(self, g: WorkerConn) -> None:
        """A guest's connection dropped: its owner restarts it if it died; its tasks run again here."""
        with self.board.cond:
            if not g.alive:
                return
            g.alive = False
            self._drop_guest(g)
            if g.outstanding:
                log.warning(
                    "fusionflow: worker %s lent to this loader left with %d tiny-batches; re-running them",
                    g.worker_id,
                    len(g.outstanding),
                )
            how = f"killed: {g.killed_for}" if g.killed_for else "its connection dropped"
            self.pool.requeue_outstanding(g, how, suspect=g.kill_counts and not self._owner_left(g))

    def _owner_left(self, g: WorkerConn) -> bool:
        """Whether the guest's owner closed or died: it then stops its lent workers wherever they are (a close
        SIGTERMs one mid-task after a grace; a SIGKILLed owner's worker exits) -- its task is no suspect. It
        used to count a death against an innocent sample (and fail its mini-batch with max_retries=0)."""
        if g.owner is None:
            return False
        lm, reg, pid = g.owner
        row = self.link.tables.progress[lm] if self.link.tables is not None else None
        return row is None or int(row["state"]) != gt.ACTIVE or int(row["reg"]) != reg or not pid_alive(pid)

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Shutdown step: RETURN to guests, close their connections and the doorbell; leave the GM's
        table (free the row, close the socket)."""
        with self.board.cond:
            for g in list(self.guests):
                self._return_guest(g)
            if self.bell is not None:
                self.bell.close()
                self.bell = None
        self.link.close()
