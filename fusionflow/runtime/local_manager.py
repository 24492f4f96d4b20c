"""Local manager: one per loader. Owns the CPU worker processes, the shared batch ring and the
sorted tiny-batch queue, and turns submitted mini-batches into completed ring slots.

Threads and processes
  * The training (main) thread submits mini-batches (`submit`), waits for them (`wait`), starts and
    restarts worker processes (forking only ever happens on this thread) and shuts down.
  * The manager thread ("fusionflow-manager") feeds workers: each live worker holds at most
    `PER_WORKER` tasks; it takes the front of the queue -- the oldest mini-batch's smallest
    tiny-batch -- so workers stay busy while the training step runs. It blocks in
    `multiprocessing.connection.wait` on worker pipes *and* process sentinels, so a dead worker
    wakes it at once instead of hanging anything.

Faults
  * A worker that dies (e.g. SIGKILL): its tasks go back to the front of the queue; the task it was
    running is split into single samples, so the culprit is isolated; a sample whose task has killed
    `max_retries + 1` workers fails its mini-batch with an error naming it. A replacement
    worker is started by the main thread at its next `wait`. A worker killed by SIGBUS is never
    blamed on a sample: shared memory could not be backed (the ring is reserved at creation, so
    this means /dev/shm was exhausted under us); the loader fails with a `SharedMemoryError`.
  * A sample whose decode/augment raises: reported as data (`SampleFailure`) with its traceback.
  * A worker that fails to start (e.g. `worker_init_fn` raised): a `WorkerStartError` with its
    traceback at the next `wait`.

Global manager (DDP, `job` given; runtime/global_manager.py)
  * The manager thread publishes this LM's progress row on every event and reads its action row
    when the GM rings (a BELL on the GM's connection to this LM's socket; otherwise every
    `GM_IDLE_S`): a Yield order sends up to Count idle workers a LEND (they connect to the
    borrower's socket and report HOME when returned); lent workers get no tasks here meanwhile.
    A lent worker that dies is restarted like any other.
  * Workers lent *to* this LM ("guests") arrive on its socket (`GMLink.accept`), get the ring, seed
    and spec, then take tiny-batches like local workers -- but only of the mini-batches submitted
    before they arrived (the iteration they were lent for). When none is left for a guest, it is
    sent RETURN. A guest whose connection drops has its tasks requeued exactly as a dead worker's.
  * Elastic capacity: a new worker target (GM API) is applied here: the main thread starts the
    missing workers at its next `wait`; surplus idle workers are sent STOP and not restarted;
    `on_capacity_change(n)` tells TAAS to search again.

Shutdown procedure (`shutdown`, idempotent; also run by the loader's finalizer at collection/exit)
  0. Stop the other worker kinds (`add_worker_kind`, e.g. Ray actors), then the accelerator worker thread, if any (it finishes its tiny-batch) and close its pipeline;
     drop the loader's callbacks and the accelerator (they refer back to this manager).
  1. Stop the manager thread (control pipe) and join it.
  2. Send RETURN to guests and close their connections (their owners' workers go home); leave the
     global-manager table (free the row, close the socket; `GMLink.close`).
  3. Send STOP to every worker (a lent one stops too: its borrower requeues what it held); join each
     for up to 2 s; terminate() the rest, then kill().
  4. Close the pipes; wait (host) for the last batch's copies out of the ring (`copy_event`, GPU
     delivery), unregister the ring from CUDA if registered, drop the mapping and descriptor.
  The ring's name is unlinked the moment it is created: workers map it from a descriptor
  (inherited at fork, duplicated for spawn, sent over the Unix socket to lent workers), so its
  memory goes when the last process holding it exits -- even when the whole job is SIGKILLed.
  If the training process is killed alone, workers notice within `worker.WATCHDOG_S` and exit.
"""
from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait as mp_wait

from fusionflow.errors import FusionFlowError, SampleKilledWorkersError, SharedMemoryError, WorkerStartError
from fusionflow.runtime import messages as m
from fusionflow.runtime.shm import SHM_DIR, BatchRing, ChildFd, RingLayout, free_bytes, send_fd
from fusionflow.runtime.worker import worker_loop
from fusionflow.scheduling import split_sorted
from fusionflow.scheduling.queue import BatchState, TinyBatchQueue, Work

log = logging.getLogger(__name__)
PER_WORKER = 2  # tasks queued per worker: one running, one ready to start without a round trip
GM_IDLE_S = 0.1  # with a GM: progress heartbeat, elastic target and GM liveness at least this often


class _Worker:
    """One of this LM's worker processes, or (process None) a guest: another LM's worker lent to us."""

    def __init__(self, worker_id, process, conn):
        self.worker_id, self.process, self.conn = worker_id, process, conn
        self.outstanding: deque[tuple[int, Work]] = deque()  # (task_id, work), in sending order
        self.ready = False
        self.alive = True
        self.head_since = 0.0  # when its oldest outstanding task started (CLOCK_MONOTONIC)
        self.lent_to: int | None = None  # own worker now serving that LM
        self.retiring = False  # sent STOP for a lower worker target: not restarted
        self.serve_upto = None  # guest: the newest mini-batch key it may work on

    @property
    def idle(self) -> bool:
        return self.alive and self.ready and self.lent_to is None and not self.retiring and not self.outstanding


class LocalManager:
    def __init__(self, dataset, policy, layout: RingLayout, num_workers: int, seed: int,
                 worker_init_fn=None, mp_context=None, pin_cpus: bool | str = True, max_retries: int = 2,
                 sizes=None, tiny_batch_size: int = 4, base_seed: int = 0, job: str | None = None,
                 spec: bytes | None = None, stages: tuple[str, ...] | None = None):
        self.dataset, self.policy, self.layout = dataset, policy, layout
        self.num_workers, self.seed, self.base_seed = num_workers, seed, base_seed
        self.worker_init_fn, self.max_retries = worker_init_fn, max_retries
        self.sizes, self.tiny_batch_size = sizes, tiny_batch_size
        self.ctx = mp_context if mp_context is not None else mp.get_context()
        self.pin_cpus = pin_cpus
        self.ring = BatchRing(layout)
        self.ring.unlink()  # no name to outlive a job killed as a whole: workers get the descriptor
        self.workers: list[_Worker | None] = [None] * num_workers
        self.target_workers = num_workers
        self.on_capacity_change = None  # callback(live worker count) under the lock, e.g. TAAS restart
        self.guests: list[_Worker] = []
        self.link = None  # GMLink when a global manager coordinates this job
        self.bell = None  # the GM's connection to our socket (it rings when it writes us an order)
        self.lent_total = self.guests_total = self.lent_tasks = self.guest_tasks = 0
        self.completed_batches = 0
        self.capacity_changes = 0
        self.task_seconds = 0.0  # running mean of a tiny-batch's time on a worker
        # per mini-batch (oldest first): its tiny-batches, ascending by encoded size. CPU workers take
        # from the front, the accelerator from the back; the largest `reserved` stay the accelerator's.
        self.queue = TinyBatchQueue()  # pure; guarded by `cond`
        self.accelerator = None  # an AcceleratorWorker, attached by the loader
        self.on_batch_done = None  # callback(state) under the lock, e.g. TAAS feedback
        self.generation = 0
        self.cond = threading.Condition()
        self.task_ids = itertools.count()
        self.fatal: BaseException | None = None
        self.restarts = 0
        self.tasks_per_worker = [0] * num_workers
        self.cuda_registered = False  # the ring is page-locked for direct host->device copies
        self.cuda_device = None  # the loader's CUDA device index, once registered
        self.copy_event = None  # CUDA event after the last batch's copies out of the ring (GPU delivery)
        self.stages = stages  # stage names workers time per sample (fusionflow/stages.py), or None
        self.on_stage_times = None  # callback(worker label, stage ns totals) under the lock
        self.trace = None  # a fusionflow.trace.TraceRecorder while the loader traces
        self.worker_kinds = []  # other kinds of workers on this queue (e.g. runtime/remote.py's Ray actors)
        self._closed = False
        self._ctrl_r, self._ctrl_w = mp.Pipe(duplex=False)
        try:
            if job is not None:
                from fusionflow.runtime.gm_link import GMLink
                self.link = GMLink(job, self.ring.name, spec)
            for wid in range(num_workers):
                self._start_worker(wid)
        except BaseException:
            self.shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name="fusionflow-manager", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- main thread
    def _cpu_for(self, wid: int) -> int | None:
        """The core worker `wid` is pinned to; under torchrun each local rank starts at its own offset,
        so ranks' workers do not pile onto the same cores.

        pin_cpus "auto" pins only when every local rank's workers get a core of their own and a core
        is left for each training process: otherwise a pinned worker waits for its core while the
        training process holds it and another core idles (measured on 2 cores, 2 workers: 690 img/s
        pinned vs 762 not, bench in the issue-11 note)."""
        if not self.pin_cpus:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.pin_cpus == "auto" and (self.num_workers + 1) * ranks > len(cpus):
            return None
        offset = int(os.environ.get("LOCAL_RANK", "0")) * self.num_workers
        return cpus[(offset + wid) % len(cpus)]

    def _start_worker(self, wid: int) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        spec_hash = self.link.spec_hash if self.link is not None else None
        proc = self.ctx.Process(
            target=worker_loop, name=f"fusionflow-worker-{wid}", daemon=True,
            args=(wid, self.dataset, self.policy, ChildFd(self.ring.fd), self.layout, child, self.seed,
                  self.base_seed, self.worker_init_fn, os.getpid(), self._cpu_for(wid), spec_hash, self.stages))
        # Objects awaiting garbage collection at fork time (e.g. a DALI pipeline whose finalizer joins
        # threads that only exist here) must never be finalized in the child: frozen objects are
        # skipped by the child's collector, and the parent collects them after unfreezing.
        gc.freeze()
        try:
            proc.start()
        finally:
            gc.unfreeze()
        child.close()
        with self.cond:
            self.workers[wid] = _Worker(wid, proc, parent)
        self._wake()

    def submit(self, seq: int, generation: int, slot: int, epoch: int, indices, copies=None) -> None:
        """Queue mini-batch `seq` of `generation` for ring slot `slot` (`copies`: the samples' copy
        numbers, fusionflow.scheduling.tiny_batches.Copies; None when all are 0)."""
        tiny = split_sorted(indices, self.sizes, self.tiny_batch_size, copies)
        with self.cond:
            self.queue.add(generation, seq, slot, epoch, tiny, len(indices), time.monotonic())
            self.cond.notify_all()
        self._wake()

    def wait(self, seq: int, generation: int, timeout: float | None) -> BatchState:
        """Block until mini-batch `seq` is complete; restarts dead workers meanwhile."""
        deadline = None if not timeout else time.monotonic() + timeout
        key = (generation, seq)
        with self.cond:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                state = self.queue.batches.get(key)
                if state is None:
                    raise FusionFlowError(f"mini-batch {seq} of this iterator is no longer tracked: a newer "
                                          "iter(loader) abandoned it (iterate one epoch at a time)")
                if state.error is not None:
                    raise state.error
                if state.remaining == 0:
                    self.queue.forget(key)
                    return state
                dead = [w.worker_id for w in self.workers if w is not None and not w.alive]
                missing = self.target_workers - len(self._kept_workers())
                if dead or missing > 0:
                    self.cond.release()
                    try:
                        self._restart_and_resize(dead, missing)
                    finally:
                        self.cond.acquire()
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise FusionFlowError(f"mini-batch {seq} was not ready within timeout={timeout} s "
                                          f"({state.remaining} of {state.size} samples outstanding)")
                self.cond.wait(left if left is not None else 1.0)

    def abandon(self, generation: int) -> None:
        """Forget an iterator's unfinished work (it stopped early); running tasks drain first."""
        with self.cond:
            self.queue.forget_generation(generation)

    def new_generation(self) -> int:
        with self.cond:
            self.generation += 1
            return self.generation

    def register_cuda(self, device_index: int) -> bool:
        """Page-lock the ring (cudaHostRegister, portable) so batches copy to the GPU without staging."""
        from fusionflow.runtime.device_ring import register_host
        self.cuda_device = device_index
        self.cuda_registered = register_host(self.ring.images.ctypes.data, self.layout.nbytes, device_index)
        return self.cuda_registered

    def _restart_and_resize(self, dead: list[int], missing: int) -> None:
        """Main thread: replace dead workers (retired ones are only reaped) and start new ones up to
        the elastic target."""
        for wid in dead:
            retired = self.workers[wid].retiring
            self._reap(wid)
            if retired:
                with self.cond:
                    self.workers[wid] = None
            else:
                self._start_worker(wid)
                self.restarts += 1
        if missing > 0:
            for _ in range(missing):
                with self.cond:
                    wid = next((k for k, w in enumerate(self.workers) if w is None), len(self.workers))
                    if wid == len(self.workers):
                        self.workers.append(None)
                        self.tasks_per_worker.append(0)
                self._start_worker(wid)
            with self.cond:
                self._notify_capacity()

    def _kept_workers(self) -> list[_Worker]:
        """Own workers that count towards the target: not retiring (dead ones awaiting a restart count)."""
        return [w for w in self.workers if w is not None and not w.retiring]

    def _notify_capacity(self) -> None:
        """The live worker count changed (lock held)."""
        self.capacity_changes += 1
        if self.on_capacity_change is not None:
            self.on_capacity_change(len(self._kept_workers()))

    def _reap(self, wid: int) -> None:
        w = self.workers[wid]
        w.process.join(timeout=1.0)
        w.conn.close()

    def _wake(self) -> None:
        try:
            self._ctrl_w.send_bytes(b"w")
        except OSError:
            pass

    def wake(self) -> None:
        """Nudge the manager thread (without the lock): a worker kind freed or requeued work."""
        self._wake()

    def add_worker_kind(self, kind) -> None:
        """Attach another kind of worker (start(), stop(), busy_with_stale(generation)); it takes work
        through this manager's queue methods under `cond`. `shutdown` stops it first."""
        with self.cond:
            self.worker_kinds.append(kind)

    def shutdown(self) -> None:
        """The shutdown procedure in the module docstring. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for kind in self.worker_kinds:
            kind.stop()
        self.worker_kinds = []
        if self.accelerator is not None:
            self.accelerator.stop()
        # the loader's callbacks and the accelerator refer back to it: drop them (no cycle outlives us)
        self.accelerator = self.on_batch_done = self.on_capacity_change = None
        thread = getattr(self, "_thread", None)
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        for g in list(self.guests):
            self._return_guest(g)
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.link is not None:
            self.link.close()
        workers = [w for w in self.workers if w is not None]
        for w in workers:
            try:
                w.conn.send_bytes(m.pack_stop())
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(timeout=1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=1.0)
            w.conn.close()
        for c in (self._ctrl_r, self._ctrl_w):
            c.close()
        event, self.copy_event = self.copy_event, None
        if event is not None:  # the last batch's copies out of the ring may still run: wait before unmapping
            event.synchronize()
        if self.cuda_registered:
            import torch
            with torch.cuda.device(self.cuda_device):
                torch.cuda.cudart().cudaHostUnregister(self.ring.images.ctypes.data)
            self.cuda_registered = False
        self.ring.close()
        self.ring.unlink()

    # ---------------------------------------------------------------- manager thread
    def _run(self) -> None:
        try:
            if self.link is not None:
                self.link.serving()  # the listener is in every wait below from now on
            while not self._closed:
                with self.cond:
                    self._dispatch()
                    timeout = self._gm_step() if self.link is not None else 1.0
                    live = [w for w in self.workers if w is not None and w.alive]
                    guests = list(self.guests)
                    bell = self.bell
                waitables = [self._ctrl_r] + [w.conn for w in live] + [w.process.sentinel for w in live]
                waitables += [g.conn for g in guests]
                if self.link is not None:
                    waitables.append(self.link.listener)
                if bell is not None:
                    waitables.append(bell)
                for ready in mp_wait(waitables, timeout=timeout):
                    if self._closed:
                        return
                    if ready is self._ctrl_r:
                        while self._ctrl_r.poll():
                            self._ctrl_r.recv_bytes()
                        continue
                    if self.link is not None and ready is self.link.listener:
                        self._accept_guest()
                        continue
                    if ready is bell:
                        self._drain_bell(bell)
                        continue
                    g = next((g for g in guests if ready is g.conn), None)
                    if g is not None:
                        if g.alive:
                            self._on_message(g)
                        continue
                    w = next((w for w in live if ready is w.conn or ready == w.process.sentinel), None)
                    if w is None or not w.alive:
                        continue
                    if ready is w.conn:
                        self._on_message(w)
                    elif not w.process.is_alive():
                        while w.alive and w.conn.poll():  # what it finished before dying still counts
                            self._on_message(w)
                        self._on_death(w)
        except BaseException as exc:  # a bug here must surface in the training loop, not hang it
            log.exception("fusionflow manager thread failed")
            with self.cond:
                self.fatal = FusionFlowError(f"the loader's manager thread failed: {exc!r}")
                self.cond.notify_all()

    def draining(self) -> bool:
        """Whether work of an abandoned iterator is still running (lock held)."""
        stale = any(work.generation != self.generation for w in [*self.workers, *self.guests] if w is not None
                    for _tid, work in w.outstanding)
        return (stale or (self.accelerator is not None and self.accelerator.busy_with_stale(self.generation))
                or any(kind.busy_with_stale(self.generation) for kind in self.worker_kinds))

    def _dispatch(self) -> None:
        """Give queued work to workers with room (holding the lock)."""
        if self.draining():
            return  # an abandoned iterator's tasks still write into ring slots: let them drain
        own = [w for w in self.workers if w is not None and w.alive and w.ready and w.lent_to is None
               and not w.retiring]
        guests = [g for g in self.guests if g.alive and g.ready]
        # Everyone gets a running task before anyone a queued one. Under a global manager a worker holds
        # only the task it runs: a task queued in a worker's pipe could not move to a lent worker, and
        # would hide this LM's need from the GM.
        for depth in range(1, (1 if self.link is not None else PER_WORKER) + 1):
            for w in own + guests:
                while len(w.outstanding) < depth:
                    work = self.take_cpu(upto=w.serve_upto)
                    if work is None or not self._send(w, work):
                        break
        for g in guests:
            if g.alive and not g.outstanding:  # nothing left of the iteration it came for
                self._return_guest(g)

    def _send(self, w: _Worker, work: Work) -> bool:
        task_id = next(self.task_ids)
        try:
            w.conn.send_bytes(m.pack_task(m.Task(task_id, work.generation, work.slot, work.epoch,
                                                 work.positions, work.indices, work.copies)))
        except OSError:
            self.requeue([work])
            return False
        if not w.outstanding:
            w.head_since = time.monotonic()
        w.outstanding.append((task_id, work))
        return True

    # ---------------------------------------------------------------- global manager (lock held)
    def _gm_step(self) -> float:
        """Publish progress, carry out the GM's orders; returns how long the manager thread may sleep."""
        link = self.link
        if not link.check_gm():
            self._publish()
            return 1.0
        target = link.target()
        if target is not None and target != self.target_workers:
            self.target_workers = target
            self.cond.notify_all()  # the main thread starts missing workers
        self._retire_surplus()
        order = link.yield_order()
        done = 0
        if order is not None:
            seq, peer, count = order
            address = link.peer_address(peer)
            lend = m.pack_message(m.Lend(peer, address, link.tables.secret, link.lm))
            for w in self.workers:
                if address is None or done >= count:
                    break
                if w is not None and w.idle:
                    try:
                        w.conn.send_bytes(lend)
                    except OSError:
                        continue
                    w.lent_to = peer
                    done += 1
                    if self.trace is not None:
                        self.trace.lent(w.worker_id, peer)
            self.lent_total += done
        self._publish()  # before the ack: the GM reads the lender's counts once the ack shows
        if order is not None:
            link.ack_yield(seq, done)
        return GM_IDLE_S

    def _retire_surplus(self) -> None:
        live = self._kept_workers()
        surplus = len(live) - self.target_workers
        for w in reversed(live):
            if surplus <= 0:
                break
            if w.idle:
                w.retiring = True
                surplus -= 1
                try:
                    w.conn.send_bytes(m.pack_stop())
                except OSError:
                    pass
                self._notify_capacity()

    def _publish(self) -> None:
        # the current iteration: the oldest incomplete mini-batch -- what a lent worker would serve
        current = self._current_key()
        busy = [w for w in [*self.workers, *self.guests] if w is not None and w.alive and w.lent_to is None
                and w.outstanding and (w.outstanding[0][1].generation, w.outstanding[0][1].seq) == current]
        own = [w for w in self._kept_workers() if w.alive]
        self.link.publish(
            iteration=self.completed_batches,
            waiting=self.queue.waiting(current),
            active_since=[w.head_since for w in busy], task_seconds=self.task_seconds,
            idle=sum(1 for w in own if w.idle), workers=len(own),
            lent=sum(1 for w in own if w.lent_to is not None), guests=len(self.guests),
            lent_total=self.lent_total, guests_total=self.guests_total)

    def _current_key(self):
        """This LM's current iteration: its oldest mini-batch with samples still to produce (a finished
        one stays queued until the training loop takes it)."""
        return self.queue.current_key()

    def _accept_guest(self) -> None:
        conn = self.link.accept()
        if conn is None:
            return
        with self.cond:
            self.guests.append(_Worker(None, None, conn))

    def _drain_bell(self, bell) -> None:
        """The GM rang: the loop's next `_gm_step` reads the order. A closed bell means the GM is gone."""
        try:
            while bell.poll():
                bell.recv_bytes()
        except (EOFError, OSError):
            with self.cond:
                if self.bell is bell:
                    self.bell = None
            bell.close()

    def _return_guest(self, g: _Worker) -> None:
        """Send a lent worker home (lock held)."""
        try:
            g.conn.send_bytes(m.pack_control(m.RETURN))
        except OSError:
            pass
        self._drop_guest(g)

    def _drop_guest(self, g: _Worker) -> None:
        g.alive = False
        g.conn.close()
        if g in self.guests:
            self.guests.remove(g)

    # ---------------------------------------------------------------- the two-ended queue (lock held)
    # scheduling/queue.py holds the queue; these keep it behind the manager's lock and wake waiters.
    @property
    def reserved(self) -> int:
        """TAAS's K: the largest tiny-batches of a mini-batch left to the accelerator (the loader's
        search sets it; the accelerator clears it when it stops)."""
        return self.queue.reserved

    @reserved.setter
    def reserved(self, k: int) -> None:
        self.queue.reserved = k

    def take_cpu(self, upto=None) -> Work | None:
        """The oldest mini-batch's smallest tiny-batch that CPU workers may take (of mini-batches no
        newer than `upto`, a (generation, seq) key, if given)."""
        return self.queue.take_cpu(upto)

    def take_accel(self, largest_first: bool = True) -> Work | None:
        """The oldest mini-batch's largest tiny-batch (or its smallest, for the FIFO ablation)."""
        return self.queue.take_accel(largest_first)

    def requeue(self, works) -> None:
        """Put work back at the front of its mini-batch's queue (it was interrupted)."""
        self.queue.requeue(works)
        self.cond.notify_all()

    def complete(self, work: Work, failures, on_accelerator: bool, targets: dict | None = None) -> None:
        """Account a finished tiny-batch (lock held); `targets`: {position: target} of its samples whose
        target is not an int (runtime/targets.py)."""
        now = time.monotonic()
        state = self.queue.complete(work, failures, on_accelerator, targets, now)
        if state is None:
            return
        if state.remaining == 0:
            self.completed_batches += 1
            if self.trace is not None:
                self.trace.mini_batch(state.slot, state.seq, state.size, int(state.submitted_at * 1e9), int(now * 1e9))
            if self.on_batch_done is not None:
                self.on_batch_done(state)
        self.cond.notify_all()

    def _on_message(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv_bytes()
        except (EOFError, OSError):
            if w.process is not None:
                w.process.join(timeout=1.0)
            self._on_death(w)
            return
        kind = m.kind_of(msg)
        with self.cond:
            if w.process is None:
                self._on_guest_message(w, kind, msg)
            elif kind == m.READY:
                w.ready = True
            elif kind == m.FATAL:
                self.fatal = WorkerStartError(f"CPU worker {w.worker_id} failed to start:\n{m.unpack_fatal(msg)}")
                w.alive = False
            elif kind == m.HOME:
                w.lent_to = None
                tasks = m.unpack_message(msg, m.Home).tasks
                self.lent_tasks += tasks
                if self.trace is not None:
                    self.trace.home(w.worker_id, tasks)
            elif kind == m.DONE:
                self._on_done(w, msg)
                self.tasks_per_worker[w.worker_id] += 1
            self.cond.notify_all()

    def _on_done(self, w: _Worker, msg: bytes) -> None:
        task_id, _gen, failures, targets = m.unpack_done(msg)
        sent_id, work = w.outstanding.popleft()
        if sent_id != task_id:
            raise RuntimeError(f"worker {w.worker_id} completed task {task_id}, expected {sent_id}")
        now = time.monotonic()
        took = now - w.head_since
        self.task_seconds = took if not self.task_seconds else 0.8 * self.task_seconds + 0.2 * took
        w.head_since = now
        if self.trace is not None or self.on_stage_times is not None:
            started, ended, stage_ns = m.unpack_done_times(msg)
            if self.trace is not None:
                self.trace.tiny_batch(w.worker_id, work, started, ended, self.sizes)
            if stage_ns and self.on_stage_times is not None:
                self.on_stage_times(w.worker_id, stage_ns)
        self.complete(work, failures, on_accelerator=False, targets=targets)

    def _on_guest_message(self, g: _Worker, kind: int, msg: bytes) -> None:
        """A lent worker's handshake and completions (lock held); see worker.serve_borrower."""
        link = self.link
        try:
            if kind == m.HELLO:
                hello = m.unpack_message(msg, m.Hello)
                g.worker_id = f"lm{hello.owner_lm}:w{hello.worker_id}"
                g.conn.send_bytes(m.pack_message(m.Setup(self.ring.name, self.layout, self.seed, link.spec_hash)))
                send_fd(g.conn, self.ring.fd)  # the ring has no name: it maps this descriptor
            elif kind == m.NEED:
                if link.spec is None:
                    self._return_guest(g)
                else:  # once per worker and loader; the socket's send timeout bounds a peer that stops reading
                    g.conn.send_bytes(m.pack_pickled(m.SPEC, link.spec))
        except OSError as exc:  # it died or its owner stopped it mid-handshake: it held no task
            log.info("fusionflow: worker %s left during its handshake (%r)", g.worker_id, exc)
            self._on_death(g)
            return
        if kind in (m.HELLO, m.NEED):
            return
        if kind == m.BELL:  # not a worker: the GM's doorbell
            self.guests.remove(g)
            if self.bell is not None:
                self.bell.close()
            self.bell = g.conn
        elif kind == m.LEAVING:  # its owner called it back (shutting down): what it had queued is not suspect
            self._drop_guest(g)
            self._requeue_outstanding(g, "", suspect=False)
        elif kind == m.READY:
            self.guests_total += 1
            g.serve_upto = self._current_key()  # the iteration it was lent for
            if g.serve_upto is None:  # it finished meanwhile: send the worker home at once
                self._return_guest(g)
            else:
                g.ready = True
        elif kind == m.FATAL:
            log.warning("fusionflow: a worker lent to this loader cannot run its samples, so borrowing is off "
                        "for it:\n%s", m.unpack_fatal(msg))
            link.disable_borrowing()
            self._return_guest(g)
        elif kind == m.DONE:
            self._on_done(g, msg)
            self.guest_tasks += 1

    def _on_death(self, w: _Worker) -> None:
        with self.cond:
            if not w.alive:
                return
            w.alive = False
            if w.process is None:  # a guest's connection dropped: its owner restarts it if it died
                self._drop_guest(w)
                if w.outstanding:
                    log.warning("fusionflow: worker %s lent to this loader left with %d tiny-batches; re-running them",
                                w.worker_id, len(w.outstanding))
                self._requeue_outstanding(w, "its connection dropped")
                return
            code = w.process.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            if w.retiring and code == 0:
                self._requeue_outstanding(w, how)
                self.cond.notify_all()  # the main thread reaps it
                return
            if not w.ready:  # it never came up: restarting would only repeat that
                self.fatal = WorkerStartError(f"CPU worker {w.worker_id} exited ({how}) before it was ready")
                self.cond.notify_all()
                return
            if code == -signal.SIGBUS:  # it touched shared memory the system could not supply: not a sample's fault
                self._requeue_outstanding(w, how, suspect=False)
                self.fatal = SharedMemoryError(
                    f"CPU worker {w.worker_id} died of SIGBUS: a process touched shared memory that could not be "
                    f"backed (the batch ring needs {self.layout.nbytes} bytes; {SHM_DIR} has "
                    f"{free_bytes()} bytes free now). This is not the fault of a sample. Give the container a "
                    f"larger {SHM_DIR} (docker run --shm-size=2g) or lower batch_size or prefetch_factor.")
                self.cond.notify_all()
                return
            w.retiring = False  # a retiring worker that crashed is replaced like any other
            log.warning("fusionflow CPU worker %d died (%s); restarting it", w.worker_id, how)
            self._requeue_outstanding(w, how)

    def _requeue_outstanding(self, w: _Worker, how: str, suspect: bool = True) -> None:
        """Put a departed worker's tasks back (lock held); if it died (`suspect`), the one it was
        running may be the cause: it counts a death and is retried sample by sample."""
        requeue = []
        for k, (_tid, work) in enumerate(w.outstanding):
            if work.generation != self.generation or not self.queue.tracks(work):
                continue
            if k == 0 and suspect:  # the task it was running
                work.deaths += 1
                if len(work.positions) > 1:  # isolate the culprit: retry sample by sample
                    copies = work.copies or (0,) * len(work.positions)
                    requeue += [Work(work.seq, work.generation, work.slot, work.epoch, (p,), (i,), work.deaths,
                                      copies=(c,) if c else ()) for p, i, c in zip(work.positions, work.indices, copies)]
                    continue
                if work.deaths > self.max_retries:
                    state = self.queue.batches[work.key]
                    state.error = SampleKilledWorkersError(
                        f"sample {work.indices[0]} killed {work.deaths} CPU worker processes (last: {how}); "
                        f"giving up after max_retries={self.max_retries}. Check that sample "
                        f"(dataset.describe / path) for a file that crashes the decoder or exhausts memory.",
                        list(work.indices))
                    continue
            requeue.append(work)
        w.outstanding.clear()
        self.requeue(requeue)
        self.cond.notify_all()
