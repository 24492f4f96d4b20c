"""The manager thread's liveness checks, once a turn under the board's lock: the workers that make no progress and
that nothing else would ever end (runtime/liveness.py holds the bounds; this module applies them).

- An own worker whose oldest tiny-batch has run past the stuck bound (doubled for each worker that tiny-batch
  killed before), or that is not READY START_S after its start: SIGKILLed; the death path requeues its work and
  the next `wait` replaces it (a start-up: `max_retries` times in a row).
- An own worker lent to another loader that stays stopped (SIGSTOP, a debugger's pause) for STOPPED_S (10 s): SIGKILLed
  by its owner, here. Neither side ended it before: its borrower drops a guest that is idle or not READY yet, and
  this loader waited for its HOME for ever -- a loader of one worker hung (found in session 39).
- A guest (another loader's worker lent to this one) past the stuck bound, or past the straggler bound while an own
  worker is idle (a stopped guest then costs seconds), or not READY START_S after its HELLO: SIGKILLed by its pid
  (the agent requeues what it held, a straggler's task with no death counted; its owner replaces it). A guest is
  killed rather than raced (runtime/reruns.py): it is its owner's.

A turn PAUSED_S or more after the one before means this process itself did not run: the whole job was stopped
(SLURM's `scontrol suspend` sends SIGSTOP to every process of it; a paused VM), its workers with it.
The time lost is added to every worker's and guest's clocks (`Pauses`), so no worker is killed at the resume for a
pause it took no part in (each busy one was, a death against its samples' max_retries); the worker kinds are told it
too (runtime/board.py `watch_kinds`: until session 48 the accelerator's runs in flight were given up as stalled at the
resume, and it retired).
"""

from __future__ import annotations

import logging
import time

from fusionflow.runtime import liveness
from fusionflow.runtime.counters import count_stuck_kill
from fusionflow.runtime.procs import is_stopped

log = logging.getLogger("fusionflow.loader")
# a lent worker stopped this long is ended by its owner: above the straggler floor, at which its borrower kills a
# stopped guest with no death counted while an own worker idles (the owner's kill reads there as a death)
STOPPED_S = 2 * liveness.STRAGGLER_FLOOR_S
# a turn this long after the one before (a turn waits 1 s, a message begun by a stopped worker REST_S = 5 s at most):
# this process did not run; under the stuck floor (25 s), so no pause of its own can kill a worker
PAUSED_S = 10.0


def overslept(slept: float, asked: float) -> float:
    """Seconds a process did not run while it waited `asked` s for something and `slept` s passed: 0.0 unless the
    wait overran by PAUSED_S or more (the whole job was stopped; a thread of its own that waits with a timeout tells,
    as the Ray gateway's loops do)."""
    over = slept - asked
    return over if over >= PAUSED_S else 0.0


class Pauses:
    """The manager thread's turns, to tell when this process itself did not run."""

    def __init__(self):
        self._last: float | None = None

    def lost(self, now: float) -> float:
        """Seconds this process did not run since the last turn (0.0: it ran)."""
        last, self._last = self._last, now
        return 0.0 if last is None or now - last < PAUSED_S else now - last


def kill_stuck(pool, agent, counters, lost: float) -> None:
    """(lock held) One turn of the checks above over `pool`'s workers and `agent`'s guests (None: no lending);
    `lost`: the seconds this process did not run since the last turn (`Pauses.lost`)."""
    now = time.monotonic()
    if lost:
        _forgive(pool, agent, lost)
    for w in pool.workers:
        if w is None or not w.alive or w.process is None or w.lost is not None:
            continue  # (lost: being stopped already, its tiny-batch's other copy won)
        if w.lent_to is not None:
            _end_if_stopped_away(w, now, counters)
            continue
        w.stopped_since = None  # (home: a stop seen during an earlier loan does not count towards the next)
        if not w.ready and now - w.started_at > liveness.START_S and w.killed_for is None:
            w.killed_for = f"not ready {now - w.started_at:.0f} s after its start"
            log.warning(
                "fusionflow CPU worker %d is %s (stopped, or worker_init_fn hangs?); killing it",
                w.worker_id,
                w.killed_for,
            )
            w.process.kill()
        elif w.outstanding:
            _kill_if_stuck(w, now, pool.task_seconds, counters)
    if agent is not None and agent.guests:
        _kill_stuck_guests(agent, pool, now)


def _forgive(pool, agent, lost: float) -> None:
    """This process did not run for `lost` s: its workers' and guests' clocks move on by as much."""
    log.info("fusionflow: this process did not run for %.0f s (stopped?); its workers' clocks skip the pause", lost)
    for w in [*pool.workers, *(agent.guests if agent is not None else ())]:
        if w is not None:
            w.head_since += lost
            w.started_at += lost


def _kill_if_stuck(w, now: float, task_seconds: float, counters) -> None:
    running_for, work = now - w.head_since, w.outstanding[0][1]
    if not liveness.is_stuck(running_for, task_seconds, work.deaths):
        return
    log.warning(
        "fusionflow CPU worker %d made no progress for %.0f s on samples %s (bound %.0f s); killing "
        "it: its tiny-batches run again, a replacement starts",
        w.worker_id,
        running_for,
        list(work.indices),
        liveness.stuck_bound(task_seconds, work.deaths),
    )
    count_stuck_kill(counters)
    w.killed_for = f"no progress for {running_for:.0f} s"
    w.process.kill()  # SIGKILL reaches a stopped process too; its sentinel wakes this thread
    w.head_since = now  # not killed again while it dies


def _end_if_stopped_away(w, now: float, counters) -> None:
    """An own worker lent out: killed once it has stayed stopped STOPPED_S (seen at each turn's look)."""
    if not is_stopped(w.process.pid):
        w.stopped_since = None
        return
    w.stopped_since = w.stopped_since or now
    if now - w.stopped_since > STOPPED_S and w.killed_for is None:
        w.killed_for = f"stopped {now - w.stopped_since:.0f} s while lent to loader {w.lent_to}"
        log.warning("fusionflow CPU worker %d is %s; killing it, a replacement starts", w.worker_id, w.killed_for)
        count_stuck_kill(counters)
        w.process.kill()


def _kill_stuck_guests(agent, pool, now: float) -> None:
    idle_own = any(w is not None and w.idle for w in pool.workers)
    for g in agent.guests:
        if not g.alive or g.peer_pid is None or g.killed_for is not None:
            continue
        if not g.ready:
            if g.owner is not None and now - g.started_at > liveness.START_S:  # (a HELLO: a worker, not the GM's bell)
                agent.kill_guest(g, f"was not ready {now - g.started_at:.0f} s after it arrived", False)
            continue
        if not g.outstanding:
            continue
        running_for, task_s = now - g.head_since, pool.task_seconds
        if liveness.is_stuck(running_for, task_s, g.outstanding[0][1].deaths):
            agent.kill_guest(g, f"made no progress for {running_for:.0f} s")
        elif idle_own and liveness.is_straggler(running_for, task_s):
            agent.kill_guest(g, f"made no progress for {running_for:.0f} s while an own worker is idle", False)
