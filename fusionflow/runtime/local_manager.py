"""Local manager: one per loader. The coordinator of one loader's runtime: it holds the board every
worker kind works through (`self.board`, runtime/board.py: the shared batch ring, the sorted
tiny-batch queue and completion accounting), owns the CPU worker pool (runtime/worker_pool.py) and,
with a global manager, the lending agent (runtime/gm/agent.py), runs the manager thread, and
turns submitted mini-batches into completed ring slots. The pool, the agent and every worker kind get
the board (and what else they use, explicitly), never the manager.

Threads and processes
  * The training (main) thread submits mini-batches (`submit`), waits for them (`wait`), starts and
    restarts worker processes through the pool (forking only ever happens on this thread) and shuts down.
  * The manager thread ("fusionflow-manager") feeds workers: each live worker holds at most
    `PER_WORKER` tasks; it takes the front of the queue -- the oldest mini-batch's smallest
    tiny-batch -- so workers stay busy while the training step runs. It blocks in
    `multiprocessing.connection.wait` on worker pipes *and* process sentinels (and, with a global
    manager, the agent's socket, doorbell and guests), so a dead worker wakes it at once instead of
    hanging anything.
  * Other worker kinds (the DALI accelerator thread, remote workers) run their own threads and are
    registered with `board.add_worker_kind`: they take work from the board and complete it there.
  * The board's `draining()` asks every registered kind and, registered with `board.watch_stale`,
    the pool and the agent: the manager drives their lifecycles itself (the pool starts on the
    training thread at construction, and stops only after the manager thread, which waits on its
    pipes, has ended), so they are not registered as kinds.

Faults
  * A worker that dies (e.g. SIGKILL): its tasks go back to the front of the queue; the task it was
    running is split into single samples, so the culprit is isolated; a sample whose task has killed
    `max_retries + 1` workers fails its mini-batch with an error naming it. A replacement
    worker is started by the main thread at its next `wait`. A worker killed by SIGBUS is never
    blamed on a sample: shared memory could not be backed (the ring is reserved at creation, so
    this means /dev/shm was exhausted under us); the loader fails with a `SharedMemoryError`.
  * A tiny-batch that straggles (a multiple of the recent mean, with a floor: runtime/liveness.py)
    is started again on an idle worker (up to 3 copies); the first copy wins, the others' workers
    are stopped before that completion counts (runtime/reruns.py).
  * A worker that makes no progress (stopped, swapping, a read that never returns): killed once its
    oldest tiny-batch has run past the stuck bound (runtime/liveness.py), then handled as a death.
  * A sample whose decode/augment raises: reported as data (`SampleFailure`) with its traceback.
  * A worker that fails to start (e.g. `worker_init_fn` raised): a `WorkerStartError` with its
    traceback at the next `wait`.

Global manager (DDP, `job` given; runtime/gm/manager.py): the lending agent publishes this LM's
progress, lends idle workers on the GM's orders, serves workers lent to this LM, and applies a new
elastic worker target (the main thread starts missing workers at its next `wait`; surplus idle
workers are sent STOP and not restarted; `on_capacity_change(n)` tells TAAS to search again).
Without a job there is no agent.

Shutdown procedure: `LocalManager.shutdown` (idempotent; also run by the loader's finalizer at
collection/exit). The ring's name is unlinked the moment it is created: workers map it from a
descriptor (inherited at fork, duplicated for spawn, sent over the Unix socket to lent workers), so
its memory goes when the last process holding it exits -- even when the whole job is SIGKILLed.
If the training process is killed alone, workers notice within `worker.WATCHDOG_S` and exit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import wait as mp_wait

from fusionflow.errors import FusionFlowError, SampleKilledWorkersError, WorkerStartError
from fusionflow.runtime import liveness, stuck
from fusionflow.runtime.board import Board
from fusionflow.runtime.procs import run_every
from fusionflow.runtime.shm import BatchRing
from fusionflow.runtime.spec import RuntimeSpec
from fusionflow.runtime.worker_pool import PER_WORKER, WorkerPool
from fusionflow.scheduling import split_sorted
from fusionflow.scheduling.queue import BatchState

log = logging.getLogger(__name__)
# the errors a `wait` raises for faults the pool finds are importable from here too
__all__ = ["LocalManager", "SampleKilledWorkersError", "WorkerStartError"]


class LocalManager:
    def __init__(
        self,
        dataset,
        spec: RuntimeSpec,
        *,
        sizes=None,
        lend_spec: bytes | None = None,
        counters=None,
        trace=None,
        on_stage_times=None,
        on_batch_done=None,
        on_capacity_change=None,
    ):
        ring = BatchRing(spec.layout)  # its name unlinked already: workers get the descriptor
        self.board = board = Board(ring, sizes, counters, trace)
        self.spec = spec  # the ring layout, tiny-batch size, ... this manager runs with
        board.on_batch_done = on_batch_done  # callback(state) under the lock, e.g. TAAS feedback
        self.on_capacity_change = on_capacity_change  # callback(live worker count) under the lock
        self.fatal: BaseException | None = None  # a fault the next `wait` raises
        self.cuda_registered = False  # the ring is page-locked for direct host->device copies
        self.cuda_device = None  # the loader's CUDA device index, once registered
        self.copy_event = None  # CUDA event after the last batch's copies out of the ring (GPU delivery)
        self.agent = None  # the LendingAgent, only when a global manager coordinates this job
        self.pool = None
        self._pauses = stuck.Pauses()  # the manager thread's turns: a pause of this whole process is nobody's fault
        self._closed = False
        self._thread = None
        self.pid = os.getpid()  # the process whose workers and thread these are (a fork inherits the object)
        try:
            if spec.job is not None:
                from fusionflow.runtime.gm.agent import LendingAgent

                self.agent = LendingAgent.join(board, spec.job, lend_spec)  # None: no lending (said why)
            self.pool = WorkerPool(
                board,
                dataset,
                spec,
                spec_hash=self.agent.spec_hash if self.agent is not None else None,
                on_stage_times=on_stage_times,
                on_capacity=self._capacity_changed,
                on_fatal=self._fail,
            )
            board.watch_stale(self.pool)
            if self.agent is not None:
                self.agent.pool = self.pool
                board.watch_stale(self.agent)
            self.pool.start()
            self._thread = threading.Thread(target=self._run, name="fusionflow-manager", daemon=True)
            self._thread.start()
        except BaseException:  # a Ctrl-C here too: nothing started may outlive the failed start
            self.shutdown()
            raise

    def attach(self, on_batch_done=None, on_capacity_change=None) -> None:
        """Set the loader's callbacks (called under the lock; they must not refer to the loader)."""
        with self.board.cond:
            self.board.on_batch_done, self.on_capacity_change = on_batch_done, on_capacity_change

    def _capacity_changed(self, live: int) -> None:
        if self.on_capacity_change is not None:
            self.on_capacity_change(live)

    def _fail(self, exc: BaseException) -> None:
        """Lock held: a fault (a worker that could not start, shared memory gone) the next `wait` raises."""
        self.fatal = exc

    # ---------------------------------------------------------------- main thread
    def submit(self, seq: int, generation: int, slot: int, epoch: int, indices, copies=None) -> None:
        """Queue mini-batch `seq` of `generation` for ring slot `slot` (`copies`: the samples' copy
        numbers, fusionflow.scheduling.tiny_batches.Copies; None when all are 0)."""
        board = self.board
        tiny = split_sorted(indices, board.sizes, self.spec.tiny_batch_size, copies)
        with board.cond:
            board.queue.add(generation, seq, slot, epoch, tiny, len(indices), time.monotonic())
            board.cond.notify_all()
        board.wake()

    def wait(self, seq: int, generation: int, timeout: float | None) -> BatchState:
        """Block until mini-batch `seq` is complete; restarts dead workers meanwhile."""
        if os.getpid() != self.pid:  # before its lock: another thread may have held it at the fork
            raise FusionFlowError(
                f"the next mini-batch cannot arrive in this process: the iteration runs on the workers of process "
                f"{self.pid}, which forked this one; a new iteration here (iter(loader)) starts workers of its own"
            )
        deadline = None if not timeout else time.monotonic() + timeout
        key = (generation, seq)
        board = self.board
        with board.cond:
            board.queue.awaited = key  # the accelerator may help with it (a tail run) while it is late
            board.cond.notify_all()
            try:
                return self._wait(key, seq, deadline, timeout)
            finally:
                board.queue.awaited = None

    def _wait(self, key, seq: int, deadline: float | None, timeout: float | None) -> BatchState:
        """`wait`'s loop, lock held."""
        board, since = self.board, time.monotonic()
        say = since + liveness.WAIT_SAY_S
        while True:
            if self.fatal is not None:
                raise self.fatal
            if self._closed:
                raise FusionFlowError(
                    "the next mini-batch cannot arrive: the loader's workers were shut down during this iteration "
                    "(close(), load_state_dict with a new seed, or a newer iter(loader) that ran to its end: without "
                    "persistent_workers an epoch's end stops them; iterate one epoch at a time)"
                )
            state = board.queue.batches.get(key)
            if state is None:
                raise FusionFlowError(
                    "the next mini-batch of this iterator is no longer tracked: a newer "
                    "iter(loader) abandoned it (iterate one epoch at a time)"
                )
            if state.error is not None:
                raise state.error
            # dead workers are replaced here, also when the batch is ready (it may have been made
            # before this call, e.g. speculated for this epoch: fusionflow/loader/next_epoch.py)
            dead, missing = self.pool.wanted()
            if dead or missing > 0:
                board.cond.release()
                try:
                    self.pool.restart_and_resize(dead, missing)
                finally:
                    board.cond.acquire()
                continue
            if state.remaining == 0:
                board.queue.forget(key)
                return state
            now = time.monotonic()
            if now >= say:
                say = since + 2 * (now - since)
                log.warning(liveness.waiting_on(seq, now - since, state.remaining, state.size, self._holders(key)))
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                raise FusionFlowError(
                    f"mini-batch {seq} was not ready within timeout={timeout} s "
                    f"({state.remaining} of {state.size} samples outstanding; {self._holders(key)})"
                )
            board.cond.wait(left if left is not None else 1.0)

    def _holders(self, key) -> str:
        """Under board.cond: who holds mini-batch `key`'s outstanding samples (liveness.holders): the CPU workers
        and lent ones busy, the worker kinds that say what they hold (`holding`: the accelerator's runs)."""
        now, guests = time.monotonic(), self.agent.guests if self.agent is not None else ()
        busy = [("CPU worker", w) for w in self.pool.workers if w and w.outstanding]
        busy += [("lent worker", g) for g in guests if g.alive and g.outstanding]
        running = [(f"{kind} {w.worker_id} {liveness.oldest_samples(w)}", now - w.head_since) for kind, w in busy]
        kinds = [k for k in self.board.kinds if k is not self.pool]
        running += [held for k in kinds if hasattr(k, "holding") for held in k.holding(key, now)]
        others = [type(k).__name__ for k in kinds if not hasattr(k, "holding")]
        return liveness.holders(self.board.queue.waiting(key), running, others)

    def abandon(self, generation: int) -> None:
        """Forget an iterator's unfinished work (it stopped early); running tasks drain first."""
        with self.board.cond:
            self.board.queue.forget_generation(generation)

    def forget(self, generation: int, seqs) -> None:
        """Forget these mini-batches of `generation` (work speculated for an epoch that did not come).
        Their slots may still be written by running tasks: reuse them only in a newer generation."""
        with self.board.cond:
            for seq in seqs:
                self.board.queue.forget((generation, seq))

    def new_generation(self) -> int:
        with self.board.cond:
            self.board.generation += 1
            return self.board.generation

    @property
    def generation(self) -> int:
        """The newest generation (the iterator that runs on this manager now)."""
        with self.board.cond:
            return self.board.generation

    def register_cuda(self, device_index: int) -> bool:
        """Page-lock the ring (cudaHostRegister, portable) so batches copy to the GPU without staging."""
        from fusionflow.runtime.cuda_host import register_host

        self.cuda_device = device_index
        self.cuda_registered = register_host(self.board.ring.images.ctypes.data, self.spec.layout.nbytes, device_index)
        return self.cuda_registered

    def shutdown(self) -> None:
        """Release everything this manager owns, in this order (idempotent; every path runs it: the
        loader's close, the end of an iteration without persistent workers, its finalizer at
        collection or exit, and a constructor that failed half-way):

        1. Stop every registered worker kind, latest first (`kind.stop()`: the accelerator finishes its
           tiny-batch and closes its DALI pipeline) and forget them; drop the loader's callbacks (they
           refer back to this manager, so no cycle outlives it).
        2. Stop the manager thread (wake it; it sees `_closed`) and join it.
        3. Drop the pool and the agent (they refer back to the board), and the board's watch of them. Lending
           agent, if any: RETURN to guests, close their connections and the doorbell (their owners' workers go
           home); leave the global manager's table (free the row, close the socket).
        4. Worker pool: STOP to every worker (a lent one stops too: its borrower requeues what it
           held); join each for up to 2 s; terminate() the rest, then kill(); close their pipes.
        5. Close the wake pipe; wait (host) for the last batch's copies out of the ring
           (`copy_event`, GPU delivery); unregister the ring from CUDA if registered; drop the
           ring's mapping and descriptor.
        Each step runs even if an earlier one raised (a Ctrl-C in the accelerator's stop), which then propagates.
        """
        if self._closed:
            return
        self._closed = True
        run_every(self.board.stop_worker_kinds, self._join_thread, self._close_pool, self._close_ring)  # 1, 2, 3-4, 5

    def _join_thread(self) -> None:
        self.board.on_batch_done = self.on_capacity_change = None
        thread = self._thread
        self.board.wake()
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=5.0)  # (not alive: never started, its start interrupted; it sees _closed if it runs)

    def _close_pool(self) -> None:
        agent, pool, self.agent, self.pool = self.agent, self.pool, None, None  # they refer back to the board
        self.board.unwatch_stale()
        run_every(*(step for step in (getattr(agent, "close", None), getattr(pool, "stop", None)) if step is not None))

    def _close_ring(self) -> None:
        (board := self.board).close_wake_pipe()
        event, self.copy_event = self.copy_event, None
        if event is not None:  # the last batch's copies out of the ring may still run: wait before unmapping
            event.synchronize()
        if self.cuda_registered:
            import torch

            with torch.cuda.device(self.cuda_device):
                torch.cuda.cudart().cudaHostUnregister(board.ring.images.ctypes.data)
            self.cuda_registered = False
        board.ring.close()  # its name was unlinked when it was made

    # ---------------------------------------------------------------- manager thread
    def _run(self) -> None:
        board, agent = self.board, self.agent
        try:
            if agent is not None:
                agent.serving()  # the listener is in every wait below from now on
            while not self._closed:
                with board.cond:
                    lost = self._pauses.lost(now := time.monotonic())  # (the whole job stopped: nobody's fault)
                    stuck.kill_stuck(self.pool, agent, board.counters, lost)
                    board.watch_kinds(now, lost)
                    if not board.draining():
                        self.pool.rerun_stragglers(time.monotonic())
                    self._dispatch()
                    timeout = agent.step() if agent is not None else 1.0
                    waitables = [board.wake_conn] + self.pool.waitables()
                    if agent is not None:
                        waitables += agent.waitables()
                for ready in mp_wait(waitables, timeout=timeout):
                    if self._closed:
                        return
                    if ready is board.wake_conn:
                        board.clear_wakes()
                    elif agent is None or not agent.handle(ready):
                        self.pool.handle(ready)
        except BaseException as exc:  # a bug here must surface in the training loop, not hang it
            log.exception("fusionflow manager thread failed")
            with board.cond:
                self.fatal = FusionFlowError(f"the loader's manager thread failed: {exc!r}")
                board.cond.notify_all()

    def _dispatch(self) -> None:
        """Give queued work to workers with room (holding the lock)."""
        if self.board.draining():  # own workers, guests (the agent) or any registered worker kind
            return  # an abandoned iterator's tasks still write into ring slots: let them drain
        # Under a global manager a worker holds only the task it runs: a task queued in a worker's pipe
        # could not move to a lent worker, and would hide this LM's need from the GM.
        if self.agent is None:
            self.pool.dispatch((), PER_WORKER)
        else:
            self.pool.dispatch(self.agent.guests, 1)
            self.agent.return_finished_guests()
