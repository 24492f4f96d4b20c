"""The split rule's observations from the accelerator's side, and the share it reserves on the board.

The ShareController (scheduling/split.py) is pure: it turns observed rates into G, the accelerator's
share of each mini-batch. This object feeds it what the loader sees -- each mini-batch done (the CPU
workers' time per tiny-batch, whether training waited for it, the period), each DALI run's completion
interval -- and reserves the share it returns on the board (whole tiny-batches), keeping the share's
fraction for the accelerator's tail runs. Everything here runs under the board's lock.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from fusionflow.scheduling.queue import images, key_of
from fusionflow.scheduling.split import ACCEL_WINDOW

COLLECT_AT = 0.95  # a share run's outputs are asked for at this fraction of its expected time...
COLLECT_MIN = 0.25  # ...or, while runs are found done when asked for, at half the last fraction, down to this
READY_S = 0.001  # outputs that came within this (or READY_SHARE of the run's expected time) were ready already
READY_SHARE = 0.05  # (the thread may wait for the GIL on return: up to the 5 ms switch interval)
TAIL_BEHIND = 2  # no tail run with this many DALI runs in flight: it would come out after them
BURST_S = 0.001  # mini-batches completed within this of the one before were done together (one run held both)


class ShareFeed:
    def __init__(self, split, board, tiny_batch_size: int, cpu_workers: int, batch_size: int = 0):
        self.split, self.board, self.tiny_batch_size = split, board, tiny_batch_size
        self.cpu_workers = cpu_workers  # the CPU workers now live (the board's owner tells: `capacity`)
        self.batch_size = batch_size  # the loader's mini-batch (the ring's): a short last one does not set the share
        self.tail_fraction: float | None = None  # the share's fraction of a mini-batch, once reserved
        self._last_batch_at = 0.0  # when the last observed period ended (the split rule's period)
        self._batches = 0  # mini-batches completed since then
        self.collect_at = COLLECT_AT  # the fraction of a share run's expected time at which it is collected
        self.timed_runs = 0  # share runs whose completion said DALI's pace (spatial sharing, the current pipeline)
        self._alone: deque = deque(maxlen=ACCEL_WINDOW)  # seconds per sample of runs that found DALI idle: latency

    def batch_done(self, state, cpu_task_seconds: float, awaited: bool, now: float) -> None:
        """A mini-batch is complete: feed the split rule and reserve the next share. `cpu_task_seconds`:
        the CPU workers' running mean per tiny-batch; `awaited`: training was waiting for it."""
        split = self.split
        if cpu_task_seconds > 0:
            split.cpu_tiny_batch(cpu_task_seconds, self.tiny_batch_size)
        self._batches += 1
        if not self._last_batch_at:
            self._last_batch_at, self._batches = now, 0
        elif now - self._last_batch_at >= BURST_S:  # else done with the one before (a run held both): one period
            cpu_last = state.cpu_done_at >= state.accel_done_at  # (a period of 0 read as a training step of 0 s)
            period = (now - self._last_batch_at) / self._batches
            split.iteration(period, state.size, cpu_bound=awaited and cpu_last)
            self._last_batch_at, self._batches = now, 0
        self.reserve(max(state.size, self.batch_size))

    def reserve(self, batch: int) -> None:
        """The split rule's share of the next mini-batches of `batch` samples (at start: half, until rates
        are measured), and the tail runs' fraction with it."""
        share = self.split.share(batch, self.cpu_workers)
        self.tail_fraction = share / batch
        # on a shared device (a GPU) a run's fixed cost is ~170 samples' work: no top-up runs of a share taken
        self.board.reserve(-(-share // self.tiny_batch_size), steal=True, final=self.split.shares_device)

    def tail(self, in_flight: int) -> float | None:
        """The tail runs' fraction for the accelerator's next take with `in_flight` runs in DALI: 0 (none) behind
        TAIL_BEHIND of them -- runs are collected in order, so a tail run would come out after them, by when
        the CPU workers have mostly done the awaited mini-batch, and its fixed cost would delay the shares."""
        return self.tail_fraction if in_flight < TAIL_BEHIND or self.tail_fraction is None else 0.0

    def capacity(self, workers: int) -> None:
        self.cpu_workers = workers

    def run_done(
        self, seconds: float, samples: int, tail: bool = False, waited: float | None = None, queued: bool = True
    ) -> None:
        """A DALI run of `samples` completed `seconds` after the later of its start and the last completion.
        A tail run (a few tiny-batches training waits for) is not the share's rate: its fixed cost spread
        over a few samples would read as a slow accelerator and shrink G (the twin: runs of 4-40 between
        shares of 150, G down to 55), so only share runs feed the split rule. `waited`: how long its outputs
        took once asked for (`collected`), None where that says nothing of DALI's pace. `queued` False: the
        run was taken after the last completion, so `seconds` (from the end of its read: not the helpers' time)
        is DALI's latency for it, an upper bound of its pace (ShareController.accel_run), kept apart for when
        such a run is collected (`due`)."""
        if not tail:
            if waited is not None:
                self.timed_runs += 1
                self.collected(waited, samples)
            self.split.accel_run(seconds, samples, queued)
            if not queued and samples > 0:
                self._alone.append(seconds / samples)

    def due(self, active: list, last_done: float, due: float) -> float:
        """When to collect the oldest of the DALI runs in flight `active` ((tiny-batches, taken at, a tail run, what
        DALI was given: (pipeline, targets, its read's end)) each; `due`: the time chosen before; 0: now). DALI's
        outputs() wakes at every task its executor finishes while it waits, the runs' behind it too: a share run is
        collected at `collect_at` of its expected time (from the later of its start and `last_done`, the last run's
        completion; for a run taken when DALI had none of ours, from its read's end at the latency such runs showed),
        the awaited one too once the rate is settled (`may_wait`). At once: a tail run, an abandoned iterator's, or
        any before the rate is measured."""
        group, started, tail, payload = active[0]
        g = self.split.accel_s
        if g is None or tail or payload is None or group[0].generation != self.board.generation:
            return 0.0
        awaited = self.board.queue.awaited  # in a run in flight: training waits for it (outputs come in order)
        if not self.may_wait(any(awaited in set(map(key_of, run[0])) for run in active)):
            return 0.0
        begun = max(started, last_done)
        if started >= last_done:  # taken when DALI had none of ours: DALI's from its read's end, at such runs' latency
            begun = max(begun, payload[2])
            g = max(g, statistics.median(self._alone)) if self._alone else g
        due = due or begun + self.collect_at * g * images(group)
        return due if due - time.monotonic() > 0.002 else 0.0

    def may_wait(self, awaited: bool) -> bool:
        """Whether a share run may be left in DALI until its due time rather than waited for inside DALI's
        outputs(): one nobody awaits, always; the one training awaits once ACCEL_WINDOW timed runs make the
        rate -- before, the first run's start-up, or temporal sharing's runs (their intervals hold the training
        step), could make the median too long, and the run training waits for would be collected that late."""
        return not awaited or self.timed_runs >= ACCEL_WINDOW

    def collected(self, waited: float, samples: int) -> None:
        """A share run's outputs came `waited` seconds after they were asked for. Waited for: the run's
        completion interval was exact, and the next is asked for at COLLECT_AT of its expected time. Ready
        already: the interval was only an upper bound -- the time the thread chose to wait, from the rate
        itself -- so a DALI faster than the rate says would be followed 5% a run (the H100, 2026-11-28:
        runs collected at ~0.5 ms a sample for a whole benchmark, training waiting on CPU-only mini-batches
        meanwhile); the next is asked for at half the fraction, down to COLLECT_MIN, so the rate falls to
        DALI's own in a few runs. Judged before the run's own interval joins the rate."""
        expected = (self.split.accel_s or 0.0) * samples
        ready = waited < max(READY_S, READY_SHARE * expected)
        self.collect_at = max(COLLECT_MIN, self.collect_at / 2) if ready else COLLECT_AT
