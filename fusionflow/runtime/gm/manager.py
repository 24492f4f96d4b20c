"""The global manager (GM): one process per job and node that moves idle CPU workers from local
managers (LMs, one per loader, i.e. per rank) that are done to LMs that still have work.

    python -m fusionflow.runtime.gm.manager <table name>      # spawned by the first LM of a job
    python -m fusionflow gm serve --job NAME                      # or started explicitly (tools/gm.py)

Loop, every `POLL_S`:
  1. Read the progress table (runtime/gm/tables.py). An ACTIVE row whose process is gone is freed (its
     workers notice their owner is gone and exit; workers it borrowed see the connection close and go home).
  2. Turn the rows into `scheduling.lending.Progress` -- fractions done from the Active tiny-batches'
     start times and the LM's mean tiny-batch time -- and ask `plan_lending` for loans. An LM with an
     order it has not acknowledged yet lends nothing more; workers confirmed lent to a borrower that
     has not accepted them yet count against its need (`incoming`), so one slow poll never makes the
     GM send the same help twice.
  3. Write each loan as a Yield order on the lender's action row (one per lender per round) and a
     Borrow notice on the borrower's, and ring the lender: the GM holds one connection to every
     LM's socket and sends a BELL, so LMs never poll for orders. The LM carries the order out
     (runtime/gm/agent.py): its idle workers connect to the borrower, serve the tiny-batches
     of the iteration the borrower had when they arrived, and come home.
Exit: when no LM has been registered for `LINGER_S` (or none ever registered within `START_S`),
the GM marks the table CLOSING under its lock, unlinks it and exits. If the GM dies instead, LMs see
its pid gone, say so once, and keep training with their own workers; the last LM to leave unlinks.

Elastic capacity: `GlobalManagerClient(job).set_workers(n)` writes a worker target into the action
rows; each LM starts or retires workers to match without blocking training, and its split rule
starts over.

Who owns the workers: each LM forks and owns its own; the GM only moves them. Forked from their rank, workers
inherit its dataset, worker_init_fn and imports; a GM-owned pool would need every rank's dataset shipped to one
process, and a GM crash would take every worker with it, where now it only stops lending. Each LM starts every
iteration with its own `num_workers`; a lent worker returns when the borrower's iteration is complete.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import namedtuple

import numpy as np

from fusionflow.runtime import messages as m
from fusionflow.runtime.gm import tables as gt
from fusionflow.runtime.gm import timing
from fusionflow.runtime.gm.link import connect
from fusionflow.runtime.gm.timing import INCOMING_TTL_S, LINGER_S, LIVENESS_S, POLL_S, STALE_S, START_S
from fusionflow.runtime.procs import is_stopped, pid_alive
from fusionflow.scheduling.lending import Progress, plan_lending

log = logging.getLogger("fusionflow.gm")
_BELL = m.pack_control(m.BELL)  # the doorbell: "read your action row"
_P = namedtuple("_P", gt.PROGRESS.names)
_A = namedtuple("_A", gt.ACTION.names)


class GlobalManager:
    def __init__(self, tables: gt.Tables):
        self.t = tables
        # per row, for the LM registered there now (reset when `reg` changes: rows are reused)
        self.reg = {}  # row -> registration number the state below belongs to
        self.sent = {}  # borrower -> workers lenders confirmed sending to it, cumulative
        self.written_off = {}  # borrower -> confirmed workers that never arrived within INCOMING_TTL_S
        self.pending_since = {}  # borrower -> since when some confirmed worker has not arrived
        self.counted_acks = {}  # lender -> yield seq whose ack is already counted in `sent`
        self.bells = {}  # row -> (registration number, connection to that LM's socket)
        self.bell_retry = {}  # row -> (registration number, when to try connecting again, the delay it waited)
        self.checked_at = 0.0

    def reclaim(self) -> None:
        try:
            self._reclaim()
        except TimeoutError as exc:  # a stopped holder of the table's lock: next poll
            log.warning("fusionflow GM: %s; reclaiming later", exc)

    def _reclaim(self) -> None:
        with self.t.locked():
            for lm in self.t.reclaim_dead():
                log.warning(
                    "fusionflow GM: local manager %d (pid %d) died; its row is freed",
                    lm,
                    int(self.t.progress[lm]["pid"]),
                )

    def step(self) -> int:
        """One poll; returns how many LMs are active."""
        t, now = self.t, time.monotonic()
        t.header["gm_heartbeat"] = now  # LMs take a GM silent for GM_SILENT_S as gone (stopped, hung)
        live = np.flatnonzero(t.progress["state"] == gt.ACTIVE)
        if now - self.checked_at > LIVENESS_S:
            self.checked_at = now
            self.reclaim()
            live = np.flatnonzero(t.progress["state"] == gt.ACTIVE)
        # one copy each, as Python tuples (field access on numpy records costs a microsecond apiece)
        rows = [_P(*r) for r in t.progress[live].tolist()]
        acts = [_A(*a) for a in t.action[live].tolist()]
        lms = live.tolist()
        self._follow_registrations(lms, rows, now)
        self._count_acks(lms, acts)
        table = [self._progress(lm, row, act, now) for lm, row, act in zip(lms, rows, acts)]
        self._order(plan_lending(table))
        return len(table)

    def _follow_registrations(self, lms, rows, now: float) -> None:
        """A row taken over by a new LM starts with a clean slate; listening LMs get a bell, and the
        bells of LMs that left are closed."""
        for lm, row in zip(lms, rows):
            if self.reg.get(lm) != row.reg:
                self.reg[lm] = row.reg
                for state in (self.sent, self.written_off, self.pending_since, self.counted_acks):
                    state.pop(lm, None)
            if row.listening and self.bells.get(lm, (None,))[0] != row.reg:
                retry = self.bell_retry.get(lm)
                if retry is None or retry[0] != row.reg or now >= retry[1]:
                    self._hang_bell(lm, row)
        live_set = set(lms)
        for lm in [lm for lm, (reg, _) in self.bells.items() if self.reg.get(lm) != reg or lm not in live_set]:
            self.bells.pop(lm)[1].close()  # that LM left

    def _count_acks(self, lms, acts) -> None:
        """A lender's newly acknowledged order: the workers it gave count as sent to its borrower."""
        for lm, act in zip(lms, acts):
            if act.yield_ack == act.yield_seq and act.yield_seq and self.counted_acks.get(lm) != act.yield_seq:
                self.counted_acks[lm] = act.yield_seq
                if act.yield_done and act.yield_peer in self.reg:
                    self.sent[act.yield_peer] = self.sent.get(act.yield_peer, 0) + act.yield_done

    def _progress(self, lm: int, row, act, now: float) -> Progress:
        """One LM's row as the lending plan reads it."""
        busy = act.yield_ack < act.yield_seq  # it has an order it has not carried out yet
        # workers confirmed lent to it that have not arrived (counters only grow; a worker may arrive
        # before its lender's ack is read, so the difference can dip below zero for a poll)
        incoming = self.sent.get(lm, 0) - self.written_off.get(lm, 0) - row.guests_total
        if incoming <= 0:
            self.pending_since.pop(lm, None)
            incoming = 0
        elif now - self.pending_since.setdefault(lm, now) > INCOMING_TTL_S:
            self.written_off[lm] = self.written_off.get(lm, 0) + incoming  # they never will
            self.pending_since.pop(lm, None)
            incoming = 0
        stale = now - row.heartbeat > STALE_S  # its manager thread stopped publishing: lend it nothing
        ts = row.task_seconds
        active = tuple(
            min(1.0, max(0.0, (now - since) / ts)) if ts > 0 else 0.0
            for since in row.active_since[: row.n_active].tolist()
        )
        return Progress(
            lm,
            row.iteration,
            row.waiting,
            active,
            0 if busy or stale else row.idle,
            incoming=incoming,
            can_borrow=bool(row.can_borrow) and not stale,
        )

    def _order(self, loans) -> None:
        """Write the plan's orders into the action table, one per lender per round (the rest is
        re-planned next poll), and ring the lenders."""
        t, ordered = self.t, set()
        for loan in loans:
            if loan.lender in ordered:
                continue
            ordered.add(loan.lender)
            a, b = t.action[loan.lender], t.action[loan.borrower]
            a["yield_peer"], a["yield_count"] = loan.borrower, loan.count
            a["yield_seq"] = int(a["yield_seq"]) + 1  # written last: the order is complete
            b["borrow_peer"], b["borrow_count"] = loan.lender, loan.count
            b["borrow_seq"] = int(b["borrow_seq"]) + 1
            self._ring(loan.lender)

    def _hang_bell(self, lm: int, row) -> None:
        """Connect to a newly registered LM's socket (its manager thread then sleeps until rung); see BELL_RETRY_S."""
        old = self.bells.pop(lm, None)
        if old is not None:
            old[1].close()
        last = self.bell_retry.get(lm, (None, 0.0, 0.0))
        delay = min(2 * last[2], timing.BELL_RETRY_MAX_S) if last[0] == row.reg else timing.BELL_RETRY_S
        try:
            if is_stopped(int(self.t.progress[lm]["pid"])):
                raise ConnectionError("its process is stopped")
            conn = connect(row.address.decode(), self.t.secret)
            conn.send_bytes(_BELL)
            os.set_blocking(conn.fileno(), False)  # a bell an LM does not read never stalls this loop
        except Exception as exc:  # it left already, or is stuck: it reads its row every GM_IDLE_S anyway
            log.info("fusionflow GM: no doorbell for LM %d yet: %r", lm, exc)
            self.bell_retry[lm] = (row.reg, time.monotonic() + delay, delay)
            return
        self.bells[lm] = (row.reg, conn)
        self.bell_retry.pop(lm, None)

    def _ring(self, lm: int) -> None:
        bell = self.bells.get(lm)
        if bell is None:
            return
        try:
            bell[1].send_bytes(_BELL)
        except OSError:
            bell[1].close()
            del self.bells[lm]

    def run(self, linger: float | None = LINGER_S) -> None:
        """Poll until no LM has been registered for `linger` seconds (None: until SIGINT/SIGTERM);
        then close and unlink the table."""
        try:
            self._poll(linger)
        except KeyboardInterrupt:  # wherever in the loop it lands (SIGTERM too, for `gm serve`)
            self.t.header["state"] = gt.CLOSING  # without the lock if need be: we are leaving
            self.t.unlink()

    def _poll(self, linger: float | None) -> None:
        started = last_seen = time.monotonic()
        while True:
            n = self.step()
            time.sleep(POLL_S)
            now = time.monotonic()
            if n:
                last_seen = now
            if linger is None:
                continue
            ever = int(self.t.header["registered_total"][0]) > 0
            if (ever and now - last_seen > linger) or (not ever and now - started > START_S):
                try:
                    with self.t.locked():
                        if self.t.active_rows():
                            last_seen = now  # one registered meanwhile
                            continue
                        self.t.header["state"] = gt.CLOSING
                except TimeoutError:  # a stopped LM holds the lock: it is a user; look again later
                    last_seen = now
                    continue
                self.t.unlink()
                return


class GlobalManagerClient:
    """Talk to a running GM's tables: look at the progress table, set the elastic worker target.

    client = GlobalManagerClient("my-job")   # the name passed as global_manager=..., or None
    client.set_workers(3)                    # every LM of the job: 3 CPU workers each
    """

    def __init__(self, job: str | None = None, table: str | None = None):
        """`table`: the job's table name as found in /dev/shm (`tables.jobs_on_this_node`), else made from `job`."""
        job = job if job is not None else gt.job_key()
        if job is None:
            raise ValueError("job=None outside torchrun: pass the name given to FusionFlowLoader(global_manager=...)")
        self.job, self.t = job, gt.Tables.attach(table or gt.table_name(job))
        if self.t is None:
            raise ValueError(f"no global manager runs for job {job!r} on this node (no loader has registered)")
        try:
            self._tables()
        except ValueError:
            self.t.close()
            raise

    def _tables(self) -> gt.Tables:
        """The job's tables: those of its running GM (after the one this client found ended, a newer one's)."""
        if self.t.removed:
            again = gt.Tables.attach(gt.table_name(self.job))
            if again is None:
                raise ValueError(f"the global manager of job {self.job!r} has ended and no other runs on this node")
            self.t.close()
            self.t = again
        if self.t.left_over():
            raise ValueError(
                f"the global manager of job {self.job!r} has ended and no loader of the job is registered (the job "
                "is not running, or is between epochs past its GM's linger; the job's next loader starts a new one, "
                "with its own num_workers): set the target once a loader of the job runs"
            )
        return self.t

    def local_managers(self) -> list[dict]:
        out, t = [], self._tables()
        for lm in t.active_rows():
            row = t.progress[lm]
            out.append(
                {
                    "lm": lm,
                    "pid": int(row["pid"]),
                    "iteration": int(row["iteration"]),
                    "waiting": int(row["waiting"]),
                    "idle": int(row["idle"]),
                    "workers": int(row["workers"]),
                    "lent": int(row["lent"]),
                    "guests": int(row["guests"]),
                    "lent_total": int(row["lent_total"]),
                    "guests_total": int(row["guests_total"]),
                    "orders_received": int(t.action[lm]["yield_seq"]),
                    "borrow_notices": int(t.action[lm]["borrow_seq"]),
                }
            )
        return out

    def set_workers(self, workers: int, lm: int | None = None) -> None:
        """Set the CPU worker count of one LM (`lm`) or of the whole job (every LM, and those that
        register later, e.g. next epoch's); returns at once, the LMs start or retire workers between
        tiny-batches."""
        cores = len(os.sched_getaffinity(0))
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= cores:
            raise ValueError(
                f"workers={workers!r} must be an integer from 1 (an LM with no workers of its own "
                f"could wait forever when nobody lends) to {cores} (the cores here)"
            )
        t = self._tables()
        # one numbering for job-wide and per-LM targets: an LM that finds both new since its last look applies the
        # later (it applied the LM's own first, so a job-wide target set just before it won)
        stamp = 1 + max(int(t.header[0]["target_seq"]), int(t.action["target_seq"].max()))
        if lm is None:
            h = t.header[0]
            h["target_workers"] = workers
            h["target_seq"] = stamp
            return
        if lm not in t.active_rows():  # (an int: "0" is not the row 0)
            raise ValueError(f"lm={lm!r} is not an active local manager; active: {t.active_rows()}")
        a = t.action[lm]
        a["target_workers"] = workers
        a["target_seq"] = stamp

    def close(self) -> None:
        self.t.close()


def claim(tables: gt.Tables) -> bool:
    """Become the table's GM unless a live one already is (False too if the table's lock stays held:
    its loaders then find no GM and train without lending)."""
    try:
        return _claim_locked(tables)
    except TimeoutError:
        return False


def _claim_locked(tables: gt.Tables) -> bool:
    with tables.locked():
        other = tables.gm_pid
        if other and other != os.getpid() and pid_alive(other):
            return False
        tables.header["gm_pid"] = os.getpid()
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].startswith(gt.PREFIX):
        print(f"usage: python -m fusionflow.runtime.gm.manager {gt.PREFIX}<id>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank's Ctrl-C is not ours; LMs leaving is
    tables = gt.Tables.attach(argv[0])
    if tables is None:
        return 0  # its creator already gave up on it
    if not claim(tables):
        tables.close()
        return 0  # one GM per table
    try:
        GlobalManager(tables).run()
    finally:
        tables.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
