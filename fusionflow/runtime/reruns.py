"""A tiny-batch running on several CPU workers at once: a straggler started again, the first copy wins.

A tiny-batch that its worker has run past the straggler bound (runtime/liveness.py: a multiple of the
recent mean, with a floor) is sent again -- the same Work, the same ring positions -- to an idle own
worker; the manager thread looks once per turn (`WorkerPool.rerun_stragglers`). The copies write the
same bytes, since a sample's pixels are a pure function of (seed, epoch, index, copy), and the first
DONE completes the tiny-batch. Before that completion is accounted -- after it the mini-batch may be
delivered and its ring slot reused -- the other copies' workers are SIGKILLed and reaped, so they never
write again; a SIGKILLed process runs no more of its own code, also when it was stopped. Such a death
is no sample's fault: the worker's other tiny-batches are requeued whole, and it is replaced at the
next `wait` like any dead worker. A lost copy shows in the trace as a "discarded" span.

A copy whose worker dies (or is killed as stuck) before any finished leaves the others to run on:
nothing is requeued, but the death counts against the tiny-batch (the stuck bound doubles for the copies
left), and a tiny-batch with a death is not started again as a straggler. A sample that hangs every
worker therefore ends as the stuck bound and `max_retries` say, once its last copy's worker is killed
(started again on each replacement, its copies had kept it running for ever, no death counted).

A copy that straggles too (its worker stopped as well) gets a third, up to MAX_COPIES. The copies are
owned here; the pool calls in with the board's lock held.
"""

from __future__ import annotations

import logging

from fusionflow.runtime import liveness

log = logging.getLogger(__name__)


MAX_COPIES = 3  # a tiny-batch runs on at most this many workers at once


class Reruns:
    def __init__(self, counters):
        self.counters = counters
        self._copies: dict[int, tuple] = {}  # id(work) -> (work, the workers running it, first copy first)

    def pick(self, workers, task_seconds: float, now: float, generation: int) -> list[tuple]:
        """(work, a worker running it, an idle worker) for each current tiny-batch whose every copy
        straggles (fewer than MAX_COPIES), as long as idle own workers last. `workers`: the pool's
        WorkerConns (None where a slot is empty)."""
        own = [w for w in workers if w is not None and w.process is not None and w.lost is None]
        idle = [w for w in own if w.idle]
        picks, seen = [], set()
        for w in own:
            if not idle:
                break
            if not w.alive or w.lent_to is not None or not w.outstanding:
                continue
            work = w.outstanding[0][1]
            if work.generation != generation or id(work) in seen or work.deaths:  # (a death: the stuck bound's)
                continue
            seen.add(id(work))
            runners = self._copies.get(id(work), (work, [w]))[1]  # each copy is the head of its worker
            if len(runners) < MAX_COPIES and all(
                liveness.is_straggler(now - r.head_since, task_seconds) for r in runners
            ):
                picks.append((work, w, idle.pop()))
        return picks

    def started(self, work, first, again, now: float) -> None:
        """`work`, straggling on `first` (and on any earlier copy's worker), was sent to `again` too."""
        log.info(
            "fusionflow CPU worker %d has run samples %s for %.1f s; starting them again on worker %d",
            first.worker_id,
            list(work.indices),
            now - first.head_since,
            again.worker_id,
        )
        self._copies.setdefault(id(work), (work, [first]))[1].append(again)
        self.counters.tiny_batches_rerun += 1

    def settle(self, work, finisher) -> list:
        """`finisher` completed `work`: the workers of its other copies, which must be stopped ([]
        when `work` was running once)."""
        entry = self._copies.pop(id(work), None)
        if entry is None:
            return []
        if finisher is not entry[1][0]:
            self.counters.reruns_won += 1
        return [w for w in entry[1] if w is not finisher]

    def forget(self, work, worker) -> bool:
        """`worker`, running a copy of `work`, left before any copy finished: whether other copies run
        on (then `work` must not be requeued)."""
        entry = self._copies.get(id(work))
        if entry is None:
            return False
        left = [w for w in entry[1] if w is not worker]
        if len(left) > 1:
            self._copies[id(work)] = (work, left)
        else:
            del self._copies[id(work)]  # one copy left: it runs as any tiny-batch does
        return bool(left)
