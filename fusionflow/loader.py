"""FusionFlowLoader: a drop-in `torch.utils.data.DataLoader` whose batches are augmented by CPU
worker processes writing straight into shared memory, tiny-batch by tiny-batch.

    loader = FusionFlowLoader(ds, batch_size=256, shuffle=True, num_workers=8,
                              policy="configs/randaugment.yaml", tiny_batch_size=4, seed=0)
    for epoch in range(E):
        loader.set_epoch(epoch)
        for images, labels in loader:   # uint8 [B, 3, H, W] (float32 if the policy normalises), int64 [B]
            ...

Beyond DataLoader's arguments: `policy` (a shipped name, a YAML path or a dict), `tiny_batch_size`
(default min(4, batch_size)), `seed`, `device` ("cpu" or "cuda[:N]": batches are delivered there),
`on_error` ("raise" or "skip"), `max_retries` (worker deaths a sample may cause), `pin_workers`
("auto": pin each worker to a core only when all local ranks' workers and their training processes
get a core each; True/False force it),
and the accelerator: `accelerator` (None -- CPU workers only, the default until the GPU path has
been proven on a GPU --, "dali-gpu", "dali-cpu", or "auto": DALI on the GPU when device is CUDA),
`gpu_sharing` ("auto", "temporal", "spatial", "off"), and the ablations `aot`, `taas`, `taas_last_k`.
`memory_bridge` ("auto", "on", "off"): in temporal sharing, PyTorch lends its free cached GPU blocks
to DALI for each prep window instead of DALI growing a pool of its own (fusionflow/memory/bridge.py);
"auto" turns it on when the accelerator is DALI on the GPU and the native part builds (it lends only
while sharing is temporal), "on" makes that a requirement (an error says what is missing) and fixes
gpu_sharing="auto" to "temporal".
`trace` (a file path, or None): write a Chrome/Perfetto timeline of the run there -- every tiny-batch on
its worker's track, the training loop's waits at next() -- at close() and at the end of each iteration;
`loader.trace(path)` does the same for a `with` block (fusionflow/trace.py). `stage_times=True`: CPU
workers time each stage of each sample (read, decode+crop+resize, flip, each op, write), summed per
worker in `loader.stats.stage_seconds()` / `stage_shares()` (fusionflow/stages.py). Both are off by default.
`global_manager` ("auto": under torchrun with several local ranks, the ranks' loaders lend idle CPU
workers to each other through one global manager per node; a string: join that named job, e.g.
train and validation loaders of one process; None: no lending) -- see runtime/gm/manager.py.

`collate_fn`: DataLoader's contract. None or `torch.utils.data.default_collate` cost nothing (the batch
is already collated in place). Any other callable is called with the batch as a list of (image, target)
samples -- images are views of the delivered batch tensor, on the loader's `device`; targets as the
dataset returned them -- in the training process, after the batch is on its device, and the iteration
yields what it returns: torchvision's `collate_fn=lambda b: mixup_cutmix(*default_collate(b))` works unchanged (and runs on the GPU
when device is CUDA).

`seed`: None (the default) derives it once per loader as DataLoader derives its base seed: from
`generator.initial_seed()` if a generator is given, else from `torch.initial_seed()` -- different at
every launch unless the script calls `torch.manual_seed`, which makes it reproducible. Pass an int to
fix it (e.g. to resume a run with the same augmentation); `loader.seed` holds the one in use.

The arguments are resolved once, at construction, into `loader.config`, a frozen LoaderConfig
(fusionflow/loader_config.py: every default chosen, every value checked; nothing is started or built
until the first iteration).

`num_workers` above the usable CPU cores warns (as DataLoader does) and runs; the workers then share cores.
A dataset must give raw samples (encoded bytes, PIL images or uint8 arrays): one whose dataset[0] is a
float tensor/array (already transformed) is refused at construction.

Targets: any type `default_collate` handles, delivered as DataLoader delivers them (floats as float64,
tensors stacked, strings as a tuple of str, dicts per key). Python int targets travel as int64 in shared memory;
any other target is pickled with its tiny-batch's completion (targets only, never pixels) and collated
in the training process -- see runtime/targets.py.

Checkpointing: `state_dict()` anywhere in an epoch, `load_state_dict(state)` on a fresh loader (any
num_workers) resumes with the identical remaining batches and epochs -- see fusionflow/state.py.

Augmentation is a pure function of (seed, epoch, sample index). `set_epoch` sets the epoch (and
forwards it to a DistributedSampler); an iteration that was not preceded by `set_epoch` uses the
previous epoch + 1, so forgetting it never repeats last epoch's augmentation.

Repeated augmentation: a sampler that yields an index several times in an epoch (timm's/DeiT's and
torchvision's RASampler) gets a different augmentation for every copy. Each sample carries a copy
number, `occurrence * world_size + rank` (fusionflow.scheduling.tiny_batches.Copies), into the draw
(seed, epoch, index, copy), wherever its tiny-batch runs. rank/world_size are the sampler's
`rank`/`num_replicas` (DistributedSampler, RASampler), else torch.distributed's, else 0/1: RASampler
deals an index's copies to different ranks, so the rank must be part of the key for them to differ.
Copy 0 (a single process's first occurrences, rank 0's in DDP) keeps the draw (seed, epoch, index).
"""
from __future__ import annotations

import functools
import logging
import os
import time
import warnings
import weakref

import torch
from torch.utils.data import Sampler

from fusionflow.accelerator_control import AcceleratorControl, close_bridge_window, copy_bridge_stats
from fusionflow.delivery import BatchDelivery, collated, plain
from fusionflow.loader_config import Host, LoaderConfig, resolve_config
from fusionflow.loader_state import Checkpointing
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.local_manager import LocalManager
from fusionflow.runtime.shm import RingLayout
from fusionflow.stats import LoaderStats  # also re-exported: `from fusionflow.loader import LoaderStats` works
from fusionflow.trace import Tracing

log = logging.getLogger(__name__)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


class FusionFlowLoader(Checkpointing, BatchDelivery, AcceleratorControl, Tracing):
    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Sampler | None = None, batch_sampler=None, num_workers: int = 0, collate_fn=None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, policy="default", tiny_batch_size: int | None = None,
                 seed: int | None = None,
                 device="cpu", on_error: str = "raise", max_retries: int = 2, pin_workers: bool | str = "auto",
                 accelerator: str | None = None, gpu_sharing: str = "auto", aot: bool = True, taas: bool = True,
                 taas_last_k: bool = True, global_manager: str | None = "auto", memory_bridge: str = "auto",
                 trace=None, stage_times: bool = False, remote_workers=None):
        # ---- resolution and validation (fusionflow/loader_config.py): every message names the value and the fix
        notes: list = []  # warnings for the caller, given even when a later argument is refused
        try:
            cfg = resolve_config(
                dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
                num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last,
                timeout=timeout, worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                generator=generator, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                policy=policy, tiny_batch_size=tiny_batch_size, seed=seed, device=device, on_error=on_error,
                max_retries=max_retries, pin_workers=pin_workers, accelerator=accelerator,
                gpu_sharing=gpu_sharing, aot=aot, taas=taas, taas_last_k=taas_last_k,
                global_manager=global_manager, memory_bridge=memory_bridge, trace=trace,
                stage_times=stage_times, remote_workers=remote_workers, host=Host(cores=lambda: _usable_cpus()), notes=notes)
        finally:
            for note in notes:
                warnings.warn(note, UserWarning, stacklevel=2)
        self.config = cfg  # as resolved at construction (load_state_dict may replace the seed)
        self._apply_config(dataset, cfg)
        from fusionflow.trace import TraceRecorder
        self._tracer = None if trace is None else TraceRecorder()
        self.sizes = getattr(dataset, "sizes", None)
        self.stats = LoaderStats()
        self._bridge_why_off = cfg.bridge_why_off  # None: start the bridge with the accelerator (again after close())
        self.stats.memory_bridge = None if cfg.bridge_why_off is None else f"off: {cfg.bridge_why_off}"
        self._epoch, self._epoch_set, self._iterations = 0, False, 0
        self._yielded = None  # batches yielded in the epoch in progress (None: none in progress)
        self._epoch_start = None  # what reproduces that epoch's order (fusionflow/state.py)
        self._resume = None  # (sampler state, batches to skip) for the next iteration, from load_state_dict
        self._serial = 0  # iterations started: only the newest one counts its batches into the state
        self._manager: LocalManager | None = None
        self._active_generation = None
        self._warned_skip = False
        self._device_ring = None
        self._profiler = None  # gpu_sharing="auto" on a GPU
        self._accel = None  # the DALI accelerator worker kind this loader started on its manager
        # the manager (and the allocator bridge, and the accelerator) live in a box the finalizer holds, so
        # it runs at exit or collection without self
        self._box = [None, None, None]
        self._finalizer = weakref.finalize(self, _shutdown_manager, self._box)

    def _apply_config(self, dataset, cfg: LoaderConfig) -> None:
        """The resolved configuration as the attributes the loader (and DataLoader's users) read."""
        self.dataset, self.batch_sampler, self.sampler = dataset, cfg.batch_sampler, cfg.sampler
        self.batch_size, self.drop_last, self.capacity = cfg.batch_size, cfg.drop_last, cfg.capacity
        self.num_workers, self.prefetch_factor, self.timeout = cfg.num_workers, cfg.prefetch_factor, cfg.timeout
        self.worker_init_fn, self.multiprocessing_context = cfg.worker_init_fn, cfg.multiprocessing_context
        self.persistent_workers, self.tiny_batch_size, self.seed = (cfg.persistent_workers, cfg.tiny_batch_size,
                                                                    cfg.seed)
        self._seed_given = cfg.seed_given
        self.on_error, self.max_retries, self.pin_workers = cfg.on_error, cfg.max_retries, cfg.pin_workers
        self.device = cfg.device
        self._alloc_device = self.device  # where delivered tensors live (tests: the CPU, under a fake torch.cuda)
        self.policy, self.job = cfg.policy, cfg.job
        self.accelerator, self.gpu_sharing, self.aot = cfg.accelerator, cfg.gpu_sharing, cfg.aot
        self.taas, self.taas_last_k = cfg.taas, cfg.taas_last_k
        self.memory_bridge = cfg.memory_bridge
        self._bridge = None
        self._trace_path, self._stage_names = cfg.trace_path, cfg.stage_names
        self.collate_fn, self._collate = cfg.collate_fn, cfg.collate  # _collate None: batches as delivered
        self.pin_memory = cfg.pin_memory
        self.remote_workers = cfg.remote_workers

    # ---------------------------------------------------------------- DataLoader surface
    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Set the augmentation epoch and forward it to the sampler (e.g. DistributedSampler)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be a non-negative integer")
        if self._resume is not None and self._resume[1] and epoch != self._epoch:
            warnings.warn(f"set_epoch({epoch}) after load_state_dict of a state in the middle of epoch {self._epoch}: "
                          f"epoch {epoch} starts from its first batch; call set_epoch({self._epoch}) (or none) to "
                          "resume the saved epoch's remaining batches", UserWarning, stacklevel=2)
            saved = self._resume[0]  # a sampler ordered by epoch (DistributedSampler) takes the new one
            self._resume = None if saved.get("kind") == "epoch" else (saved, 0)
        self._epoch, self._epoch_set = epoch, True
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        if self._iterations and not self._epoch_set:
            self._epoch += 1
        self._epoch_set = False
        self._iterations += 1
        # an epoch is in progress from iter() on (its order is captured when its first batch is drawn)
        self._epoch_start, self._yielded = self._resume if self._resume is not None else (None, 0)
        self._serial += 1
        run = self._iter_inline if self.num_workers == 0 else self._iter_workers
        batches = run(self._epoch, self._serial)
        return plain(batches) if self._collate is None else collated(batches, self._collate)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop workers, return lent GPU blocks and release shared memory now (and write the trace, if
        any). The loader can be iterated again after."""
        self._box[:] = self._manager, self._bridge, self._accel  # the finalizer's box holds what the loader holds
        self._manager = self._bridge = self._accel = None
        _shutdown_manager(self._box, self.stats)
        self._flush_trace()

    # ---------------------------------------------------------------- internals
    def _ensure_manager(self) -> LocalManager:
        if self._manager is None:
            layout = RingLayout(self.prefetch_factor, self.capacity, self.policy.out_shape, self.policy.out_dtype)
            t0 = time.perf_counter()
            ctx = self.multiprocessing_context
            if isinstance(ctx, str):
                import multiprocessing
                ctx = multiprocessing.get_context(ctx)
            # the stats object, not the loader, goes to the manager: the manager must not hold the loader
            stage_times = (None if self._stage_names is None else
                           functools.partial(self.stats.add_stage_times, self._stage_names))
            self._manager = LocalManager(
                self.dataset, self.policy, layout, self.num_workers, self.seed, self.worker_init_fn, ctx,
                self.pin_workers, self.max_retries, self.sizes, self.tiny_batch_size,
                base_seed=int(torch.empty((), dtype=torch.int64).random_().item()) % 2**31, job=self.job,
                spec=self._lending_spec(), stages=self._stage_names, counters=self.stats, trace=self._tracer,
                on_stage_times=stage_times)
            self._box[0] = self._manager
            try:
                if self.stats.startup_seconds is None:
                    self.stats.startup_seconds = time.perf_counter() - t0
                if self.device.type == "cuda" and not self._manager.register_cuda(self.device.index):
                    log.warning("cudaHostRegister of the batch ring failed; host->device copies will be synchronous")
                if self.accelerator is not None:
                    self._start_accelerator(self._manager)
                if self.remote_workers is not None:
                    self._start_remote(self._manager)
            except BaseException:  # no half-started manager stays behind
                self._stop_manager()
                raise
        return self._manager

    def _start_remote(self, mgr: LocalManager) -> None:
        """Ray actors as one more worker kind on the board (fusionflow/remote/kind.py); a dataset that
        cannot be pickled or read on a remote node fails here, at start-up (the caller stops the manager)."""
        from fusionflow.remote.kind import RemoteWorkers
        kind = RemoteWorkers(mgr.board, self.remote_workers, self.dataset, self.policy, self.seed, self.stats,
                             first_worker_id=self.num_workers, worker_init_fn=self.worker_init_fn)
        mgr.board.add_worker_kind(kind)  # registered first: the manager's shutdown stops it even if start() fails
        kind.start()

    def _lending_spec(self) -> bytes | None:
        """What workers lent to this loader need (pickled once per loader, not per epoch)."""
        if self.job is None:
            return None
        if not hasattr(self, "_spec"):
            from fusionflow.runtime.gm.link import make_spec
            self._spec = make_spec(self.dataset, self.policy, self.worker_init_fn)
        return self._spec

    def _stop_manager(self) -> None:
        """Shut the manager down (`_shutdown_manager`); the allocator bridge stays for the next one."""
        self._box[:] = self._manager, self._bridge, self._accel  # the finalizer's box holds what the loader holds
        self._manager = self._accel = None
        _shutdown_manager(self._box, self.stats, keep_bridge=True)


    def _from_ring(self, mgr: LocalManager, state):
        """A completed mini-batch's ring slot -> (images, labels, the targets as the dataset gave them
        when not all are ints, the CUDA event after the copies out of the slot or None)."""
        n = state.size
        keep = self._select(range(n), state.failures)
        imgs = mgr.board.ring.images[state.slot]
        labs = mgr.board.ring.labels[state.slot]
        objs = (ff_targets.gather(labs, range(n) if keep is None else keep, state.targets)
                if state.targets else None)  # targets that are not all ints: collated as DataLoader does
        imgs, labs = (imgs[:n], labs[:n]) if keep is None else (imgs[keep], labs[keep])
        if self._device_ring is not None and state.accel_positions:
            images_t, labels_t, event = self._deliver_merged(mgr, state, keep)
        else:
            images_t, labels_t, event = self._deliver(imgs, labs)
        if objs is not None:
            labels_t = self._collate_targets(objs)
        return images_t, labels_t, objs, event

    def _iter_workers(self, epoch: int, serial: int):
        mgr = self._ensure_manager()
        if self._active_generation is not None:  # a previous iterator was left unfinished
            mgr.abandon(self._active_generation)
        gen = mgr.new_generation()
        self._active_generation = gen
        copies = self._copies()
        batches = self._epoch_batches(serial, copies)
        submitted, delivered, exhausted = 0, 0, False
        free_slots = list(range(self.prefetch_factor))
        pending_release = None  # (slot, CUDA event) of the batch the caller holds on the GPU path
        finished = False
        try:
            def refill():
                nonlocal submitted, exhausted
                while free_slots and not exhausted:
                    indices = next(batches, None)
                    if indices is None:
                        exhausted = True
                        break
                    self._check_batch(indices)
                    mgr.submit(submitted, gen, free_slots.pop(0), epoch, list(indices), copies(indices))
                    submitted += 1

            refill()
            while delivered < submitted:
                if pending_release is not None:
                    slot, event = pending_release
                    event.synchronize()
                    free_slots.append(slot)
                    pending_release = None
                    refill()
                t0 = time.perf_counter()
                self._mark_step(mgr)
                self._open_window(mgr)
                try:
                    state = mgr.wait(delivered, gen, self.timeout)
                finally:
                    self._close_window(mgr)
                wait = time.perf_counter() - t0
                images_t, labels_t, objs, event = self._from_ring(mgr, state)
                self._account(wait, len(images_t))
                if self._tracer is not None:
                    self._trace_wait(wait, delivered, len(images_t))
                self._sync_bridge()
                delivered += 1
                if event is None:
                    free_slots.append(state.slot)
                    refill()
                else:
                    pending_release = (state.slot, event)
                self._yielded_one(serial)
                yield images_t, labels_t, objs
            finished = True
            self._yielded_one(serial, done=True)  # the epoch is complete
        finally:
            self._end_iteration(mgr, gen, finished)

    def _end_iteration(self, mgr: LocalManager, gen: int, finished: bool) -> None:
        """An iteration ended (its last batch, an exception, or the caller dropped it): forget its unfinished
        work; without persistent workers, shut the manager down."""
        if self._manager is mgr:
            if not finished:
                mgr.abandon(gen)
            if self._active_generation == gen:
                self._active_generation = None
            if not self.persistent_workers:
                self._stop_manager()
        self._flush_trace()


def _shutdown_manager(box, stats=None, keep_bridge: bool = False) -> None:
    """The loader's one shutdown procedure for its manager and allocator bridge, run by every path:
    `close()`, the end of an iteration without persistent workers, a new seed, a manager that failed
    to start its accelerator, and the finalizer at the loader's collection or interpreter exit (which
    holds only `box`, [manager, bridge, accelerator], never the loader). Idempotent.

    1. Take the manager and its accelerator (and, unless `keep_bridge`, the bridge) out of the box: a
       second run finds nothing to do.
    2. Close the accelerator's prep window, if open: the tiny-batch in flight finishes first
       (`wait_idle`), then PyTorch takes its lent blocks back (`bridge.close`).
    3. Shut the manager down (`LocalManager.shutdown`, its own numbered procedure: worker kinds,
       manager thread, lending agent, worker processes, ring).
    4. Allocator bridge: take back what DALI's pipelines held (they are gone now) and copy its
       counters into `stats`; unless it is kept for the next manager, shut it down (every block goes
       back, the ledger is unlinked).
    """
    mgr, bridge, accel = box
    box[0] = box[2] = None
    if not keep_bridge:
        box[1] = None
    if mgr is not None:
        if accel is not None and accel.window_open:
            with mgr.board.cond:
                accel.window_open = False
                accel.wait_idle()
            close_bridge_window(bridge)
        mgr.shutdown()
        close_bridge_window(bridge)
        if stats is not None:
            copy_bridge_stats(bridge, stats)
    if bridge is not None and not keep_bridge:
        bridge.shutdown()
