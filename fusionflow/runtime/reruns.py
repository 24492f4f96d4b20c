"""Tiny-batches running on two CPU workers at once: a straggler started again, the first copy wins.

A tiny-batch that its worker has run past the straggler bound (runtime/liveness.py: a multiple of the
recent mean, with a floor) is sent again -- the same Work, the same ring positions -- to an idle own
worker; the manager thread looks once per turn (`WorkerPool.rerun_stragglers`). Both copies write the
same bytes, since a sample's pixels are a pure function of (seed, epoch, index, copy), and the first
DONE completes the tiny-batch. Before that completion is accounted -- after it the mini-batch may be
delivered and its ring slot reused -- the other copy's worker is SIGKILLed and reaped, so it never
writes again; a SIGKILLed process runs no more of its own code, also when it was stopped. That death
is no sample's fault: its other tiny-batches are requeued whole, and it is replaced at the next `wait`
like any dead worker. Its copy shows in the trace as a "discarded" span.

A copy whose worker dies (or is killed as stuck) before either finished leaves the other to run on
alone: nothing is requeued. A sample that hangs every worker therefore still ends as the stuck bound
and `max_retries` say, once the second copy is stuck too.

The pairs are owned here; the pool calls in with the board's lock held.
"""

from __future__ import annotations

import logging

from fusionflow.runtime import liveness

log = logging.getLogger(__name__)


class Reruns:
    def __init__(self, counters):
        self.counters = counters
        self._pairs: dict[int, tuple] = {}  # id(work) -> (work, first worker, second worker)

    def pick(self, workers, task_seconds: float, now: float, generation: int) -> list[tuple]:
        """(work, its worker, an idle worker) for each current tiny-batch that straggles, as long as
        idle own workers last. `workers`: the pool's WorkerConns (None where a slot is empty)."""
        own = [w for w in workers if w is not None and w.process is not None and w.lost is None]
        idle = [w for w in own if w.idle]
        picks = []
        for w in own:
            if not idle:
                break
            if not w.alive or w.lent_to is not None or not w.outstanding:
                continue
            work = w.outstanding[0][1]
            if work.generation != generation or id(work) in self._pairs:
                continue
            if liveness.is_straggler(now - w.head_since, task_seconds):
                picks.append((work, w, idle.pop()))
        return picks

    def started(self, work, first, second, now: float) -> None:
        """`work`, straggling on `first`, was sent to `second` too."""
        log.info(
            "fusionflow CPU worker %d has run samples %s for %.1f s; starting them again on worker %d",
            first.worker_id,
            list(work.indices),
            now - first.head_since,
            second.worker_id,
        )
        self._pairs[id(work)] = (work, first, second)
        self.counters.tiny_batches_rerun += 1

    def settle(self, work, finisher):
        """`finisher` completed `work`: the worker of its other copy, which must be stopped, or None
        when `work` was running once."""
        pair = self._pairs.pop(id(work), None)
        if pair is None:
            return None
        _, first, second = pair
        if finisher is second:
            self.counters.reruns_won += 1
            return first
        return second

    def forget(self, work) -> bool:
        """A copy's worker left before either copy finished: the other runs on alone. Whether `work`
        had another copy (then it must not be requeued)."""
        return self._pairs.pop(id(work), None) is not None
