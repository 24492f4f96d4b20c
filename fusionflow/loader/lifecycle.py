"""LoaderRuntime: a FusionFlowLoader's runtime -- its LocalManager (the board, the CPU worker pool, the
lending agent) and the worker kinds started on it (the DALI accelerator through the loader's
GpuSession, Ray remote workers) -- started at the first iteration, stopped by one procedure
(`shutdown_runtime`) on every path, and a finalizer that runs that procedure when the loader is
collected or the interpreter exits.

The finalizer holds only `box` ([manager, GpuSession or None, cache attachment, the pid they belong to]),
never the loader or this object: nothing in the runtime refers back to the loader, so an abandoned loader
is collected and its workers, shared memory and lent GPU blocks go with it. A process forked from the
loader's (os.fork, a fork-context Pool) inherits the box: there it is another process's runtime, which it
neither uses nor stops -- a new iteration there starts a runtime of its own.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref

import torch

from fusionflow.datasets.sizes import encoded_sizes
from fusionflow.runtime.local_manager import LocalManager
from fusionflow.runtime.shm import RingLayout
from fusionflow.runtime.spec import RuntimeSpec, base_seed

log = logging.getLogger("fusionflow.loader")
# epochs in a row whose Ray workers failed to start (after a first start that worked) before no epoch asks again
MAX_REMOTE_STARTS_FAILED = 3


class LoaderRuntime:
    def __init__(self, dataset, stats, tracing, gpu=None):
        self.dataset, self.stats, self.tracing, self.gpu = dataset, stats, tracing, gpu
        self.manager: LocalManager | None = None
        self._spec = None  # what workers lent to this loader need (pickled at each start: the dataset may change)
        self._spec_refused = False  # it did not pickle once: said then, not again each epoch
        # what the finalizer shuts down: [manager, GpuSession, CacheAttachment, the process they belong to]
        self._box = [None, gpu, None, os.getpid()]
        self._cache_tried = False
        self._worker_target = None  # a `gm workers` target an epoch's manager had: the next one's (close() ends it)
        self._remote_ran, self._remote_failures = False, 0  # Ray workers started once; starts failed in a row since
        self._finalizer = weakref.finalize(self, shutdown_runtime, self._box)
        tracing.on_change = functools.partial(_set_trace, weakref.ref(self))  # weak: no cycle through tracing

    def start(self, config, alloc_device: torch.device, seed: int | None = None) -> LocalManager:
        """The running manager, started now if there is none (with the accelerator and remote
        workers the config asks for; `seed`: the iteration's base seed, drawn now if None). A start that
        fails half-way leaves nothing running. In a process forked from the one that started the manager, that
        one is forgotten (its workers and thread are the other process's) and a new one starts."""
        if self._box[3] != os.getpid():
            self.manager = self._box[0] = self._box[2] = None
            self._box[3], self._cache_tried, self._spec = os.getpid(), False, None  # (the spec holds the cache's side)
        if self.manager is not None:
            return self.manager
        cfg = config
        layout = RingLayout(cfg.prefetch_factor, cfg.capacity, cfg.policy.out_shape, cfg.policy.out_dtype)
        t0 = time.perf_counter()
        ctx = cfg.multiprocessing_context
        if isinstance(ctx, str):
            import multiprocessing

            ctx = multiprocessing.get_context(ctx)
        spec = RuntimeSpec(
            policy=cfg.policy,
            layout=layout,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            base_seed=base_seed(cfg.generator) if seed is None else seed,
            worker_init_fn=cfg.worker_init_fn,
            mp_context=ctx,
            pin_workers=cfg.pin_workers,
            trainer_cores=1 + (cfg.dali_threads if cfg.accelerator else 0),  # DALI's threads run in this process
            max_retries=cfg.max_retries,
            tiny_batch_size=cfg.tiny_batch_size,
            stages=cfg.stage_names,
            job=cfg.job,
            cache=self.cache(cfg),
        )
        self.manager = self._box[0] = LocalManager(
            self.dataset,
            spec,
            sizes=encoded_sizes(self.dataset),
            lend_spec=self._lending_spec(cfg),
            counters=self.stats,
            trace=self.tracing.recorder,
            on_stage_times=self._stage_times(cfg),
        )
        try:
            if self.stats.startup_seconds is None:
                self.stats.startup_seconds = time.perf_counter() - t0
            if cfg.device.type == "cuda" and not self.manager.register_cuda(cfg.device.index):
                log.warning("cudaHostRegister of the batch ring failed; host->device copies will be synchronous")
            if self.gpu is not None:
                self.gpu.start(self.manager, self.dataset, alloc_device)
            if cfg.remote_workers is not None and self._remote_failures < MAX_REMOTE_STARTS_FAILED:
                self._start_remote(cfg)
        except BaseException:  # no half-started manager stays behind
            self.stop()
            raise
        pool = self.manager.pool
        if self._worker_target is not None and pool is not None:  # (the job's GM, and its table, may be gone by now)
            with self.manager.board.cond:
                pool.target_workers = self._worker_target
        return self.manager

    @property
    def cache_attachment(self):
        """The open CacheAttachment (fusionflow/cache/attach.py: its store, keeper link, rows), or None."""
        return self._box[2]

    def cache(self, cfg):
        """The loader's CacheAttachment, opened at its first start and kept until close(); None without
        `cache=` or when it could not be set up (logged once)."""
        if cfg.cache is not None and self._box[2] is None and not self._cache_tried:
            from fusionflow.cache.attach import CacheAttachment

            self._cache_tried = True
            crop_size = cfg.policy.size if cfg.policy.crop_epochs > 1 else None
            self._box[2] = CacheAttachment.open(cfg.cache, self.dataset, cfg.num_workers, crop_size)
            if self._box[2] is not None:
                self.stats.watch_cache(self._box[2].counts)
        return self._box[2]

    def _stage_times(self, cfg):
        """Where workers' per-stage totals go (the stats object, not the loader: the runtime must not
        hold the loader), or None without stage timing."""
        return None if cfg.stage_names is None else functools.partial(self.stats.add_stage_times, cfg.stage_names)

    def _start_remote(self, cfg) -> None:
        """Ray actors, through a gateway process, as one more worker kind on the board
        (fusionflow/remote/kind.py); a dataset that cannot be pickled or read on a remote node fails
        here, at start-up (the caller stops the manager). A gateway killed or stopped while it starts is a fault of
        the machine: the local workers run on and the kind starts a new gateway later, as after a death."""
        from fusionflow.errors import GatewayLost
        from fusionflow.remote.kind import RemoteWorkers

        kind = RemoteWorkers(
            self.manager.board,
            cfg.remote_workers,
            self.dataset,
            self.manager.spec,
            self.stats,
            on_stage_times=self._stage_times(cfg),
        )
        # registered first: the manager's shutdown stops it even if start() fails
        self.manager.board.add_worker_kind(kind)
        try:
            kind.start()
        except Exception as exc:  # the loader's first start raises it; a later epoch's runs on the local workers
            if not self._remote_ran and not isinstance(exc, GatewayLost):  # (a killed or stopped gateway: a fault)
                raise
            self._remote_failures += 1
            log.warning(
                "remote_workers: the Ray workers did not start for this epoch (%s: %s); the local workers run it%s",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                ", and no later epoch asks for them again"
                if self._remote_failures >= MAX_REMOTE_STARTS_FAILED
                else "; the next epoch tries again",
            )
            return
        self._remote_ran, self._remote_failures = True, 0

    def _lending_spec(self, cfg) -> bytes | None:
        """What workers lent to this loader need, pickled once a runtime start: an epoch without persistent workers
        starts its workers anew, which see the dataset as it is now, so must lent ones (a spec made once a loader
        had them read epoch 0's copy ever after)."""
        if cfg.job is None:
            return None
        if self._spec is None:
            from fusionflow.runtime.gm.link import make_spec

            cache = self._box[2]  # opened before this (start): its rendering is part of the spec
            self._spec = make_spec(
                self.dataset,
                cfg.policy,
                cfg.worker_init_fn,
                cache.max_side if cache is not None else None,
                warn=not self._spec_refused,
            )
            self._spec_refused |= self._spec is None
        return self._spec

    def end_iteration(self, mgr: LocalManager, generation: int, finished: bool, persistent: bool) -> None:
        """An iteration on `mgr` ended (its last batch, an exception, or the caller dropped it): forget
        its unfinished work; without persistent workers, stop the runtime (the bridge stays) -- unless a
        newer iterator runs on it (the older one, abandoned, was dropped or raised after the newer began)."""
        if self.manager is mgr and self._box[3] == os.getpid():
            if not finished:
                mgr.abandon(generation)
            if not persistent and generation == mgr.generation:
                self.stop()

    def stop(self) -> None:
        """Shut the manager down; the allocator bridge stays for the next one, and so does a worker target that
        `gm workers` set (the job's GM leaves, with the target, when an epoch's gap outlasts its linger)."""
        mgr, self.manager, self._spec = self.manager, None, None
        if mgr is not None and mgr.agent is not None and mgr.pool is not None:
            self._worker_target = mgr.pool.target_workers if mgr.pool.target_workers != mgr.spec.num_workers else None
        shutdown_runtime(self._box, self.stats, keep_bridge=True)

    def close(self) -> None:
        """Shut everything down, the allocator bridge and the cache attachment too (the loader may start
        again after)."""
        self.manager, self._worker_target = None, None
        self._remote_ran, self._remote_failures = False, 0  # the next start is the loader's first again
        self._cache_tried, self._spec = False, None  # the next start attaches the cache (and makes the spec) anew
        shutdown_runtime(self._box, self.stats)


def _set_trace(workers_ref, recorder) -> None:
    """A new trace recorder (or None) for the running manager, if any."""
    workers = workers_ref()
    if workers is not None and workers.manager is not None:
        workers.manager.board.trace = recorder


def shutdown_runtime(box, stats=None, keep_bridge: bool = False) -> None:
    """The loader's one shutdown procedure for its manager and allocator bridge, run by every path:
    `close()`, the end of an iteration without persistent workers, a new seed, a manager that failed
    to start its accelerator, and the finalizer at the loader's collection or interpreter exit (which
    holds only `box`, never the loader). Idempotent. In a process forked from the box's (`box[3]`), nothing
    is stopped: the copy is dropped.

    1. Take the manager out of the box: a second run finds nothing to stop.
    2. Close the accelerator's prep window, if open: the DALI run in flight finishes first
       (`AcceleratorWorker.close_window`, `GpuSession.end_window_now`).
    3. Shut the manager down (`LocalManager.shutdown`, its own numbered procedure: worker kinds,
       manager thread, lending agent, worker processes, ring).
    4. The accelerator's DALI pipeline, left idle, is kept for the next manager (`keep_bridge`: not a close) or
       closed; once none is kept, the allocator bridge takes back the arena DALI's pipelines used and its counters
       go into `stats` (`GpuSession.manager_stopped`); unless kept for the next manager, the bridge is shut down
       (what is still lent goes back, the ledger is unlinked).
    """
    mgr, gpu, cache, pid = box
    box[0] = None
    if pid != os.getpid():  # a forked copy: the process that started the runtime stops it
        box[2] = None
        return
    if mgr is not None:
        if gpu is not None:
            gpu.end_window_now(mgr)
        mgr.shutdown()
        if gpu is not None:
            gpu.manager_stopped(stats, keep=keep_bridge)
    if gpu is not None and not keep_bridge:
        gpu.shutdown_bridge()
    if cache is not None and not keep_bridge:
        if stats is not None:
            stats.refresh_cache()
            stats.watch_cache(None)
        box[2] = None
        cache.close()
