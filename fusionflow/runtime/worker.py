"""The CPU worker process: take tiny-batch tasks, decode + augment each sample straight into its
slot of the shared batch ring, report completion. Everything it touches is an argument.

Watchdog: a thread of the worker's own looks for the training process every `WATCHDOG_S`; when it finds
the worker orphaned (the training process died without stopping it) it ends the process at once, whether
the worker waits for a task or is inside one sample's read that takes minutes (a call that holds the GIL
that long holds the watchdog too), so the process does not outlive the job by more than a slice (its idle
waits also look, and end it cleanly). The ring has no name by then (the owner unlinks it at creation and
hands out its descriptor): its memory is freed when the last process mapping it exits.

Lending (DDP, runtime/gm/manager.py): on LEND from its owner the worker connects to another
local manager's socket and runs that LM's tiny-batches -- with that LM's dataset, policy and seed,
into that LM's ring -- until it is returned, then reports HOME. See `serve_borrower`.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import wait as mp_wait

from fusionflow.datasets.wrappers import start_reads
from fusionflow.runtime import messages as m
from fusionflow.runtime.authsock import recv_whole
from fusionflow.runtime.cores import local_ranks
from fusionflow.runtime.gm.link import close_inherited, connect, set_receive_timeout
from fusionflow.runtime.procs import parent_gone
from fusionflow.runtime.sample import end_after_read, run_samples
from fusionflow.runtime.shm import BatchRing, ChildFd, RingLayout, map_from_child_fd, recv_fd

WATCHDOG_S = 0.5
BORROWER_SILENT_S = 10.0  # a lent worker with no task and no word from its borrower this long goes home


class _Orphaned(Exception):
    """The training process that owns this worker is gone."""


class _Stopped(Exception):
    """The owner sent STOP while this worker was lent."""


def seed_as_dataloader(base_seed: int, worker_id: int, num_workers: int, dataset) -> None:
    """What DataLoader's worker does before `worker_init_fn`: seed Python's, torch's and NumPy's RNGs from
    `base_seed + worker_id` (NumPy's from torch's own mix of the two), and set torch's worker info, so that
    `torch.utils.data.get_worker_info()` -- in `worker_init_fn` and in the dataset, e.g. to open a file
    handle per worker -- gives this worker's id, the loader's num_workers, its seed and the dataset."""
    import numpy as np
    import torch
    from torch.utils.data._utils import worker as torch_worker

    dataset = users_dataset(dataset)
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    mix = getattr(torch_worker, "_generate_state", None)  # torch's private helper: NumPy's seed as DataLoader's
    np.random.seed(mix(base_seed, worker_id) if mix is not None else seed % 2**32)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


def users_dataset(dataset):
    """The dataset the script gave, under the loader's views of it (read ahead, dict samples: loader_wrapper)."""
    while getattr(dataset, "loader_wrapper", False):
        dataset = dataset.dataset
    return dataset


class _InfoFor:
    """torch's worker info naming `dataset` while this worker serves a borrower (another loader's dataset),
    the home loader's again after."""

    def __init__(self, dataset):
        self.dataset = users_dataset(dataset)

    def __enter__(self):
        from torch.utils.data._utils import worker as torch_worker

        self.home = home = torch_worker._worker_info
        if home is not None:
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=home.id, num_workers=home.num_workers, seed=home.seed, dataset=self.dataset
            )

    def __exit__(self, *exc):
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = self.home


def run_task(task, dataset, pipe, ring, seed: int, out, clock=None) -> None:
    """Decode + augment a tiny-batch into `ring`; report DONE on `out`: failures as data, targets that are
    not ints (runtime/targets.py; ints go into the ring's label slot), the task's start and end on
    CLOCK_MONOTONIC and, if `clock` (a stages.StageClock) is given, its stage totals."""
    side = {}
    started = time.monotonic_ns()
    start_reads(dataset, task.indices)  # read_ahead=: the reads start now
    images, labels = ring.images[task.slot], ring.labels[task.slot]
    failures = run_samples(dataset, pipe, task.positions, task.indices, task.copies, seed, task.epoch, images, labels,
                           side, clock)  # fmt: skip
    out.send_bytes(
        m.pack_done(
            task.task_id,
            task.generation,
            failures,
            started,
            time.monotonic_ns(),
            clock.take() if clock is not None else (),
            targets=side,
        )
    )


def exit_when_orphaned(parent_pid: int) -> threading.Thread:
    """Start the watchdog thread: it ends this process (os._exit, nothing left to clean up: the ring has no name)
    within WATCHDOG_S of the training process's death. The main thread looks only between samples, and one
    sample's read can take minutes (a slow store, a hung network read): the work queued before the owner died,
    or the sample in hand, would run on for nobody, the ring's memory held meanwhile."""

    def watch() -> None:
        while not parent_gone(parent_pid):
            time.sleep(WATCHDOG_S)
        os._exit(0)

    thread = threading.Thread(target=watch, name="fusionflow-orphan-watch", daemon=True)
    thread.start()
    return thread


def _check_orphan(parent_pid: int) -> None:
    if parent_gone(parent_pid):  # (under forkserver the parent is the fork server: it used to stop every idle worker)
        raise _Orphaned


class SpecCache:
    """Borrowers' (dataset, pipeline) a worker keeps by spec hash, the `kept` latest used (one per rank on the node): a
    lender's worker lives as long as its loader, while a borrower sends a new spec at each of its runtime starts
    (each epoch without persistent workers), so keeping every one grew the worker by a dataset copy an epoch."""

    def __init__(self, kept: int = 2):
        self.kept, self._specs = kept, {}

    def get(self, spec_hash):
        found = self._specs.pop(spec_hash, None)
        if found is not None:
            self._specs[spec_hash] = found  # the latest used last
        return found

    def put(self, spec_hash, found) -> None:
        self._specs[spec_hash] = found
        while len(self._specs) > self.kept:
            del self._specs[next(iter(self._specs))]

    def hashes(self) -> list:
        return list(self._specs)


def _borrower_spec(bconn, spec_hash, home, spec_cache: SpecCache, worker_id: int):
    """(dataset, pipeline) for the borrower's spec: this worker's own, one it served before, or the
    one it asks the borrower for (NEED -> SPEC); None if that cannot be set up (FATAL sent) or the
    borrower answered RETURN (it is closing)."""
    from fusionflow.ops.cached import CacheRendering
    from fusionflow.ops.pipeline import CpuPipeline

    if spec_hash == home[2]:
        return home[0], home[1]
    if (found := spec_cache.get(spec_hash)) is not None:
        return found
    bconn.send_bytes(m.pack_control(m.NEED))
    spec = bconn.recv_bytes()
    if m.kind_of(spec) == m.RETURN:  # the borrower is closing: nothing to set up
        return None
    try:
        spec = m.unpack_message(spec, m.Spec)
        rendering = CacheRendering(spec.cache_side) if spec.cache_side is not None else None
        dataset, pipe = spec.dataset, CpuPipeline(spec.policy, cache=rendering)
        if spec.worker_init_fn is not None:  # the borrower's per-worker set-up (e.g. opening its files)
            with _InfoFor(dataset):
                spec.worker_init_fn(worker_id)
    except Exception as exc:
        bconn.send_bytes(m.pack_fatal(worker_id, traceback.format_exc(), exc))
        return None
    spec_cache.put(spec_hash, (dataset, pipe))
    return dataset, pipe


def _leave(bconn) -> None:
    """Tell the borrower this worker leaves: what it queued for it is not suspect (it re-runs it)."""
    try:
        bconn.send_bytes(m.pack_control(m.LEAVING))
    except OSError:
        pass  # it closed meanwhile: nothing of ours is left there


def serve_borrower(lend, conn, worker_id: int, home, spec_cache: SpecCache, parent_pid: int) -> int:
    """Serve another local manager (the borrower) until it returns this worker; returns the number of
    tiny-batches run for it. `lend` is the owner's `Lend` message; `home` = (dataset, pipe, spec hash).

    Protocol on the borrower's socket: HELLO ->, <- SETUP (ring, layout, seed, spec hash),
    [NEED ->, <- SPEC (its pickled dataset and policy) unless this worker already has them],
    READY ->, then TASK / DONE as with the owner, until RETURN or the borrower closes. RETURN may
    also come in place of SETUP or SPEC (the borrower closing while the worker arrives). A worker
    serves one LM at a time: the owner sends it nothing while it is lent. A borrower that leaves it
    without a task and says nothing for BORROWER_SILENT_S (stopped, hung) is left (LEAVING): a live
    borrower sends RETURN when it has nothing left for a guest, within its manager's next turns.
    """
    try:
        bconn = connect(lend.address, lend.secret)
    except (OSError, EOFError, ConnectionError, AuthenticationError) as exc:  # the borrower left: nothing lost
        logging.getLogger(__name__).info("worker %d could not reach LM %d: %r", worker_id, lend.peer, exc)
        return 0
    ring, done = None, 0
    try:
        bconn.send_bytes(m.pack_message(m.Hello(lend.owner_lm, worker_id)))
        first = bconn.recv_bytes()
        if m.kind_of(first) == m.RETURN:  # the borrower began closing as we arrived: go home
            return 0
        setup = m.unpack_message(first, m.Setup)
        layout, seed, spec_hash = setup.layout, setup.seed, setup.spec_hash
        ring_fd = recv_fd(bconn)  # the borrower's ring has no name: map the descriptor it sends
        try:
            ring = BatchRing(layout, fd=ring_fd)
        finally:
            os.close(ring_fd)
        found = _borrower_spec(bconn, spec_hash, home, spec_cache, worker_id)
        if found is None:
            return 0
        dataset, pipe = found
        set_receive_timeout(bconn, 0)  # handshake done: from now on the borrower paces us
        bconn.send_bytes(m.pack_ready(worker_id))
        heard = time.monotonic()
        while True:
            ready = mp_wait([bconn, conn], WATCHDOG_S)
            if not ready:
                _check_orphan(parent_pid)
                if time.monotonic() - heard > BORROWER_SILENT_S:
                    _leave(bconn)
                    return done
                continue
            if conn in ready:
                try:
                    kind = m.kind_of(conn.recv_bytes())
                except (EOFError, OSError):
                    raise _Orphaned from None  # the owner died while we were away
                if kind == m.STOP:  # tell the borrower first: what it queued for us is not suspect
                    _leave(bconn)
                    raise _Stopped
            if bconn in ready:
                msg = recv_whole(bconn)  # a borrower stopped mid-message: TimeoutError, home
                if m.kind_of(msg) == m.RETURN:
                    return done
                with _InfoFor(dataset):
                    run_task(m.unpack_task(msg), dataset, pipe, ring, seed, bconn)
                done += 1
                heard = time.monotonic()
    except (EOFError, OSError):
        return done  # the borrower closed (it finished, or died): what it had outstanding it requeues
    finally:
        bconn.close()
        if ring is not None:
            ring.close()


def worker_loop(
    worker_id: int,
    dataset,
    policy,
    ring_fd: ChildFd,
    layout: RingLayout,
    conn,
    seed: int,
    base_seed: int,
    worker_init_fn,
    parent_pid: int,
    cpu: int | None,
    spec_hash: bytes | None = None,
    stages: tuple[str, ...] | None = None,
    cache=None,
    num_workers: int = 1,
) -> None:
    """`stages`: the stage names to time per sample (fusionflow/ops/stages.py), or None: no stage timing.
    `cache`: a CacheHandle (fusionflow/cache/attach.py), or None: no decoded-image cache. `num_workers`: the
    loader's (torch's worker info says it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler of the script's (`serve` has one): end quietly
    signal.signal(signal.SIGUSR1, end_after_read)  # the pool's stop of a busy worker: after the read in hand
    exit_when_orphaned(parent_pid)  # busy too (a worker_init_fn, a sample's read): nothing runs on for nobody
    close_inherited()
    ring = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        seed_as_dataloader(base_seed, worker_id, num_workers, dataset)
        import cv2
        import torch

        torch.set_num_threads(1)

        from fusionflow.ops.pipeline import CpuPipeline

        cv2.setNumThreads(1)  # one sample at a time per worker: OpenCV's own threads would only contend
        cache_fd = cache.take() if cache is not None else None  # before the parent's descriptors are closed
        ring = map_from_child_fd(layout, ring_fd)
        pipe = CpuPipeline(policy, cache=cache.reader(cache_fd) if cache is not None else None)
        clock = None
        if stages:
            from fusionflow.ops.stages import StageClock

            clock = StageClock(stages)
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
    except BaseException as exc:
        conn.send_bytes(m.pack_fatal(worker_id, traceback.format_exc(), exc))
        return
    conn.send_bytes(m.pack_ready(worker_id))
    spec_cache = SpecCache(max(2, local_ranks()))  # other LMs' (dataset, pipeline), for when this worker is lent
    try:
        while True:
            if not conn.poll(WATCHDOG_S):
                _check_orphan(parent_pid)
                continue
            msg = conn.recv_bytes()
            kind = m.kind_of(msg)
            if kind == m.STOP:
                return
            if kind == m.LEND:
                done = serve_borrower(
                    m.unpack_message(msg, m.Lend), conn, worker_id, (dataset, pipe, spec_hash), spec_cache, parent_pid
                )
                conn.send_bytes(m.pack_message(m.Home(done)))
                continue
            run_task(m.unpack_task(msg), dataset, pipe, ring, seed, conn, clock)
    except (_Orphaned, _Stopped, EOFError, OSError, BrokenPipeError):
        pass  # the owner is gone (or stopped us): nothing named is left to clean up
    finally:
        if ring is not None:
            ring.close()
