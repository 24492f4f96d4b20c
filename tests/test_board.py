"""The board (fusionflow/runtime/board.py): the one interface every worker kind uses, alone and
through a real LocalManager with a worker kind of the test's own (as remote workers plug in)."""

import threading

import numpy as np
import pytest
from test_loader import SMALL, Bytes, no_leaks  # noqa: F401

from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import load_policy
from fusionflow.runtime.board import Board
from fusionflow.runtime.counters import RuntimeCounters, count_worker_task
from fusionflow.runtime.local_manager import LocalManager
from fusionflow.runtime.shm import RingLayout
from fusionflow.runtime.spec import RuntimeSpec
from fusionflow.scheduling import split_sorted

MARK = 7  # the pixel value the test's worker kind writes: tells its samples from a CPU worker's


class ThreadKind:
    """A worker kind as the board's docstring describes one: its own thread takes CPU work with the
    lock held, produces it without the lock (every pixel MARK, the target its index), completes it
    with the lock held, then wakes the manager."""

    def __init__(self, board):
        self.board, self.done, self.stops, self.starts = board, [], 0, 0
        self._stop, self._active = False, None
        self._thread = threading.Thread(target=self._run, name="test-kind", daemon=True)

    def start(self):
        self.starts += 1
        self._thread.start()

    def stop(self):
        self.stops += 1
        with self.board.cond:
            self._stop = True
            self.board.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def busy_with_stale(self, generation):
        return self._active is not None and self._active.generation != generation

    def _run(self):
        board = self.board
        while True:
            with board.cond:
                while not self._stop and (board.draining() or (work := board.take_cpu()) is None):
                    board.cond.wait(0.5)
                if self._stop:
                    return
                self._active = work
            for pos, index in zip(work.positions, work.indices):  # into the ring, without the lock
                board.ring.images[work.slot, pos] = MARK
                board.ring.labels[work.slot][pos] = index
            with board.cond:
                self._active = None
                self.done.extend(work.indices)
                board.complete(work, [], on_accelerator=False)
            board.wake()


class Ring:
    images = labels = None


class Kind:
    def __init__(self, log, name, stale=False):
        self.log, self.name, self.stale = log, name, stale

    def start(self):
        self.log.append(("start", self.name))

    def stop(self):
        self.log.append(("stop", self.name))

    def busy_with_stale(self, generation):
        self.log.append(("asked", self.name, generation))
        return self.stale


def test_kinds_are_registered_asked_when_draining_and_stopped_latest_first():
    log = []
    board = Board(Ring())
    board.add_worker_kind(Kind(log, "a"))
    board.add_worker_kind(Kind(log, "b", stale=True))
    assert log == [] and len(board.kinds) == 2  # registering does not start a kind: its owner does
    board.generation = 3
    with board.cond:
        assert board.draining()
    assert ("asked", "b", 3) in log
    board.stop_worker_kinds()
    assert log[-2:] == [("stop", "b"), ("stop", "a")]
    assert board.kinds == [] and not board.draining()  # forgotten: they refer back to the board
    with pytest.raises(RuntimeError, match="shut down; no worker kind can join"):
        board.add_worker_kind(Kind(log, "late"))
    assert board.kinds == []
    board.close_wake_pipe()
    board.wake()  # after shutdown: a kind's late wake() is harmless


def test_complete_counts_mini_batches_and_calls_back_once_each():
    board = Board(Ring(), sizes=[10, 30, 20])
    done = []
    board.on_batch_done = done.append
    board.queue.add(0, 0, 0, 0, split_sorted([0, 1, 2], board.sizes, 1), 3, 0.0)
    with board.cond:
        (big,) = board.take_accel()
        small = [board.take_cpu(), board.take_cpu()]
        assert big.indices == (1,) and [w.indices for w in small] == [(0,), (2,)] and board.take_cpu() is None
        for work in small:
            board.complete(work, [], on_accelerator=False)
        assert board.completed_batches == 0 and not done
        board.complete(big, [], on_accelerator=True)
    assert board.completed_batches == 1 and [s.seq for s in done] == [0]
    assert isinstance(board.counters, RuntimeCounters)
    board.close_wake_pipe()


def test_count_worker_task_grows_with_the_pool():
    c = RuntimeCounters(tiny_batches_per_worker=[0, 0])
    count_worker_task(c, 1)
    count_worker_task(c, 3)  # a worker started for a higher elastic target
    assert c.tiny_batches_per_worker == [0, 1, 0, 1]


def test_manager_without_a_job_has_no_lending_agent():
    mgr = LocalManager(Bytes(8), RuntimeSpec(None, RingLayout(2, 8, (3, 4, 4), "uint8"), num_workers=0, seed=0))
    try:
        assert mgr.agent is None and mgr.pool is not None
        assert mgr.board.counters.global_manager is None  # nothing counts lending
    finally:
        mgr.shutdown()
    assert mgr.pool is None and mgr.agent is None  # the parts are dropped: they refer back to the manager


def _manager(ds, num_workers, batches, counters=None):
    policy = load_policy(SMALL)
    layout = RingLayout(len(batches), 8, policy.out_shape, policy.out_dtype)
    spec = RuntimeSpec(policy, layout, num_workers, seed=5, pin_workers=False, tiny_batch_size=2)
    return LocalManager(ds, spec, sizes=ds.sizes, counters=counters)


def _run_batches(mgr, batches):
    """Submit every mini-batch (one ring slot each), wait for each; returns {index: image} in order."""
    gen = mgr.new_generation()
    for seq, indices in enumerate(batches):
        mgr.submit(seq, gen, seq, 0, indices)
    out = {}
    for seq, indices in enumerate(batches):
        state = mgr.wait(seq, gen, timeout=60)
        assert state.size == len(indices) and not state.failures
        labels = mgr.board.ring.labels[state.slot][: state.size].tolist()
        assert labels == indices  # every position holds the sample submitted there
        out.update({i: mgr.board.ring.images[state.slot, p].copy() for p, i in enumerate(indices)})
    return out


def _run_with_kind(ds, workers, batches, counters=None):
    """A manager with `workers` CPU workers and a registered ThreadKind runs `batches`, then shuts
    down: (manager, kind, {index: image})."""
    mgr = _manager(ds, workers, batches, counters)
    kind = ThreadKind(mgr.board)
    mgr.board.add_worker_kind(kind)
    kind.start()
    try:
        images = _run_batches(mgr, batches)
    finally:
        mgr.shutdown()
    return mgr, kind, images


def test_a_worker_kind_registered_on_the_board_serves_every_sample_once_and_is_stopped():
    """End to end without CPU workers: only the registered kind produces; it is stopped at shutdown."""
    ds = Bytes(20)
    batches = [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    mgr, kind, images = _run_with_kind(ds, 0, batches)
    assert sorted(kind.done) == list(range(20))  # each sample exactly once
    assert all((img == MARK).all() for img in images.values())
    assert kind.starts == 1 and kind.stops == 1 and not kind._thread.is_alive()
    assert mgr.board.kinds == []
    mgr.shutdown()  # idempotent: the kind is not stopped twice
    assert kind.stops == 1


def test_a_worker_kind_shares_mini_batches_with_cpu_workers_exactly_once():
    """The kind beside a real CPU worker process: together they produce each sample once, each
    sample's pixels are its producer's, and the pool's counters count only the CPU worker's share."""
    ds = Bytes(24, sleep=0.01)
    batches = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    counters = RuntimeCounters()
    _mgr, kind, images = _run_with_kind(ds, 1, batches, counters)
    assert kind.stops == 1
    by_kind = set(kind.done)
    assert len(kind.done) == len(by_kind) > 0
    cpu = CpuPipeline(SMALL)
    by_workers = {i for i, img in images.items() if np.array_equal(img, cpu(ds.data[i], i, seed=5, epoch=0))}
    assert by_kind | by_workers == set(range(24)) and not by_kind & by_workers
    assert 2 * sum(counters.tiny_batches_per_worker) >= len(by_workers)  # tiny-batches of up to 2 samples
    assert len(counters.tiny_batches_per_worker) == 1


def test_a_kind_with_nothing_submitted_takes_nothing_and_is_stopped():
    mgr = _manager(Bytes(4), 0, [[0]])
    kind = ThreadKind(mgr.board)
    mgr.board.add_worker_kind(kind)
    kind.start()
    mgr.shutdown()
    assert kind.done == [] and kind.stops == 1


def test_waiting_on_a_shut_down_manager_fails_clearly_instead_of_hanging():
    from fusionflow.errors import FusionFlowError

    policy = load_policy(SMALL)
    mgr = LocalManager(Bytes(), RuntimeSpec(policy, RingLayout(1, 4, policy.out_shape, policy.out_dtype), 0, seed=0))
    gen = mgr.new_generation()
    mgr.submit(0, gen, 0, 0, [0, 1, 2, 3])
    mgr.shutdown()
    with pytest.raises(FusionFlowError, match="shut down during this iteration"):
        mgr.wait(0, gen, timeout=0)


class InterruptedKind(ThreadKind):
    """A kind whose stop is interrupted (a Ctrl-C in the accelerator's DALI shutdown) after it stopped its thread."""

    def stop(self):
        super().stop()
        raise KeyboardInterrupt


def test_a_ctrl_c_in_a_kind_s_stop_still_ends_every_worker_and_the_ring_then_propagates():
    """The manager's shutdown went no further than the raising kind, and marked itself closed first: the CPU
    workers and the ring outlived it and no later close() could stop them (a helper's sweep: 4 of 49 Ctrl-Cs)."""
    batches = [list(range(0, 8)), list(range(8, 16))]
    mgr = _manager(Bytes(16), 2, batches)
    first, later = InterruptedKind(mgr.board), ThreadKind(mgr.board)
    for kind in (first, later):
        mgr.board.add_worker_kind(kind)
        kind.start()
    _run_batches(mgr, batches)
    procs = [w.process for w in mgr.pool.workers if w is not None]
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    with pytest.raises(KeyboardInterrupt):
        mgr.shutdown()
    assert first.stops == later.stops == 1  # the kind registered before it was stopped too
    assert not any(p.is_alive() for p in procs) and mgr.pool is None
    assert mgr.board.ring.images is None and mgr.board.ring.fd is None  # unmapped, its descriptor closed
    mgr.shutdown()  # idempotent
