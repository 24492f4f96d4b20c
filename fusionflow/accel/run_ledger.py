"""What became of the accelerator's DALI runs, told to the board: the tiny-batches DALI made are completed, those it
could not make are given back to the CPU workers (marked CPU-only), failed runs are counted, and the retirement --
MAX_FAILURES failed runs in a row, an unbuildable pipeline, a stalled run, a failed thread -- is said and counted.
The owner of those facts for one AcceleratorWorker (accel/accelerator.py), which holds one `RunLedger` over its list
of runs in flight; every method but `failed_run` runs under board.cond."""

from __future__ import annotations

import logging
import time

from fusionflow.errors import DeviceOutOfMemory

log = logging.getLogger("fusionflow.accel.accelerator")  # said as the accelerator's (one logger to filter)
MAX_FAILURES = 4  # failed DALI runs in a row before the accelerator retires


def retired(counters, why: str) -> str:  # the accelerator retires (GpuSession's before a start too): said, counted
    counters.accelerator_retired = why
    log.warning("the DALI accelerator is retired for this loader's run (%s); the CPU workers take all", why)
    return why


def unretired(counters) -> None:  # a loader closed and started again: its earlier retirement is no longer said
    counters.accelerator_retired = None


class RunLedger:
    def __init__(self, board, counters, active: list):
        self.board, self.counters = board, counters
        self.active = active  # the accelerator's runs in flight, oldest first: (tiny-batches, taken at, ...)
        self.tiny_batches = self.failures_in_a_row = 0  # tiny-batches done (the bridge's warm-up); failed runs in a row
        self.retired: str | None = None  # why the accelerator stopped taking work, once it has

    def retire(self, why: str) -> None:
        """Take no more work; the CPU workers get everything, reservations included."""
        self.retired = retired(self.counters, why)
        self.board.drop_reservations()

    def lose_all(self, why: str = "") -> None:
        """The runs in flight are lost, their tiny-batches to the CPU workers (one failed run)."""
        lost, self.active[:] = list(self.active), []
        self.account([], [w for g, *_ in lost for w in g], False, 0, why)
        self.board.cond.notify_all()

    def account(self, done, given_back, ok: bool | None, started: int, why: str = "") -> None:
        """Complete what DALI produced, give the rest back to the CPU workers (marked CPU-only); `ok` False counts
        a failed DALI run (`why`: its cause, for a retirement), None (not DALI's kind of sample) does not."""
        board = self.board
        self.tiny_batches += len(done)
        self.counters.accelerator_tiny_batches += len(done)
        for work, _ in done if board.trace is not None else ():
            board.trace.tiny_batch(None, work, started, time.monotonic_ns(), board.sizes)
        if done:  # the run's tiny-batches in one go: the calls of one whatever their number
            board.complete_many(done, [], on_accelerator=True)
            self.counters.accelerator_runs += 1
            self.failures_in_a_row = 0
        self.failures_in_a_row += ok is False
        for work in given_back:
            self.counters.accelerator_given_back += 1
            work.cpu_only = True
        if given_back:
            board.requeue(given_back)
        if self.failures_in_a_row >= MAX_FAILURES and not self.retired:
            self.retire(f"{self.failures_in_a_row} DALI runs in a row failed" + (f"; the last: {why}" if why else ""))

    def failed_run(self, exc) -> None:
        """A DALI run failed (out of memory, or an undecodable sample): every run in flight to the CPU workers."""
        if isinstance(exc, DeviceOutOfMemory):
            self.counters.accelerator_out_of_memory += 1
            log.warning("accelerator out of memory; the CPU workers take its runs: %s", exc)
        else:
            log.info("accelerator failed on a run: %s", exc)
        with self.board.cond:
            self.lose_all(str(exc))
