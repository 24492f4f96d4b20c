"""The global manager (GM): one process per job and node that moves idle CPU workers from local
managers (LMs, one per loader, i.e. per rank) that are done to LMs that still have work.

    python -m fusionflow.runtime.global_manager <table name>      # normally spawned by the first LM

Loop, every `POLL_S`:
  1. Read the progress table (runtime/gm_tables.py). An ACTIVE row whose process is gone is
     reclaimed: its batch-ring segment is unlinked, the row freed (its workers notice their owner is
     gone and exit; workers it borrowed see the connection close and go home).
  2. Turn the rows into `scheduling.lending.Progress` -- fractions done from the Active tiny-batches'
     start times and the LM's mean tiny-batch time -- and ask `plan_lending` for loans. An LM with an
     order it has not acknowledged yet lends nothing more; workers confirmed lent to a borrower that
     has not accepted them yet count against its need (`incoming`), so one slow poll never makes the
     GM send the same help twice.
  3. Write each loan as a Yield order on the lender's action row (one per lender per round) and a
     Borrow notice on the borrower's. The LM carries it out (runtime/local_manager.py): its idle
     workers connect to the borrower, serve the tiny-batches the borrower had when they arrived, and
     come home.
Exit: when no LM has been registered for `LINGER_S` (or none ever registered within `START_S`),
the GM marks the table CLOSING under its lock, unlinks it and exits. If the GM dies instead, LMs see
its pid gone, say so once, and keep training with their own workers; the last LM to leave unlinks.

Elastic capacity: `GlobalManagerClient(job).set_workers(n)` writes a worker target into the action
rows; each LM starts or retires workers to match without blocking training, and its TAAS search
starts over.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from fusionflow.runtime import gm_tables as gt
from fusionflow.runtime.shm import unlink as unlink_ring
from fusionflow.scheduling.lending import Progress, plan_lending

log = logging.getLogger("fusionflow.gm")
POLL_S = 0.002
# no LM registered for this long: the job's loaders are gone (not just between two epochs)
LINGER_S = float(os.environ.get("FUSIONFLOW_GM_LINGER_S", "2.0"))
START_S = 30.0
INCOMING_TTL_S = 1.0  # workers lent but never accepted within this are written off


def spawn(name: str) -> subprocess.Popen:
    """Start the GM for table `name` in its own session, so no rank's exit or Ctrl-C takes it down."""
    return subprocess.Popen([sys.executable, "-m", "fusionflow.runtime.global_manager", name],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def progress_of(t: gt.Tables, lm: int, now: float) -> Progress:
    row = t.progress[lm]
    n = int(row["n_active"])
    ts = float(row["task_seconds"])
    fractions = tuple(min(1.0, max(0.0, (now - float(s)) / ts)) if ts > 0 else 0.0
                      for s in row["active_since"][:n])
    return Progress(lm, int(row["iteration"]), int(row["waiting"]), fractions, int(row["idle"]),
                    can_borrow=bool(row["can_borrow"]))


class GlobalManager:
    def __init__(self, tables: gt.Tables):
        self.t = tables
        self.sent = {}  # borrower -> workers lenders confirmed sending, cumulative
        self.sent_since = {}  # borrower -> when its oldest unaccepted worker was confirmed
        self.counted_acks = {}  # lender -> yield seq whose ack is already in `sent`
        self.loans = 0

    def reclaim(self, lm: int) -> None:
        row = self.t.progress[lm]
        ring = bytes(row["ring"]).decode()
        log.warning("fusionflow GM: local manager %d (pid %d) died; reclaiming its ring %s", lm, int(row["pid"]), ring)
        if ring:
            unlink_ring(ring)
        with self.t.locked():
            row["state"] = gt.FREE
        self.sent.pop(lm, None)
        self.sent_since.pop(lm, None)

    def step(self) -> int:
        """One poll; returns how many LMs are active."""
        t, now = self.t, time.monotonic()
        t.header["gm_heartbeat"] = now
        live = []
        for lm in t.active_rows():
            if gt.pid_alive(int(t.progress[lm]["pid"])):
                live.append(lm)
            else:
                self.reclaim(lm)
        table, busy = [], set()
        for lm in live:
            act = t.action[lm]
            seq, ack = int(act["yield_seq"]), int(act["yield_ack"])
            if ack < seq:
                busy.add(lm)  # it has an order it has not carried out yet
            elif seq and self.counted_acks.get(lm) != seq:
                self.counted_acks[lm] = seq
                peer = int(act["yield_peer"])
                if int(act["yield_done"]):
                    self.sent[peer] = self.sent.get(peer, 0) + int(act["yield_done"])
                    self.sent_since.setdefault(peer, now)
            p = progress_of(t, lm, now)
            accepted = int(t.progress[lm]["guests_total"])
            incoming = max(0, self.sent.get(lm, 0) - accepted)
            if not incoming or now - self.sent_since.get(lm, now) > INCOMING_TTL_S:
                self.sent[lm] = accepted  # all arrived (or the rest never will)
                self.sent_since.pop(lm, None)
                incoming = 0
            table.append(Progress(p.lm, p.iteration, p.waiting, p.active, 0 if lm in busy else p.idle_workers,
                                  incoming=incoming, can_borrow=p.can_borrow))
        ordered = set()
        for loan in plan_lending(table):
            if loan.lender in ordered:
                continue  # one order per lender per round; the rest is re-planned next poll
            ordered.add(loan.lender)
            a, b = t.action[loan.lender], t.action[loan.borrower]
            a["yield_peer"], a["yield_count"] = loan.borrower, loan.count
            a["yield_seq"] = int(a["yield_seq"]) + 1  # written last: the order is complete
            b["borrow_peer"], b["borrow_count"] = loan.lender, loan.count
            b["borrow_seq"] = int(b["borrow_seq"]) + 1
            self.loans += 1
        return len(live)

    def run(self) -> None:
        started = last_seen = time.monotonic()
        while True:
            n = self.step()
            now = time.monotonic()
            if n:
                last_seen = now
            ever = int(self.t.header["registered_total"][0]) > 0
            if (ever and now - last_seen > LINGER_S) or (not ever and now - started > START_S):
                with self.t.locked():
                    if self.t.active_rows():
                        last_seen = now  # one registered meanwhile
                        continue
                    self.t.header["state"] = gt.CLOSING
                self.t.unlink()
                return
            time.sleep(POLL_S)


class GlobalManagerClient:
    """Talk to a running GM's tables: look at the progress table, set the elastic worker target.

        client = GlobalManagerClient("my-job")   # the name passed as global_manager=..., or None
        client.set_workers(3)                    # every LM of the job: 3 CPU workers each
    """

    def __init__(self, job: str | None = None):
        job = job if job is not None else gt.job_key()
        if job is None:
            raise ValueError("job=None outside torchrun: pass the name given to FusionFlowLoader(global_manager=...)")
        self.t = gt.Tables.attach(gt.table_name(job))
        if self.t is None:
            raise ValueError(f"no global manager runs for job {job!r} on this node (no loader has registered)")

    def local_managers(self) -> list[dict]:
        out = []
        for lm in self.t.active_rows():
            row = self.t.progress[lm]
            out.append({"lm": lm, "pid": int(row["pid"]), "iteration": int(row["iteration"]),
                        "waiting": int(row["waiting"]), "idle": int(row["idle"]), "workers": int(row["workers"]),
                        "lent": int(row["lent"]), "guests": int(row["guests"]),
                        "lent_total": int(row["lent_total"]), "guests_total": int(row["guests_total"])})
        return out

    def set_workers(self, workers: int, lm: int | None = None) -> None:
        """Set the CPU worker count of one LM (`lm`) or of every active one; returns at once, the LMs
        start or retire workers between tiny-batches."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r} must be an integer >= 1 (an LM with no workers of its own "
                             "could wait forever when nobody lends)")
        rows = self.t.active_rows() if lm is None else [lm]
        if lm is not None and lm not in self.t.active_rows():
            raise ValueError(f"lm={lm} is not an active local manager; active: {self.t.active_rows()}")
        for r in rows:
            a = self.t.action[r]
            a["target_workers"] = workers
            a["target_seq"] = int(a["target_seq"]) + 1

    def close(self) -> None:
        self.t.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].startswith(gt.PREFIX):
        print(f"usage: python -m fusionflow.runtime.global_manager {gt.PREFIX}<id>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank's Ctrl-C is not ours; LMs leaving is
    tables = gt.Tables.attach(argv[0])
    if tables is None:
        return 0  # its creator already gave up on it
    with tables.locked():
        other = tables.gm_pid
        if other and other != os.getpid() and gt.pid_alive(other):
            return 0  # one GM per table
        tables.header["gm_pid"] = os.getpid()
    try:
        GlobalManager(tables).run()
    finally:
        tables.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
