"""The CPU worker pool: this loader's worker processes, from start to kill.

It starts workers (on the training thread only: forking happens there), restarts dead ones, applies
an elastic worker target (starting missing workers, retiring surplus idle ones), feeds live workers
tasks from the board's queue, reads their messages (READY, FATAL, DONE, HOME) and notices deaths by
their process sentinels, and stops them at shutdown. The manager thread drives it: `waitables()` and
`handle(ready)` plug into the manager's one wait.

It is handed the board (runtime/board.py) and callbacks for its owner (capacity changes, stage times, faults). It
keeps the `WorkerKind` contract, but the local manager drives its start and stop itself (its stop must follow the
manager thread's, which waits on its pipes); the board's `draining()` asks it through `board.watch_stale`.

Retry policy (`requeue_outstanding`): a departed worker's tasks go back to the front of the queue;
the task it was running is split into single samples so the culprit is isolated; a sample whose
task has killed `max_retries + 1` workers fails its mini-batch with an error naming it. A straggling
task is started again on an idle worker, the first copy wins (`rerun_stragglers`, runtime/reruns.py).

Lent-out workers stay records here (`lent_to`); workers lent *to* this loader are guests of the
lending agent (runtime/gm/agent.py), but get tasks and report completions here like own workers.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import multiprocessing as mp
import os
import signal
import time

from fusionflow.errors import SampleKilledWorkersError, WorkerStartError, worker_start_error
from fusionflow.runtime import liveness, procs
from fusionflow.runtime import messages as m
from fusionflow.runtime.authsock import recv_whole
from fusionflow.runtime.cores import CoreClaim
from fusionflow.runtime.counters import count_stuck_kill, count_worker_task
from fusionflow.runtime.procs import end_processes, run_every
from fusionflow.runtime.reruns import Reruns
from fusionflow.runtime.shm import ChildFd, sigbus_error
from fusionflow.runtime.spec import RuntimeSpec
from fusionflow.runtime.worker import worker_loop
from fusionflow.runtime.worker_conn import WorkerConn
from fusionflow.scheduling.queue import Work

log = logging.getLogger(__name__)
PER_WORKER = 2  # tasks queued per worker: one running, one ready to start without a round trip
STOP_GRACE_S = 2.0  # shutdown: how long workers get to exit after STOP before terminate()


class WorkerPool:
    def __init__(
        self,
        board,
        dataset,
        spec: RuntimeSpec,
        spec_hash: bytes | None = None,
        on_stage_times=None,
        on_capacity=None,
        on_fatal=None,
    ):
        self.board, self.dataset, self.spec = board, dataset, spec
        self.ctx = spec.mp_context if spec.mp_context is not None else mp.get_context()
        self.spec_hash = spec_hash  # the lending spec's hash (workers lent to other LMs check it), or None
        self.on_stage_times = on_stage_times  # callback(worker label, stage ns totals) under the lock
        self.on_capacity = on_capacity  # callback(live worker count) under the lock: the count changed
        self.on_fatal = on_fatal  # callback(exception) under the lock: a fault the owner's next wait raises
        self.workers: list[WorkerConn | None] = [None] * spec.num_workers
        self.target_workers = spec.num_workers
        self.task_ids = itertools.count()
        self.task_seconds = 0.0  # running mean of a tiny-batch's time on a worker
        self.cores = CoreClaim(0, False)  # workers' cores, claimed node-wide at start
        self._live: list[WorkerConn] = []  # the manager thread's snapshot for its current wait
        self._stopped = False
        self._start_kills: dict[int, int] = {}  # worker id -> start-ups in a row a signal ended (before READY)
        self.reruns = Reruns(board.counters)  # stragglers running on a second worker (runtime/reruns.py)
        (per := board.counters.tiny_batches_per_worker).extend([0] * (spec.num_workers - len(per)))  # the run's

    # ---------------------------------------------------------------- processes (main thread)
    def start(self) -> None:
        """Claim cores, then start every worker process (the training thread: forking happens there only)."""
        self.cores = CoreClaim(self.spec.num_workers, self.spec.pin_workers, self.spec.trainer_cores)
        for wid in range(self.spec.num_workers):
            self.start_worker(wid)

    def start_worker(self, wid: int) -> None:
        board, spec = self.board, self.spec
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=worker_loop,
            name=f"{procs.OURS}worker-{wid}",
            daemon=True,
            args=(
                wid,
                self.dataset,
                spec.policy,
                ChildFd(board.ring.fd),
                spec.layout,
                child,
                spec.seed,
                spec.base_seed,
                spec.worker_init_fn,
                os.getpid(),
                self.cores.core_of(wid),
                self.spec_hash,
                spec.stages,
                spec.cache.handle(wid) if spec.cache is not None else None,
                max(spec.num_workers, self.target_workers, wid + 1),  # get_worker_info(): id < num_workers, grown too
            ),
        )
        # Objects awaiting garbage collection at fork time (e.g. a DALI pipeline whose finalizer joins
        # threads that only exist here) must never be finalized in the child: frozen objects are
        # skipped by the child's collector, and the parent collects them after unfreezing.
        gc.freeze()
        try:  # the user's (or our inline) OpenCV work must not hang the child; a Ctrl-C waits until it is listed
            with procs.starting_worker(self.dataset, spec):
                proc.start()
                with board.cond:
                    self.workers[wid] = WorkerConn(wid, proc, parent)
        finally:
            gc.unfreeze()
        child.close()
        board.wake()

    def wanted(self) -> tuple[list[int], int]:
        """(lock held) Dead workers to replace or reap, and how many to start for the target."""
        dead = [w.worker_id for w in self.workers if w is not None and not w.alive]
        return dead, self.target_workers - len(self.kept_workers())

    def restart_and_resize(self, dead: list[int], missing: int) -> None:
        """Main thread: replace dead workers (retired ones are only reaped) and start new ones up to
        the elastic target."""
        board = self.board
        for wid in dead:
            retired = self.workers[wid].retiring
            self._reap(wid)
            if retired:
                with board.cond:
                    self.workers[wid] = None
            else:
                self.start_worker(wid)
                board.counters.worker_restarts += 1
        if missing > 0:
            for _ in range(missing):
                with board.cond:
                    wid = next((k for k, w in enumerate(self.workers) if w is None), len(self.workers))
                    if wid == len(self.workers):
                        self.workers.append(None)  # (its count: count_worker_task extends the run's list)
                self.start_worker(wid)
            with board.cond:
                self.notify_capacity()

    def kept_workers(self) -> list[WorkerConn]:
        """Own workers that count towards the target: not retiring (dead ones awaiting a restart count)."""
        return [w for w in self.workers if w is not None and not w.retiring]

    def notify_capacity(self) -> None:
        """The live worker count changed (lock held)."""
        self.board.counters.worker_count_changes += 1
        if self.on_capacity is not None:
            self.on_capacity(len(self.kept_workers()))

    def retire_surplus(self) -> None:
        """(lock held) Retire workers above the target, dead ones first, then the least busy: no more tasks, and STOP
        now, read after the tasks they hold (an idle one never came in a busy loader); lent or starting: later."""
        kept = self.kept_workers()
        ready = [w for w in kept if w.alive and w.ready and w.lent_to is None]
        surplus = max(0, len(kept) - self.target_workers)
        dead = [w for w in kept if not w.alive]  # awaiting a restart: only reaped instead
        for w in (dead + sorted(ready, key=lambda w: (len(w.outstanding), -w.worker_id)))[:surplus]:
            w.retiring = True
            if w.alive:
                w.send_stop()
            self.notify_capacity()

    def _reap(self, wid: int) -> None:
        w = self.workers[wid]
        w.process.join(timeout=1.0)
        w.conn.close()

    def stop(self) -> None:
        """Shutdown step: STOP to every worker (a lent one's borrower requeues what it held), SIGUSR1 to a busy
        one (its STOP waits behind a task nobody awaits); join each for up to STOP_GRACE_S in all; terminate() the
        rest, then kill(); close the pipes; release the cores once no worker runs on them. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        workers = [w for w in self.workers if w is not None]
        end = functools.partial(end_processes, [w.process for w in workers], STOP_GRACE_S)
        busy = functools.partial(procs.stop_after_read, [w.process for w in workers if w.outstanding])
        # a Ctrl-C in any step still ends every worker, closes the pipes and releases the cores
        run_every(*(w.send_stop for w in workers), busy, end, *(w.conn.close for w in workers), self.cores.release)

    # ---------------------------------------------------------------- tasks (lock held)
    def busy_with_stale(self, generation: int) -> bool:
        """Whether a worker (own, or lent out) still holds a task of an iterator older than `generation`."""
        return any(work.generation != generation for w in self.workers if w is not None for _tid, work in w.outstanding)

    def dispatch(self, guests, per_worker: int) -> None:
        """Give queued work to own workers and `guests` with room, up to `per_worker` tasks each."""
        own = [w for w in self.workers if w is not None and w.alive and w.ready and w.lent_to is None]
        own = [w for w in own if not w.retiring and w.lost is None]
        guests = [g for g in guests if g.alive and g.ready]
        for depth in range(1, per_worker + 1):  # everyone gets a running task before anyone a queued one
            for w in own + guests:
                while len(w.outstanding) < depth:
                    work = self.board.take_cpu(upto=w.serve_upto)
                    if work is None or not self.send(w, work):
                        break

    def rerun_stragglers(self, now: float) -> None:
        """Start tiny-batches that straggle again on idle own workers; the first copy wins (runtime/reruns.py)."""
        for work, first, second in self.reruns.pick(self.workers, self.task_seconds, now, self.board.generation):
            if self.send(second, work, requeue=False):
                self.reruns.started(work, first, second, now)

    def send(self, w: WorkerConn, work: Work, requeue: bool = True) -> bool:
        task_id = next(self.task_ids)
        try:
            w.conn.send_bytes(
                m.pack_task(
                    m.Task(task_id, work.generation, work.slot, work.epoch, work.positions, work.indices, work.copies)
                )
            )
        except OSError:
            if requeue:
                self.board.requeue([work])
            return False
        if not w.outstanding:
            w.head_since = time.monotonic()
        w.outstanding.append((task_id, work))
        return True

    def on_done(self, w: WorkerConn, msg: bytes) -> bool:
        """A DONE from an own worker or a guest: account its oldest outstanding task (False: a copy
        of a tiny-batch that ran twice whose other copy was counted)."""
        board = self.board
        task_id, _gen, failures, targets = m.unpack_done(msg)
        sent_id, work = w.outstanding.popleft()
        if sent_id != task_id:
            raise RuntimeError(f"worker {w.worker_id} completed task {task_id}, expected {sent_id}")
        if work is w.lost:
            return False
        for loser in self.reruns.settle(work, w):
            self._stop_loser(loser, work)
        now = time.monotonic()
        took = now - w.head_since
        self.task_seconds = took if not self.task_seconds else 0.8 * self.task_seconds + 0.2 * took
        w.head_since = now
        if board.trace is not None or self.on_stage_times is not None:
            started, ended, stage_ns = m.unpack_done_times(msg)
            if board.trace is not None:
                board.trace.tiny_batch(w.worker_id, work, started, ended, board.sizes)
            if stage_ns and self.on_stage_times is not None:
                self.on_stage_times(w.worker_id, stage_ns)
        board.complete(work, failures, on_accelerator=False, targets=targets)
        return True

    def requeue_outstanding(self, w: WorkerConn, how: str, suspect: bool = True) -> None:
        """Put a departed worker's tasks back (lock held); if it died (`suspect`), the one it was
        running may be the cause: it counts a death and is retried sample by sample."""
        board, requeue = self.board, []
        for k, (_tid, work) in enumerate(w.outstanding):
            if work.generation != board.generation or not board.queue.tracks(work) or work is w.lost:
                continue
            if self.reruns.forget(work, w):  # another copy runs on: not requeued, a death counted (runtime/reruns.py)
                work.deaths += int(k == 0 and suspect)
                continue
            if k == 0 and suspect:  # the task it was running
                work.deaths += 1
                if len(work.positions) > 1:  # isolate the culprit: retry sample by sample
                    requeue += work.singles()
                    continue
                if work.deaths > self.spec.max_retries:
                    board.queue.batches[work.key].error = SampleKilledWorkersError(
                        f"sample {work.indices[0]} killed {work.deaths} CPU worker processes (last: {how}; "
                        + liveness.GROUP_DEATHS
                        + f"); giving up after max_retries={self.spec.max_retries}. {liveness.culprit_advice(how)}",
                        list(work.indices),
                    )
                    continue
            requeue.append(work)
        w.outstanding.clear()
        board.requeue(requeue)
        board.cond.notify_all()

    # ---------------------------------------------------------------- the manager thread's wait
    def waitables(self) -> list:
        """(lock held) Live workers' pipes and process sentinels; remembered for `handle`."""
        self._live = [w for w in self.workers if w is not None and w.alive]
        return [w.conn for w in self._live] + [w.process.sentinel for w in self._live]

    def handle(self, ready) -> None:
        """A waitable of the last `waitables()` is ready: a message, or a process that ended."""
        w = next((w for w in self._live if ready is w.conn or ready == w.process.sentinel), None)
        if w is None or not w.alive:
            return
        if ready is w.conn:
            self._on_message(w)
        elif not w.process.is_alive():
            while w.alive and w.conn.poll():  # what it finished before dying still counts
                self._on_message(w)
            self._on_death(w)

    def _stop_loser(self, w: WorkerConn, work: Work) -> None:
        """(lock held) Another copy of `work` finished first: end `w` before that completion is accounted
        (the mini-batch may then be delivered and its slot reused: `w` must never write again)."""
        w.lost = work
        if self.board.trace is not None:
            self.board.trace.discarded(w.worker_id, work, int(w.head_since * 1e9), time.monotonic_ns())
        w.process.kill()
        w.process.join(timeout=1.0)  # reaped; one still in the kernel (a read) never returns to its own code
        while w.alive and w.conn.poll():  # what it finished before still counts; its copy of `work` does not
            self._on_message(w)
        self._on_death(w)

    def _on_message(self, w: WorkerConn) -> None:
        board = self.board
        try:
            msg = recv_whole(w.conn)
        except TimeoutError as exc:  # stopped mid-message: it would hold the manager thread, so every worker
            self._kill(w, f"stopped in the middle of a message ({exc})")
            return
        except (EOFError, OSError):
            w.process.join(timeout=1.0)
            self._on_death(w)
            return
        kind = m.kind_of(msg)
        with board.cond:
            if kind == m.READY:
                w.ready = True
                self._start_kills.pop(w.worker_id, None)
            elif kind == m.FATAL:
                text, kind = m.unpack_fatal(msg)  # (as DataLoader re-raises: the worker's exception's type too)
                self._fail(worker_start_error(f"CPU worker {w.worker_id} failed to start:\n{text}", kind))
                w.alive = False
            elif kind == m.HOME:  # back from a loan
                w.lent_to = None
                tasks = m.unpack_message(msg, m.Home).tasks
                board.counters.lent_tiny_batches += tasks
                if board.trace is not None:
                    board.trace.home(w.worker_id, tasks)
            elif kind == m.DONE:
                if self.on_done(w, msg):
                    count_worker_task(board.counters, w.worker_id)
            board.cond.notify_all()

    def _kill(self, w: WorkerConn, why: str) -> None:
        """Kill a worker that stopped mid-message, reap it, and take its death as any other's (requeue, replace)."""
        log.warning("fusionflow CPU worker %d %s; killing it: its tiny-batches run again", w.worker_id, why)
        with self.board.cond:
            count_stuck_kill(self.board.counters)
            w.killed_for = why
        w.process.kill()
        w.process.join(timeout=1.0)
        self._on_death(w)

    def _killed_while_starting(self, w: WorkerConn, code, how: str) -> bool:
        """(lock held) A worker that a signal from outside ended before it was ready (not SIGBUS: that
        is the shared memory's fault) is started again, up to max_retries times in a row."""
        kills = self._start_kills.get(w.worker_id, 0)
        if code is None or code >= 0 or code == -signal.SIGBUS or kills >= self.spec.max_retries:
            return False
        self._start_kills[w.worker_id] = kills + 1
        log.warning("fusionflow CPU worker %d was killed (%s) while it started; starting it again", w.worker_id, how)
        return True

    def _fail(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _on_death(self, w: WorkerConn) -> None:
        board = self.board
        with board.cond:
            if not w.alive:
                return
            w.alive = False
            code = w.process.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            how = f"killed: {w.killed_for}" if w.killed_for else how
            if w.retiring and code == 0:
                self.requeue_outstanding(w, how)
            elif w.lost is not None:  # stopped: another copy of its tiny-batch finished first
                log.info("fusionflow CPU worker %d stopped (its tiny-batch's other copy won): replaced", w.worker_id)
                self.requeue_outstanding(w, how, suspect=False)
            elif not w.ready and self._killed_while_starting(w, code, how):
                self.requeue_outstanding(w, how, suspect=False)
            elif not w.ready:  # it never came up: restarting would only repeat that
                kills = self._start_kills.get(w.worker_id, 0)
                again = f" ({kills + 1} start-ups in a row; max_retries={self.spec.max_retries})" if kills else ""
                self._fail(WorkerStartError(f"CPU worker {w.worker_id} exited ({how}) before it was ready{again}"))
            elif code == -signal.SIGBUS:  # it touched shared memory the system could not supply: not a sample's fault
                self.requeue_outstanding(w, how, suspect=False)
                self._fail(sigbus_error(f"CPU worker {w.worker_id}", self.spec.layout.nbytes))
            else:
                w.retiring = False  # a retiring worker that crashed is replaced like any other
                log.warning("fusionflow CPU worker %d died (%s); restarting it", w.worker_id, how)
                self.requeue_outstanding(w, how)
            board.cond.notify_all()  # the main thread restarts or reaps it, or raises the fault
