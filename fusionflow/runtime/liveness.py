"""When a CPU worker's tiny-batch straggles, and when the worker counts as stuck. Pure.

A straggler -- a tiny-batch running `STRAGGLER_FACTOR` times longer than the recent mean, at least
`STRAGGLER_FLOOR_S` -- is started again on an idle worker and the first copy to finish wins
(runtime/reruns.py): the slow worker may be fine, its tiny-batch merely unlucky (a slow read).

A worker that is stopped (SIGSTOP, a paused container), swapping, or caught in a read that never
returns makes no progress and sends nothing: its pipe and its process sentinel stay quiet, so
nothing else wakes the manager. The manager thread looks at each own worker's oldest outstanding
tiny-batch once a second (runtime/stuck.py); past the bound it kills the worker, which then
goes through the death path like any other: its tiny-batches requeued (the one it was running
retried sample by sample, counted against `max_retries`, so a sample that hangs every worker is
reported by name), a replacement started at the next `wait`. A sample's pixels are a pure function
of (seed, epoch, index, copy), so the work runs again elsewhere with the same result.

The bound: `STUCK_FACTOR` times the running mean of a tiny-batch's time, never below `STUCK_FLOOR_S`
(a busy machine slows every tiny-batch alike: the mean follows it), and `FIRST_TASK_S` while no
tiny-batch has finished yet (a worker's first one may build native kernels); doubled for each worker the
tiny-batch killed before (at most MAX_DOUBLINGS times), so a sample merely slower than the bound
finishes. DataLoader's `timeout=` stays the last resort; with the default `timeout=0`, a training loop that
has waited WAIT_SAY_S for one mini-batch is told what it waits for (`waiting_on`), again at each doubling of
the wait.
"""

from __future__ import annotations

STUCK_FLOOR_S = 25.0
STUCK_FACTOR = 20.0
FIRST_TASK_S = 120.0
START_S = 120.0  # a worker not READY this long after its start (stopped, or a worker_init_fn that hangs) is killed
STRAGGLER_FLOOR_S = 5.0
STRAGGLER_FACTOR = 8.0
WAIT_SAY_S = 60.0  # a mini-batch awaited this long is reported (then at 120 s, 240 s, ...)


def straggler_bound(task_seconds: float) -> float:
    """Seconds a tiny-batch may run before it is started again on an idle worker (inf while no
    tiny-batch has finished: the first ones may build native kernels, and there is no mean yet)."""
    if task_seconds <= 0:
        return float("inf")
    return max(STRAGGLER_FLOOR_S, STRAGGLER_FACTOR * task_seconds)


def is_straggler(running_for: float, task_seconds: float) -> bool:
    return running_for > straggler_bound(task_seconds)


MAX_DOUBLINGS = 3  # the stuck bound grows at most 8-fold over a tiny-batch's tries


def stuck_bound(task_seconds: float, tries: int = 0) -> float:
    """Seconds a worker's oldest outstanding tiny-batch may run before the worker counts as stuck; doubled for each
    worker the tiny-batch killed before (`tries`, its `deaths`): a sample merely slower than the bound (a stalled
    network read) finishes on a later try instead of failing its mini-batch, while one that never returns is still
    reported by name after max_retries tries (25 + 50 + 100 s at the floor and the default max_retries=2)."""
    if task_seconds <= 0:
        return max(FIRST_TASK_S, STUCK_FLOOR_S) * 2 ** min(tries, MAX_DOUBLINGS)
    return max(STUCK_FLOOR_S, STUCK_FACTOR * task_seconds) * 2 ** min(tries, MAX_DOUBLINGS)


def is_stuck(running_for: float, task_seconds: float, tries: int = 0) -> bool:
    return running_for > stuck_bound(task_seconds, tries)


def holders(queued: int, running, others) -> str:
    """Who holds a mini-batch's outstanding samples: `running` = [(who, seconds on its oldest tiny-batch or run)],
    `others` = the other worker kinds' names (Ray) that do not say what they hold."""
    busy = ", ".join(f"{who} {secs:.0f} s" for who, secs in sorted(running, key=lambda r: -r[1])) or "none"
    return f"{queued} tiny-batches queued; running, on their oldest tiny-batch: {busy}" + (
        f"; other worker kinds: {', '.join(others)}" if others else ""
    )


def oldest_samples(conn) -> str:
    """The samples of a worker's oldest outstanding tiny-batch (`conn.outstanding`: (task id, Work)), as said."""
    return f"(samples {list(conn.outstanding[0][1].indices)})"


def waiting_on(seq: int, waited: float, remaining: int, size: int, held: str) -> str:
    """The warning for a training loop waiting `waited` s for mini-batch `seq` (`held`: `holders`)."""
    return (
        f"fusionflow: the training loop has waited {waited:.0f} s for mini-batch {seq} ({remaining} of {size} "
        f"samples outstanding; {held}). A stuck CPU worker is killed and its work run again at the stuck bound; "
        "timeout= ends the wait"
    )


# why a sample's count of killed workers can exceed max_retries + 1 (max_retries=0 and 2 killed, say)
GROUP_DEATHS = (
    "its tiny-batch's deaths count too: a tiny-batch that kills a worker is retried sample by sample "
    "to find which one does"
)


def culprit_advice(how: str) -> str:
    """What to check about a sample whose tries killed workers, by how the last one ended."""
    if "no progress" in how:  # killed past the stuck bound, doubled at each try
        return (
            "Its last try ran past the stuck bound (25 s or 20x the mean tiny-batch, doubled at each retry): check "
            "that sample's read (dataset.describe / path: a network read that stalls, a lock); raise max_retries to "
            "let a sample that slow finish."
        )
    return "Check that sample (dataset.describe / path) for a file that crashes the decoder or exhausts memory."
