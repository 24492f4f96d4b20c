"""The board: the one interface every worker kind works through.

A worker kind -- the DALI accelerator thread, remote (Ray) workers, anything that produces tiny-batches
-- is handed the board (a `LocalManager` holds one: `mgr.board`) and uses only these members:

    cond         threading.Condition guarding everything below
    ring         the BatchRing: `.images[slot, pos]`, `.labels[slot]` (writes into a taken tiny-batch's
                 positions may happen without the lock)
    sizes        the dataset's encoded sample sizes, or None
    trace        a fusionflow.loader.trace.TraceRecorder while the loader traces, else None
    generation   the current iterator's number (int)
    counters     the loader's counters (runtime/counters.py)
    reserved     TAAS's K: the largest tiny-batches of a mini-batch left to the accelerator (read-only;
                 reserve(k) and drop_reservations() set it)
    take_cpu(upto=None) -> Work | None          cond held
    take_accel(largest_first, max_images) -> [Work]   cond held
    complete(work, failures, on_accelerator, targets=None)   cond held
    complete_many([(work, targets)], failures, on_accelerator)   cond held: a run's, with one call
    requeue(works)                              cond held
    draining() -> bool                          cond held: an abandoned iterator's work still runs
    wake()                                      WITHOUT the lock: wakes the manager thread
    add_worker_kind(kind)                       registers a kind (its owner then calls kind.start())

The board's owner (the LocalManager) also uses `queue`, `completed_batches`, `on_batch_done`,
`watch_stale` (parts it runs itself, such as the CPU worker pool and the lending agent, that
`draining()` asks as it asks the kinds), `stop_worker_kinds`, `wake_conn` / `clear_wakes` (what its
thread waits on) and `close_wake_pipe`.

A kind's thread loops: with `cond` held take work (taking none while `draining()`; waiting on
`cond`, or polling its own results meanwhile, while there is none), release the lock to compute and
write the ring, then with `cond` held `complete` (or `requeue`) it, then `wake()`. What a kind itself
provides -- `start()`, `stop()`, `busy_with_stale(generation)` -- is the `WorkerKind` protocol below,
each method with its contract.

The board holds no threads or processes itself; the queue is the pure TinyBatchQueue.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Protocol, runtime_checkable

from fusionflow.runtime.counters import RuntimeCounters
from fusionflow.runtime.procs import run_every
from fusionflow.scheduling.queue import TinyBatchQueue, Work


@runtime_checkable
class WorkerKind(Protocol):
    """What a worker kind provides to the board that it is registered with (`Board.add_worker_kind`).
    The CPU worker pool (runtime/worker_pool.py), the DALI accelerator (accel/accelerator.py) and the
    Ray workers (remote/kind.py) satisfy it; tests/test_code_shape.py checks that they do."""

    def start(self) -> None:
        """Begin taking work from the board: start the kind's threads, processes or connections.
        Called once, by whoever registered the kind, AFTER `Board.add_worker_kind`: a start that fails
        half-way (it may raise) is then still stopped by the owner's shutdown."""
        ...

    def stop(self) -> None:
        """Idempotent, and valid before, during or after a failed `start()` (or with none at all).
        Finish or abandon the work in flight (what is abandoned goes back with `Board.requeue`), end
        the kind's threads and release what it holds. The owner's shutdown calls it first, latest
        registered kind first, then forgets the kind (it refers back to the board)."""
        ...

    def busy_with_stale(self, generation: int) -> bool:
        """Called with the board's `cond` held, so it must neither block nor take that lock: whether
        the kind is still writing ring positions of an iterator older than `generation`. While any
        part is, `Board.draining()` is true and nobody takes new work (its ring slots are reused)."""
        ...


class Board:
    def __init__(self, ring, sizes=None, counters=None, trace=None):
        self.ring, self.sizes, self.trace = ring, sizes, trace
        self.counters = counters if counters is not None else RuntimeCounters()
        self.cond = threading.Condition()
        self.generation = 0
        # per mini-batch (oldest first): its tiny-batches, ascending by encoded size. CPU workers take
        # from the front, the accelerator from the back; the largest `reserved` stay the accelerator's.
        self.queue = TinyBatchQueue()  # pure; guarded by `cond`
        self.completed_batches = 0
        self.on_batch_done = None  # callback(state) under the lock, e.g. TAAS feedback
        self.kinds: list = []  # registered worker kinds, in registration order
        self._kinds_stopped = False  # shutdown has begun: no kind may join
        self._watched: list = []  # parts the owner runs itself whose stale work draining() counts too
        self._ctrl_r, self._ctrl_w = mp.Pipe(duplex=False)  # wake(): the manager thread waits on _ctrl_r

    # ---------------------------------------------------------------- worker kinds
    def add_worker_kind(self, kind: WorkerKind) -> None:
        """Register `kind` (then call its `start()`); its `stop()` is called first by the manager's shutdown."""
        if not isinstance(kind, WorkerKind):
            raise TypeError(
                f"add_worker_kind({kind!r}): a worker kind has start(), stop() and "
                "busy_with_stale(generation) (fusionflow/runtime/board.py, WorkerKind)"
            )
        with self.cond:
            if self._kinds_stopped:
                raise RuntimeError(f"add_worker_kind({kind!r}): this manager is shut down; no worker kind can join")
            self.kinds.append(kind)

    def stop_worker_kinds(self) -> None:
        """Stop every registered kind (latest first) and forget them: they refer back to the board."""
        with self.cond:
            kinds, self.kinds, self._kinds_stopped = self.kinds, [], True
        run_every(*(kind.stop for kind in reversed(kinds)))  # each stops, whatever an earlier one raised

    def watch_kinds(self, now: float, lost: float = 0.0) -> None:
        """(lock held; the manager thread, each turn) Each registered kind's `watch(now, lost)`, where it has one:
        a kind whose own thread can block where it cannot notice (the DALI accelerator in DALI) bounds
        itself there; `lost`: seconds this process did not run since the last turn (runtime/stuck.py Pauses), which
        its clocks skip."""
        for kind in self.kinds:
            watch = getattr(kind, "watch", None)
            if watch is not None:
                watch(now, lost)

    def watch_stale(self, part) -> None:
        """Let `draining()` ask `part.busy_with_stale(generation)` too: a part that takes work from this
        board but whose start and stop its owner drives itself (the CPU worker pool, the lending agent),
        so it is no registered kind."""
        with self.cond:
            self._watched.append(part)

    def unwatch_stale(self) -> None:
        """Forget every watched part (the owner drops them at shutdown: they refer back to the board)."""
        with self.cond:
            self._watched = []

    def draining(self) -> bool:
        """Whether work of an abandoned iterator is still running (lock held): on a watched part or a
        registered worker kind."""
        gen = self.generation
        return any(part.busy_with_stale(gen) for part in self._watched + self.kinds)

    def wake(self) -> None:
        """Wake the manager thread (called without the lock)."""
        try:
            self._ctrl_w.send_bytes(b"w")
        except OSError:  # closed: the manager is shut down
            pass

    @property
    def wake_conn(self):
        """The read end of `wake()`'s pipe: the owner's thread waits on it (with its other waitables)."""
        return self._ctrl_r

    def clear_wakes(self) -> None:
        """Consume the pending wake-ups (the owner's thread, once `wake_conn` was ready)."""
        while self._ctrl_r.poll():
            self._ctrl_r.recv_bytes()

    # ---------------------------------------------------------------- the two-ended queue (lock held)
    @property
    def reserved(self) -> int:
        """TAAS's K: the largest tiny-batches of a mini-batch left to the accelerator (the loader's
        search sets it; the accelerator clears it when it retires)."""
        return self.queue.reserved

    def reserve(self, k: int, steal: bool = False, final: bool = False) -> None:
        """TAAS's K for the mini-batches from now on: the accelerator's share (the split rule's G in
        tiny-batches). `steal`: CPU workers with nothing else to do take from shares it has not taken;
        `final`: a share once taken stays taken when K grows (no top-up runs; scheduling/queue.py `_took`)."""
        self.queue.reserved, self.queue.steal, self.queue.final_shares = k, steal, final

    def drop_reservations(self) -> None:
        """The accelerator takes no more work (it retired): the CPU workers may take every tiny-batch."""
        self.queue.reserved = 0
        self.cond.notify_all()

    def take_cpu(self, upto=None) -> Work | None:
        """The oldest mini-batch's smallest tiny-batch that CPU workers may take (of mini-batches no
        newer than `upto`, a (generation, seq) key, if given)."""
        return self.queue.take_cpu(upto)

    def take_accel(
        self,
        largest_first: bool = True,
        max_images: int = 0,
        tail_fraction: float | None = None,
        merge: int = 1,
        borrow: bool = False,
    ) -> list[Work]:
        """The accelerator's next DALI run: its share (the `reserved` largest tiny-batches) of the
        oldest mini-batch whose share it has not taken (and of up to `merge` - 1 next ones, or with
        `borrow` their shares taken ahead), else a tail run of the mini-batch training waits for
        (scheduling/queue.py, `TinyBatchQueue.take_accel`)."""
        return self.queue.take_accel(largest_first, max_images, tail_fraction, merge, borrow)

    @property
    def took_tail(self) -> bool:
        """The last `take_accel` gave a tail run, not a share (cond held)."""
        return self.queue.took_tail

    def requeue(self, works) -> None:
        """Put work back at the front of its mini-batch's queue (it was interrupted)."""
        self.queue.requeue(works)
        self.cond.notify_all()

    def complete(self, work: Work, failures, on_accelerator: bool, targets: dict | None = None) -> None:
        """Account a finished tiny-batch (lock held); `targets`: {position: target} of its samples whose
        target is not an int (runtime/targets.py)."""
        self.complete_many([(work, targets)], failures, on_accelerator)

    def complete_many(self, done: list, failures, on_accelerator: bool) -> None:
        """Account finished tiny-batches, [(work, targets)] as `complete` takes one (lock held): an
        accelerator run's, with the calls of one (the queue's `complete`)."""
        now = time.monotonic()
        for state in self.queue.complete(done, failures, on_accelerator, now):
            if state.remaining == 0:
                self.completed_batches += 1
                if self.trace is not None:
                    start, end = int(state.submitted_at * 1e9), int(now * 1e9)
                    self.trace.mini_batch(state.slot, state.seq, state.size, start, end)
                if self.on_batch_done is not None:
                    self.on_batch_done(state)
        self.cond.notify_all()

    def close_wake_pipe(self) -> None:
        for c in (self._ctrl_r, self._ctrl_w):
            c.close()
