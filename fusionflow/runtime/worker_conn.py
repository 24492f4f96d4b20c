"""The manager's handle on one CPU worker: its process, its pipe and the tiny-batches it holds.

One of this loader's worker processes (runtime/worker_pool.py owns them), or, with `process` None, a
guest: another loader's worker lent to this one (runtime/gm/agent.py serves those).
"""

from __future__ import annotations

import time
from collections import deque

from fusionflow.runtime import messages as m
from fusionflow.scheduling.queue import Work


class WorkerConn:
    """The manager's handle on one worker (own, or a guest with `process` None)."""

    def __init__(self, worker_id, process, conn):
        self.worker_id, self.process, self.conn = worker_id, process, conn
        self.outstanding: deque[tuple[int, Work]] = deque()  # (task_id, work), in sending order
        self.ready = False
        self.alive = True
        self.head_since = 0.0  # when its oldest outstanding task started (CLOCK_MONOTONIC)
        self.lent_to: int | None = None  # own worker now serving that LM
        self.retiring = False  # sent STOP for a lower worker target: not restarted
        self.serve_upto = None  # guest: the newest mini-batch key it may work on
        self.lost: Work | None = None  # another copy of this tiny-batch finished first: being stopped
        self.started_at = time.monotonic()  # when its process was started (a start-up is bounded too)
        self.killed_for: str | None = None  # why the manager killed it, for the death's log line and error
        self.kill_counts = True  # a guest killed for straggling (killed_for) costs its task no death: it was slow
        self.peer_pid: int | None = None  # a guest's process (SO_PEERCRED): killed here if it gets stuck
        self.stopped_since: float | None = None  # lent out: since when it has been seen stopped (runtime/stuck.py)
        self.owner: tuple[int, int, int] | None = None  # a guest's owner LM: (row, registration number, pid)

    @property
    def idle(self) -> bool:
        return self.alive and self.ready and self.lent_to is None and not self.retiring and not self.outstanding

    def send_stop(self) -> None:
        """Ask it to exit (a worker already gone has nothing to hear)."""
        try:
            self.conn.send_bytes(m.pack_stop())
        except OSError:
            pass
