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
train and validation loaders of one process; None: no lending) -- see runtime/global_manager.py.

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

import contextlib
import functools
import logging
import os
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from fusionflow import state as ff_state
from fusionflow.errors import SampleError
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import load_policy
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.local_manager import LocalManager
from fusionflow.runtime.messages import SampleFailure
from fusionflow.runtime.shm import RingLayout
from fusionflow.runtime.worker import describe, split_item
from fusionflow.scheduling.tiny_batches import Copies

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")
ACCELERATORS = (None, "dali-cpu", "dali-gpu")
SHARING = ("auto", "temporal", "spatial", "off")
BRIDGE = ("auto", "on", "off")
SKIP_CAUSES = {"ImageTooLargeError": "pixel_limit", "DecodeError": "corrupt"}  # loader.stats.skipped_by_cause


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class LoaderStats:
    """What the loader did, for tuning and for the tests. Reset by `reset()`."""

    batches: int = 0
    samples: int = 0
    skipped: int = 0
    skipped_indices: list = field(default_factory=list)
    # on_error="skip": samples dropped per cause: "pixel_limit" (over decode.max_pixels), "corrupt"
    # (could not be decoded), "error" (anything else, e.g. the dataset raised)
    skipped_by_cause: dict = field(default_factory=dict)
    wait_seconds: list = field(default_factory=list)  # time blocked in next(), per batch
    tiny_batches_per_worker: list = field(default_factory=list)
    worker_restarts: int = 0
    startup_seconds: float | None = None  # worker start-up, first time
    accelerator_tiny_batches: int = 0  # run by the DALI accelerator worker
    accelerator_given_back: int = 0  # handed to the CPU workers (undecodable by DALI, or not bytes)
    accelerator_builds: int = 0  # DALI pipeline builds (1 with AoT, one per tiny-batch without)
    accelerator_out_of_memory: int = 0  # tiny-batches handed to the CPU workers because DALI ran out of memory
    accelerator_retired: str | None = None  # why the accelerator stopped taking work (repeated failures)
    accelerator_build_seconds: float | None = None
    taas_k: list = field(default_factory=list)  # tiny-batches reserved for the accelerator, per mini-batch
    gpu_sharing: str | None = None  # what gpu_sharing="auto" chose, once profiled
    global_manager: str | None = None  # "active", "lost" (its GM died: own workers only) or None (off)
    workers_lent: int = 0  # times one of this loader's idle workers was lent to another loader (rank)
    workers_borrowed: int = 0  # workers of other loaders that served this one
    lent_tiny_batches: int = 0  # tiny-batches this loader's workers ran for others
    borrowed_tiny_batches: int = 0  # tiny-batches of this loader that borrowed workers ran
    worker_count_changes: int = 0  # elastic resizes applied (GlobalManagerClient.set_workers)
    memory_bridge: str | None = None  # "on", or "off: <why>"
    bridge_windows: int = 0  # prep windows in which PyTorch lent blocks to DALI
    bridge_lent_bytes: int = 0  # most bytes lent in one window
    bridge_borrowed_bytes: int = 0  # most bytes DALI had allocated from lent blocks at once
    bridge_fallback_bytes: int = 0  # bytes DALI took from its own pool inside windows
    bridge_pinned_bytes: int = 0  # lent bytes DALI still held at the last window's end
    bridge_seconds: float = 0.0  # time spent lending and taking back blocks, all windows
    stage_ns: dict = field(default_factory=dict)  # stage_times=True: worker -> {stage: ns}, summed over samples
    remote_tiny_batches: int = 0  # run by remote (Ray) CPU workers (remote_workers=RayWorkers(...))
    remote_workers_lost: int = 0  # Ray workers that died or whose node left (their tiny-batches re-ran)

    def add_stage_times(self, names, worker, ns) -> None:
        """A task's per-stage totals from `worker` (the manager thread, under its lock)."""
        totals = self.stage_ns.setdefault(worker, dict.fromkeys(names, 0))
        for name, v in zip(names, ns):
            totals[name] += v

    def stage_seconds(self, worker=None) -> dict:
        """Seconds per stage summed over samples: of one worker, or of all workers (worker=None)."""
        out: dict = {}
        for w, totals in list(self.stage_ns.items()):
            if worker is None or w == worker:
                for name, v in list(totals.items()):
                    out[name] = out.get(name, 0.0) + v / 1e9
        return out

    def stage_shares(self, worker=None) -> dict:
        """Each stage's share of CPU pipeline time (largest first), e.g. {"decode+crop+resize": 0.48, ...}."""
        from fusionflow.stages import shares
        return shares(self.stage_seconds(worker))

    def summary(self) -> dict:
        w = np.asarray(self.wait_seconds) if self.wait_seconds else np.zeros(1)
        return {"batches": self.batches, "samples": self.samples, "skipped": self.skipped,
                "skipped_by_cause": dict(self.skipped_by_cause),
                "wait_mean_ms": 1e3 * float(w.mean()), "wait_p95_ms": 1e3 * float(np.percentile(w, 95)),
                "tiny_batches_per_worker": list(self.tiny_batches_per_worker),
                "worker_restarts": self.worker_restarts, "startup_seconds": self.startup_seconds,
                "accelerator_tiny_batches": self.accelerator_tiny_batches,
                "accelerator_given_back": self.accelerator_given_back,
                "accelerator_builds": self.accelerator_builds,
                "accelerator_build_seconds": self.accelerator_build_seconds,
                "accelerator_out_of_memory": self.accelerator_out_of_memory,
                "accelerator_retired": self.accelerator_retired,
                "taas_k_last": self.taas_k[-1] if self.taas_k else None,
                "global_manager": self.global_manager, "workers_lent": self.workers_lent,
                "workers_borrowed": self.workers_borrowed, "lent_tiny_batches": self.lent_tiny_batches,
                "borrowed_tiny_batches": self.borrowed_tiny_batches, "memory_bridge": self.memory_bridge,
                "bridge_windows": self.bridge_windows, "bridge_lent_bytes": self.bridge_lent_bytes,
                "bridge_borrowed_bytes": self.bridge_borrowed_bytes,
                "bridge_fallback_bytes": self.bridge_fallback_bytes, "bridge_pinned_bytes": self.bridge_pinned_bytes,
                "bridge_seconds": self.bridge_seconds, "stage_shares": self.stage_shares(),
                "remote_tiny_batches": self.remote_tiny_batches, "remote_workers_lost": self.remote_workers_lost}

    def reset(self) -> None:
        keep = self.startup_seconds, self.memory_bridge
        self.__init__()
        self.startup_seconds, self.memory_bridge = keep


def _check_remote_workers(remote_workers, num_workers: int, persistent_workers: bool) -> None:
    if remote_workers is None:
        return
    from fusionflow.remote_workers import RayWorkers
    if not isinstance(remote_workers, RayWorkers):
        raise TypeError(f"remote_workers={remote_workers!r} must be None or fusionflow.RayWorkers(...) "
                        "(e.g. remote_workers=RayWorkers(8, address='auto'))")
    if num_workers == 0:
        raise ValueError("remote_workers needs num_workers >= 1: remote workers join the local worker processes "
                         "(num_workers=0 runs everything in the training process)")
    if not persistent_workers:
        warnings.warn("remote_workers without persistent_workers=True starts its Ray actors (and sends them the "
                      "dataset) again every epoch; pass persistent_workers=True", stacklevel=3)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


class FusionFlowLoader:
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
        # ---- validation: every message names the value and the fix
        _check_remote_workers(remote_workers, num_workers, persistent_workers)
        self.remote_workers = remote_workers
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn={collate_fn!r} must be callable (or None): it is called with the batch's "
                            "list of (image, target) samples, as DataLoader calls it")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0 (0 runs in this process)")
        cores = _usable_cpus()
        if num_workers > cores:  # as DataLoader does: a warning, not an error (workers then share cores)
            warnings.warn(f"num_workers={num_workers} exceeds the {cores} CPU cores this process may use; "
                          f"FusionFlow runs best with one worker per core: use num_workers<={cores}",
                          UserWarning, stacklevel=2)
        _check_raw_samples(dataset)
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler is mutually exclusive with batch_size, shuffle, sampler and "
                                 "drop_last: leave those at their defaults when you pass a batch_sampler")
            capacity = getattr(batch_sampler, "batch_size", None)
            if not isinstance(capacity, int) or capacity < 1:
                raise ValueError("batch_sampler needs an int attribute batch_size (its largest batch): "
                                 "FusionFlowLoader allocates shared memory for that many samples up front")
        else:
            if batch_size is None or isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 (unbatched loading is not "
                                 "supported)")
            if sampler is not None and shuffle:
                raise ValueError("sampler is mutually exclusive with shuffle=True: shuffle inside your sampler "
                                 "(e.g. DistributedSampler(shuffle=True)) and leave shuffle unset")
            if sampler is None:
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
            capacity = batch_size
        if tiny_batch_size is None:
            tiny_batch_size = min(4, capacity)
        if not isinstance(tiny_batch_size, int) or tiny_batch_size < 1:
            raise ValueError(f"tiny_batch_size={tiny_batch_size!r} must be an integer >= 1")
        if tiny_batch_size > capacity:
            raise ValueError(f"tiny_batch_size={tiny_batch_size} is larger than batch_size={capacity}: "
                             f"use tiny_batch_size <= batch_size (typically 1-8)")
        if prefetch_factor is None:
            prefetch_factor = 2
        elif num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0 (with 0 workers nothing runs ahead)")
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor={prefetch_factor!r} must be an integer >= 1 (mini-batches in flight)")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers=True needs num_workers > 0")
        if timeout < 0:
            raise ValueError(f"timeout={timeout} must be >= 0 (0 waits forever)")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r} must be one of {ON_ERROR}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r} must be an integer >= 0")
        if pin_workers not in (True, False, "auto"):
            raise ValueError(f"pin_workers={pin_workers!r} must be 'auto', True or False")
        self._seed_given = seed is not None
        if seed is None:
            seed = _default_seed(generator)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer (or None: derived from torch's "
                             "initial seed, or from generator's)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here: use device='cpu'")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: FusionFlowLoader delivers to 'cpu' or 'cuda[:N]'")
        if self.device.type == "cuda":  # one device index, resolved now, for every CUDA call after
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            if self.device.index >= torch.cuda.device_count():
                raise ValueError(f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA device(s)")
        self._alloc_device = self.device  # where delivered tensors live (tests: the CPU, under a fake torch.cuda)
        self.policy = load_policy(policy)
        if gpu_sharing not in SHARING:
            raise ValueError(f"gpu_sharing={gpu_sharing!r} must be one of {SHARING}")
        if accelerator == "auto":
            accelerator = "dali-gpu" if self.device.type == "cuda" and gpu_sharing != "off" and _has_dali() else None
        if accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator={accelerator!r} must be one of {ACCELERATORS} ('auto': DALI on the "
                             "GPU when device is CUDA, none otherwise)")
        if accelerator == "dali-gpu" and self.device.type != "cuda":
            raise ValueError(f"accelerator='dali-gpu' needs a CUDA device, got device={device!r}; use "
                             "accelerator='dali-cpu' or None")
        if accelerator is not None and not _has_dali():
            raise ValueError(f"accelerator={accelerator!r} needs NVIDIA DALI: pip install nvidia-dali-cuda130")
        if accelerator is not None and num_workers == 0:
            raise ValueError(f"accelerator={accelerator!r} shares mini-batches with CPU workers: use num_workers >= 1")
        if gpu_sharing == "off":
            accelerator = None
        if memory_bridge not in BRIDGE:
            raise ValueError(f"memory_bridge={memory_bridge!r} must be one of {BRIDGE}")
        if memory_bridge == "on" and accelerator != "dali-gpu":
            raise ValueError(f"memory_bridge='on' lends PyTorch's free GPU blocks to DALI on the GPU, but "
                             f"accelerator={accelerator!r} (device={device!r}, gpu_sharing={gpu_sharing!r}): use "
                             "accelerator='dali-gpu' with a CUDA device, or memory_bridge='auto'/'off'")
        if memory_bridge == "on" and gpu_sharing == "spatial":
            raise ValueError("memory_bridge='on' needs prep to run between training steps, when PyTorch's blocks "
                             "are free, but gpu_sharing='spatial' runs it during them: use gpu_sharing='temporal' "
                             "or 'auto', or memory_bridge='off'")
        if global_manager is not None and not isinstance(global_manager, str):
            raise ValueError(f"global_manager={global_manager!r} must be 'auto', a job name (str) or None")
        if global_manager == "auto":
            from fusionflow.runtime.gm_tables import job_key
            global_manager = job_key()
        elif global_manager is not None and not global_manager:
            raise ValueError("global_manager='' : name the job (any string shared by the loaders that may lend "
                             "workers to each other), or pass None")
        self.job = global_manager if num_workers > 0 else None
        self.accelerator, self.gpu_sharing, self.aot = accelerator, gpu_sharing, aot
        self.taas, self.taas_last_k = taas, taas_last_k
        if memory_bridge == "on" and gpu_sharing == "auto":
            self.gpu_sharing = gpu_sharing = "temporal"  # the bridge only lends between steps: no spatial trial
        self.memory_bridge = memory_bridge
        self._bridge = None
        why_off = ("memory_bridge='off'" if memory_bridge == "off" else
                   "no DALI GPU accelerator" if accelerator != "dali-gpu" else
                   "gpu_sharing='spatial'" if gpu_sharing == "spatial" else None)
        if why_off is None and memory_bridge == "on":
            from fusionflow.memory import native
            native.build_bridge()  # fail now, naming what is missing, rather than at the first batch

        from fusionflow.trace import TraceRecorder, check_path
        self._trace_path = None if trace is None else check_path(trace)
        self._tracer = None if trace is None else TraceRecorder()
        if not isinstance(stage_times, bool):
            raise TypeError(f"stage_times={stage_times!r} must be True or False")
        if stage_times:
            from fusionflow.stages import stage_names
            self._stage_names = stage_names(self.policy)
        else:
            self._stage_names = None
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", sampler)
        self.batch_size, self.drop_last, self.capacity = batch_size, drop_last, capacity
        self.num_workers, self.prefetch_factor, self.timeout = num_workers, prefetch_factor, timeout
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.persistent_workers, self.tiny_batch_size, self.seed = persistent_workers, tiny_batch_size, seed
        self.on_error, self.max_retries, self.pin_workers = on_error, max_retries, pin_workers
        self.collate_fn = collate_fn
        self._collate = None if _is_default_collate(collate_fn) else collate_fn  # None: batches as delivered
        self.pin_memory = pin_memory and self.device.type == "cpu"
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but CUDA is not available: batches are returned unpinned", stacklevel=2)
            self.pin_memory = False
        self.sizes = getattr(dataset, "sizes", None)
        self.stats = LoaderStats()
        self._bridge_why_off = why_off  # None: start the bridge with the accelerator (again after close())
        self.stats.memory_bridge = None if why_off is None else f"off: {why_off}"
        self._epoch, self._epoch_set, self._iterations = 0, False, 0
        self._yielded = None  # batches yielded in the epoch in progress (None: none in progress)
        self._epoch_start = None  # what reproduces that epoch's order (fusionflow/state.py)
        self._resume = None  # (sampler state, batches to skip) for the next iteration, from load_state_dict
        self._serial = 0  # iterations started: only the newest one counts its batches into the state
        self._manager: LocalManager | None = None
        self._active_generation = None
        self._warned_skip = False
        # counters of managers already shut down (a manager lives one epoch without persistent workers)
        self._counts_before = dict.fromkeys(("worker_restarts", "accelerator_tiny_batches",
                                             "accelerator_given_back", "accelerator_builds",
                                             "accelerator_out_of_memory", "workers_lent",
                                             "workers_borrowed", "lent_tiny_batches", "borrowed_tiny_batches",
                                             "worker_count_changes"), 0)
        self._device_ring = None
        self._profiler = None  # gpu_sharing="auto" on a GPU
        # the manager (and the allocator bridge) live in a box the finalizer holds, so it runs at exit or
        # collection without self
        self._box = [None, None]
        self._finalizer = weakref.finalize(self, _shutdown_manager, self._box)

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
        return _plain(batches) if self._collate is None else _collated(batches, self._collate)

    # ---------------------------------------------------------------- checkpointing (fusionflow/state.py)
    def state_dict(self) -> dict:
        """The loader's position, to resume it exactly: small (no pixels), picklable, torch.save-able.

        Taken anywhere -- between epochs, or mid-epoch after k batches were yielded -- and loaded into
        a fresh loader over the same dataset (any num_workers) with `load_state_dict`, the resumed
        loader yields exactly the batches the original would have yielded next -- the rest of the
        epoch, same indices and pixels -- and the same epochs after it. A loader that stopped
        mid-epoch (`break`) resumes that epoch's remaining batches."""
        in_epoch = self._yielded is not None
        ff_state.warn_if_unresumable(self.batch_sampler, self.sampler)
        return {
            "version": ff_state.VERSION,
            "dataset_len": len(self.dataset), "batch_size": self.capacity, "drop_last": self.drop_last,
            "num_batches": len(self), "seed": self.seed,
            "epoch": self._epoch, "epoch_set": self._epoch_set, "iterations": self._iterations,
            "batches_yielded": self._yielded if in_epoch else None,
            "sampler": (self._epoch_start if in_epoch and self._epoch_start is not None
                        else ff_state.capture(self.batch_sampler, self.sampler)),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the next iteration continues where that loader was. The state's
        seed replaces this loader's (the augmentation is a function of it); the loader must be built
        over a dataset of the same length with the same batch_size, drop_last and kind of sampler."""
        if not isinstance(state, dict) or state.get("version") != ff_state.VERSION:
            raise ValueError(f"state={type(state).__name__} is not a FusionFlowLoader.state_dict() of version "
                             f"{ff_state.VERSION}: pass what loader.state_dict() returned")
        mine = {"dataset_len": len(self.dataset), "batch_size": self.capacity, "drop_last": self.drop_last,
                "num_batches": len(self)}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"the state is from a loader with {key}={state.get(key)!r}, this loader has "
                                 f"{key}={value!r}: build the loader as the one that saved the state was built "
                                 "(same dataset length, batch_size, drop_last and sampler)")
        ff_state.check(state["sampler"], self.batch_sampler, self.sampler)
        yielded = state["batches_yielded"]
        if yielded is not None and not (isinstance(yielded, int) and 0 <= yielded <= len(self)):
            raise ValueError(f"state['batches_yielded']={yielded!r} must be an int in [0, {len(self)}]")
        seed = state["seed"]
        if self._seed_given and seed != self.seed:
            warnings.warn(f"seed={self.seed} was given, but the state was saved with seed={seed}: the state's seed "
                          "is used, so the resumed run augments as the saved one did", UserWarning, stacklevel=2)
        if self.seed != seed:
            self.seed = seed
            self._stop_manager()  # running workers hold the old seed
        self._epoch, self._epoch_set, self._iterations = state["epoch"], state["epoch_set"], state["iterations"]
        if yielded is not None:  # the next iteration is the saved epoch itself: no epoch + 1
            self._epoch_set, self._iterations = True, max(0, self._iterations - 1)
        self._resume = (state["sampler"], yielded or 0)
        self._yielded = self._epoch_start = None

    def _yielded_one(self, serial: int, done: bool = False) -> None:
        """Count a batch yielded by iteration `serial` (or, `done`, its epoch's end), if it is the newest."""
        if serial == self._serial and self._yielded is not None:
            self._yielded = None if done else self._yielded + 1

    def _epoch_batches(self, serial: int, copies=None):
        """This epoch's batches of indices; records what reproduces them (or restores it, resuming).
        Batches skipped on resume still pass through `copies` (repeated augmentation's counter), so
        the copies after the resume point get the numbers they would have had."""
        saved, skip = self._resume if self._resume is not None else (None, 0)
        self._resume = None
        batches, snapshot = ff_state.start_epoch(self.batch_sampler, self.sampler, saved, skip, on_skip=copies)
        if serial == self._serial:
            self._epoch_start, self._yielded = snapshot, skip
        return batches

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextlib.contextmanager
    def trace(self, path, max_events: int | None = None):
        """Record a timeline of what runs inside the block and write it to `path` (trace-event JSON,
        fusionflow/trace.py) at its end. Yields the recorder."""
        from fusionflow.trace import DEFAULT_MAX_EVENTS, TraceRecorder, check_path
        path = check_path(path, "path")
        if self._tracer is not None:
            raise ValueError(f"loader.trace({path!r}): this loader already traces (to {self._trace_path!r}); "
                             "one trace at a time")
        recorder = TraceRecorder(DEFAULT_MAX_EVENTS if max_events is None else max_events)
        self._set_tracer(recorder)
        try:
            yield recorder
        finally:
            self._set_tracer(None)
            recorder.write(path)

    def _set_tracer(self, recorder) -> None:
        self._tracer = recorder
        if self._manager is not None:
            self._manager.trace = recorder

    def _flush_trace(self) -> None:
        if self._trace_path is not None and self._tracer is not None:
            self._tracer.write(self._trace_path)

    def close(self) -> None:
        """Stop workers, return lent GPU blocks and release shared memory now (and write the trace, if
        any). The loader can be iterated again after."""
        self._stop_manager()
        self._flush_trace()
        bridge, self._bridge = self._bridge, None
        self._box[1] = None
        if bridge is not None:
            bridge.shutdown()

    # ---------------------------------------------------------------- internals
    def _ensure_manager(self) -> LocalManager:
        if self._manager is None:
            layout = RingLayout(self.prefetch_factor, self.capacity, self.policy.out_shape, self.policy.out_dtype)
            t0 = time.perf_counter()
            ctx = self.multiprocessing_context
            if isinstance(ctx, str):
                import multiprocessing
                ctx = multiprocessing.get_context(ctx)
            self._manager = LocalManager(
                self.dataset, self.policy, layout, self.num_workers, self.seed, self.worker_init_fn, ctx,
                self.pin_workers, self.max_retries, self.sizes, self.tiny_batch_size,
                base_seed=int(torch.empty((), dtype=torch.int64).random_().item()) % 2**31, job=self.job,
                spec=self._lending_spec(), stages=self._stage_names)
            self._manager.trace = self._tracer
            if self._stage_names is not None:  # the stats object, not the loader: the manager must not hold it
                self._manager.on_stage_times = functools.partial(self.stats.add_stage_times, self._stage_names)
            self._box[0] = self._manager
            if self.stats.startup_seconds is None:
                self.stats.startup_seconds = time.perf_counter() - t0
            if self.device.type == "cuda" and not self._manager.register_cuda(self.device.index):
                log.warning("cudaHostRegister of the batch ring failed; host->device copies will be synchronous")
            if self.accelerator is not None:
                self._start_accelerator(self._manager)
            if self.remote_workers is not None:
                self._start_remote(self._manager)
        return self._manager

    def _start_remote(self, mgr: LocalManager) -> None:
        """Ray actors as one more worker kind on the manager (fusionflow/runtime/remote.py); a dataset
        that cannot be pickled or read on a remote node fails here, at start-up."""
        from fusionflow.runtime.remote import RemoteWorkers
        kind = RemoteWorkers(mgr, self.remote_workers, self.dataset, self.policy, self.seed, self.stats,
                             first_worker_id=self.num_workers, worker_init_fn=self.worker_init_fn)
        mgr.add_worker_kind(kind)
        try:
            kind.start()
        except BaseException:
            self._stop_manager()
            raise

    def _lending_spec(self) -> bytes | None:
        """What workers lent to this loader need (pickled once per loader, not per epoch)."""
        if self.job is None:
            return None
        if not hasattr(self, "_spec"):
            from fusionflow.runtime.gm_link import make_spec
            self._spec = make_spec(self.dataset, self.policy, self.worker_init_fn)
        return self._spec

    def _start_accelerator(self, mgr: LocalManager) -> None:
        from fusionflow.runtime.accelerator import AcceleratorWorker
        from fusionflow.scheduling.taas import KSearch

        on_gpu = self.accelerator == "dali-gpu"
        if on_gpu and self._bridge_why_off is None and self._bridge is None:
            self._start_bridge()  # before any DALI pipeline exists, so all of DALI's memory passes through it
        device_ring = None
        if on_gpu:
            from fusionflow.runtime.device_ring import DeviceRing
            device_ring = DeviceRing(mgr.layout, self.device, self._alloc_device)
        sharing = "temporal" if self.gpu_sharing == "auto" else self.gpu_sharing  # auto starts by profiling
        accel = AcceleratorWorker(mgr, self.dataset, self.policy, self.tiny_batch_size, self.seed,
                                  device="gpu" if on_gpu else "cpu",
                                  device_id=self.device.index if on_gpu else None, aot=self.aot,
                                  largest_first=self.taas, device_ring=device_ring, sharing=sharing)
        search = KSearch(k_max=-(-self.capacity // self.tiny_batch_size))
        self.stats.accelerator_build_seconds = accel.build_seconds
        # The callbacks live on the manager: they must not refer to the loader (it would then live as
        # long as its manager, i.e. until close(), and never be collected) nor strongly to the manager.
        if self.taas and self.taas_last_k:
            mgr.on_batch_done = functools.partial(_taas_feedback, weakref.ref(mgr), search, self.stats.taas_k)
        mgr.on_capacity_change = lambda n: search.restart()  # the CPU side's speed changed: search K again
        mgr.accelerator = accel
        accel.bridge = self._bridge
        self._device_ring = device_ring
        if on_gpu and self.gpu_sharing == "auto":
            from fusionflow.runtime.accelerator import SharingProfiler
            self._profiler = SharingProfiler(accel)
        accel.start()

    def _start_bridge(self) -> None:
        from fusionflow.memory.native import BridgeError
        try:
            from fusionflow.memory.bridge import MemoryBridge  # posix_ipc, ctypes, the native build
            self._bridge = MemoryBridge(self.device)
        except Exception as exc:  # not built, not importable, or CUDA/DALI refused the install
            if self.memory_bridge == "on":
                if isinstance(exc, BridgeError):
                    raise
                raise BridgeError(f"memory_bridge='on': the allocator bridge could not start: {exc!r}") from exc
            log.warning("memory_bridge='auto': the allocator bridge is off, DALI keeps its own GPU pool (%s)", exc)
            self._bridge_why_off = str(exc)  # not retried at every epoch
            self.stats.memory_bridge = f"off: {exc}"
            return
        self._box[1] = self._bridge
        self.stats.memory_bridge = "on"

    def _open_window(self, mgr: LocalManager) -> None:
        """Temporal sharing on the GPU: the accelerator may work (and, with the bridge, borrow) from now on."""
        accel = mgr.accelerator
        if self._bridge is not None and (accel is None or accel.bridge is None or accel.sharing != "temporal"):
            self._close_bridge()  # no windows now (spatial, or lending failed): blocks DALI let go go back
        if accel is None or not accel.gated:
            return
        with mgr.cond:
            if accel.bridge is not None:
                accel.bridge.arm(torch.cuda.current_stream(self.device))
            accel.window_open = True
            mgr.cond.notify_all()

    def _close_window(self, mgr: LocalManager) -> None:
        """The mini-batch is ready: let the tiny-batch in flight finish, then PyTorch takes its blocks back."""
        accel = mgr.accelerator
        if accel is None or not accel.window_open:
            return
        with mgr.cond:
            accel.window_open = False
            accel.wait_idle()
        self._close_bridge()

    def _close_bridge(self) -> None:
        if self._bridge is None:
            return
        try:
            self._bridge.close()
        except Exception:  # training goes on; what could not be returned stays lent (stats: bridge_pinned_bytes)
            log.exception("allocator bridge: closing the prep window failed")

    def _stop_manager(self) -> None:
        mgr, self._manager = self._manager, None
        self._box[0] = None
        if mgr is not None:
            self._close_window(mgr)
            self._sync_stats(mgr)
            self._counts_before = {k: getattr(self.stats, k) for k in self._counts_before}
            mgr.shutdown()
            if self._bridge is not None:
                self._close_bridge()  # the DALI pipelines are gone: what they held goes back now
                self._sync_bridge()

    def _deliver(self, images: np.ndarray, labels: np.ndarray):
        """Turn a filled batch (views into the ring or a local buffer) into tensors the caller owns."""
        if self.device.type == "cuda":
            pinned = self._manager is not None and self._manager.cuda_registered  # the ring is page-locked
            with torch.cuda.device(self.device.index):
                stream = torch.cuda.current_stream(self.device)  # the caller's stream on the loader's device
                out = torch.from_numpy(images).to(self._alloc_device, non_blocking=pinned)
                labels_t = torch.from_numpy(labels if pinned else labels.copy()).to(self._alloc_device,
                                                                                       non_blocking=pinned)
                return out, labels_t, self._copied(stream)
        if self.pin_memory:
            src = torch.from_numpy(images)
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            return out, torch.from_numpy(labels.copy()).pin_memory(), None
        return torch.from_numpy(images.copy()), torch.from_numpy(labels.copy()), None

    def _sync_stats(self, mgr: LocalManager) -> None:
        now = {"worker_restarts": mgr.restarts, "workers_lent": mgr.lent_total, "workers_borrowed": mgr.guests_total,
               "lent_tiny_batches": mgr.lent_tasks, "borrowed_tiny_batches": mgr.guest_tasks,
               "worker_count_changes": mgr.capacity_changes}
        if mgr.link is not None:
            self.stats.global_manager = "lost" if mgr.link.gm_lost else "active"
        if mgr.accelerator is not None:
            a = mgr.accelerator
            now.update(accelerator_tiny_batches=a.tiny_batches, accelerator_given_back=a.given_back,
                       accelerator_builds=a.builds, accelerator_out_of_memory=a.out_of_memory)
            if a.retired:
                self.stats.accelerator_retired = a.retired
        for key, base in self._counts_before.items():
            setattr(self.stats, key, base + now.get(key, 0))
        self.stats.tiny_batches_per_worker = list(mgr.tasks_per_worker)
        self._sync_bridge()

    def _sync_bridge(self) -> None:
        if self._bridge is not None:
            for name in ("windows", "lent_bytes", "borrowed_bytes", "fallback_bytes", "pinned_bytes", "seconds"):
                setattr(self.stats, f"bridge_{name}", getattr(self._bridge.stats, name))

    def _copied(self, stream):
        """A blocking event (the host sleeps on it instead of spinning) recorded on `stream` after
        this batch's copies out of the ring: the slot is reused, or the ring unmapped, only after it."""
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        if self._manager is not None:
            self._manager.copy_event = event
        return event

    def _mark_step(self, mgr: LocalManager) -> None:
        """Temporal GPU sharing: the accelerator waits for the training work queued so far."""
        accel = mgr.accelerator
        if self._profiler is not None:
            self._profiler.tick()
            self.stats.gpu_sharing = self._profiler.chosen
        if accel is not None and accel.device_ring is not None and accel.sharing == "temporal":
            with torch.cuda.device(self.device.index):
                event = torch.cuda.Event(blocking=True)
                event.record(torch.cuda.current_stream(self.device))
            accel.step_event = event

    def _deliver_merged(self, mgr: LocalManager, state, keep):
        """CUDA delivery of a mini-batch produced partly on the GPU: the host ring's positions are
        copied over, the accelerator's come from the device ring (slices of consecutive positions:
        no index tensor, so no host-to-device copy of indices)."""
        from fusionflow.runtime.device_ring import accel_runs
        n, slot, pinned = state.size, state.slot, mgr.cuda_registered
        with torch.cuda.device(self.device.index):
            stream = torch.cuda.current_stream(self.device)
            self._device_ring.wait_slot(slot, stream)  # after the accelerator's copies into this slot
            out = torch.from_numpy(mgr.ring.images[slot, :n]).to(self._alloc_device, non_blocking=pinned)
            for start, stop in accel_runs(state.accel_positions):
                out[start:stop] = self._device_ring.images[slot, start:stop]
            host_labels = mgr.ring.labels[slot, :n]
            labels = torch.from_numpy(host_labels if pinned else host_labels.copy()).to(self._alloc_device,
                                                                                        non_blocking=pinned)
            if keep is not None:  # on_error='skip' dropped samples (rare): gather what is kept
                keep_t = torch.as_tensor(keep).to(self._alloc_device)
                out, labels = out[keep_t], labels[keep_t]
            return out, labels, self._copied(stream)

    def _select(self, indices, failures):
        """Positions to deliver, after applying on_error to this batch's failures."""
        if not failures:
            return None
        failures = sorted(failures, key=lambda f: f.position)
        if self.on_error == "raise":
            f = failures[0]
            raise SampleError(f.index, f.what, f.exc_type, f.message, f.traceback)
        bad = {f.position for f in failures}
        self.stats.skipped += len(bad)
        self.stats.skipped_indices.extend(f.index for f in failures)
        for f in failures:
            cause = SKIP_CAUSES.get(f.exc_type, "error")
            self.stats.skipped_by_cause[cause] = self.stats.skipped_by_cause.get(cause, 0) + 1
        if not self._warned_skip:
            self._warned_skip = True
            f = failures[0]
            warnings.warn(f"on_error='skip': dropping {f.what} ({f.exc_type}: {f.message}); further skips are "
                          f"counted in loader.stats.skipped without another warning", stacklevel=3)
        return [p for p in range(len(indices)) if p not in bad]

    def _account(self, wait: float, n: int) -> None:
        self.stats.batches += 1
        self.stats.samples += n
        self.stats.wait_seconds.append(wait)

    def _copies(self) -> Copies:
        """A fresh copy counter for an epoch, on this loader's rank (repeated augmentation)."""
        rank, world = getattr(self.sampler, "rank", None), getattr(self.sampler, "num_replicas", None)
        if not (isinstance(rank, int) and isinstance(world, int)):
            dist = torch.distributed
            rank, world = ((dist.get_rank(), dist.get_world_size())
                           if dist.is_available() and dist.is_initialized() else (0, 1))
        return Copies(rank, world)

    def _iter_inline(self, epoch: int, serial: int):
        pipe = CpuPipeline(self.policy)
        buf = np.empty((self.capacity, *self.policy.out_shape), self.policy.out_dtype)
        labels = np.empty(self.capacity, np.int64)
        copies = self._copies()
        clock = None
        if self._stage_names is not None:
            from fusionflow.stages import StageClock
            clock = StageClock(self._stage_names)
        for seq, indices in enumerate(self._epoch_batches(serial, copies)):
            t0 = time.perf_counter()
            self._check_batch(indices)
            failures, side = [], {}  # side: targets that are not ints (runtime/targets.py)
            for pos, (index, copy) in enumerate(zip(indices, copies(indices))):
                try:
                    if clock is not None:
                        clock.start()
                    sample, target = split_item(self.dataset[index], index)
                    if clock is not None:
                        clock("read")
                    pipe(sample, index, self.seed, epoch, out=buf[pos], what=describe(self.dataset, index), tick=clock,
                         copy=copy)
                    ff_targets.store(labels, pos, target, side)
                except Exception as exc:
                    failures.append(SampleFailure(pos, index, describe(self.dataset, index), type(exc).__name__,
                                                  str(exc), traceback.format_exc()))
            keep = self._select(indices, failures)
            n = len(indices)
            imgs, labs = (buf[:n], labels[:n]) if keep is None else (buf[keep], labels[keep])
            objs = ff_targets.gather(labels, range(n) if keep is None else keep, side) if side else None
            wait = time.perf_counter() - t0
            self._account(wait, len(imgs))
            if clock is not None:
                self.stats.add_stage_times(self._stage_names, "inline", clock.take())
            if self._tracer is not None:
                self._trace_wait(wait, seq, len(imgs))
            images_t, labels_t, _ = self._deliver(imgs, labs)
            if objs is not None:
                labels_t = self._collate_targets(objs)
            self._yielded_one(serial)
            yield images_t, labels_t, objs
        self._yielded_one(serial, done=True)  # the epoch is complete
        self._flush_trace()

    def _trace_wait(self, wait: float, seq: int, samples: int) -> None:
        """The wait just measured, ending now; its span lasts exactly `wait` (as in stats.wait_seconds)."""
        end = time.monotonic_ns()
        self._tracer.wait(end - round(wait * 1e9), end, seq, samples)

    def _collate_targets(self, objs: list):
        """Targets that are not all ints, as DataLoader delivers them: default_collate, then to the device."""
        from torch.utils.data import default_collate
        collated = default_collate(tuple(objs))  # DataLoader collates a column of zip(*batch): a tuple
        # (so strings arrive as a tuple of str, exactly as DataLoader delivers a (sample, str) dataset's)
        if self.device.type == "cuda":
            return _map_tensors(collated, lambda t: t.to(self._alloc_device))
        if self.pin_memory:
            return _map_tensors(collated, lambda t: t.pin_memory())
        return collated

    def _check_batch(self, indices) -> None:
        if len(indices) > self.capacity:
            raise ValueError(f"the batch sampler yielded a batch of {len(indices)} samples, more than its "
                             f"batch_size={self.capacity}")

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
                n = state.size
                keep = self._select(range(n), state.failures)
                imgs = mgr.ring.images[state.slot]
                labs = mgr.ring.labels[state.slot]
                objs = (ff_targets.gather(labs, range(n) if keep is None else keep, state.targets)
                        if state.targets else None)  # targets that are not all ints: collated as DataLoader does
                imgs, labs = (imgs[:n], labs[:n]) if keep is None else (imgs[keep], labs[keep])
                if self._device_ring is not None and state.accel_positions:
                    images_t, labels_t, event = self._deliver_merged(mgr, state, keep)
                else:
                    images_t, labels_t, event = self._deliver(imgs, labs)
                if objs is not None:
                    labels_t = self._collate_targets(objs)
                self._account(wait, len(images_t))
                if self._tracer is not None:
                    self._trace_wait(wait, delivered, len(images_t))
                self._sync_stats(mgr)
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
            if self._manager is mgr:
                if not finished:
                    mgr.abandon(gen)
                if self._active_generation == gen:
                    self._active_generation = None
                if not self.persistent_workers:
                    self._stop_manager()
            self._flush_trace()


def _plain(batches):
    """(images, targets) of the inner iteration's (images, targets, per-sample targets or None)."""
    try:
        for images, labels, _ in batches:
            yield images, labels
    finally:
        batches.close()  # a break or an exception in the training loop ends the inner iteration now


def _collated(batches, collate_fn):
    """DataLoader's collate_fn contract on delivered batches: `collate_fn` gets the batch as a list of
    (image, target) samples -- images are views of the delivered batch tensor (on the loader's device),
    targets as the dataset gave them (Python ints on the fast path) -- and what it returns is what the
    iteration yields. It runs here, in the training process, after the batch is on its device."""
    try:
        for images, labels, objs in batches:
            yield collate_fn(list(zip(images.unbind(0), labels.tolist() if objs is None else objs)))
    finally:
        batches.close()  # a break or an exception in the training loop ends the inner iteration now


def _map_tensors(obj, fn):
    """`fn` applied to every tensor in a collated structure (dicts, lists, tuples, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _map_tensors(v, fn) for k, v in obj.items()}
        try:
            return out if type(obj) is dict else type(obj)(out)
        except TypeError:  # a mapping that cannot be built from a dict: as default_collate does
            return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _is_default_collate(collate_fn) -> bool:
    """None and torch's default_collate: the batch is already collated in place, nothing to do."""
    from torch.utils.data import default_collate
    return collate_fn is None or collate_fn is default_collate


def _default_seed(generator) -> int:
    """seed=None: derived as DataLoader derives its base seed -- from `generator` if given, else from
    torch's initial seed -- but once per loader (augmentation is a function of (seed, epoch, index), so
    it must not change between epochs). torch's initial seed differs between launches unless the
    script calls torch.manual_seed, so two launches do not repeat the same augmentation, and a seeded
    script stays reproducible. Nothing is drawn from torch's RNG, so the caller's random stream is unchanged."""
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator={generator!r} must be a torch.Generator or None")
        return generator.initial_seed() % 2**63
    return torch.initial_seed() % 2**63


def _check_raw_samples(dataset) -> None:
    """FusionFlow augments raw images itself; a dataset that already transforms (float tensors or
    arrays) would be augmented twice or fail at the first batch, so say so now."""
    try:
        if len(dataset) == 0:
            return
        item = dataset[0]
    except Exception:  # a dataset whose first sample fails is reported, with its index, at the first batch
        log.debug("dataset[0] could not be read at construction; not checked", exc_info=True)
        return
    sample = item[0] if isinstance(item, (tuple, list)) and item else item
    dtype = getattr(sample, "dtype", None)
    floating = (sample.is_floating_point() if isinstance(sample, torch.Tensor)
                else isinstance(sample, np.ndarray) and np.issubdtype(dtype, np.floating))
    if floating:
        raise ValueError(f"dataset[0] returns an already-transformed {type(sample).__name__} of dtype {dtype} "
                         f"(shape {tuple(sample.shape)}): FusionFlow decodes and augments the samples itself; "
                         "give FusionFlow the raw images (fusionflow.ImageFolder) and a policy")


def _taas_feedback(mgr_ref, search, history, state) -> None:
    """The manager's on_batch_done (under its lock, once per completed mini-batch): TAAS's K search."""
    mgr = mgr_ref()
    if mgr is None or (mgr.accelerator is not None and mgr.accelerator.retired):
        return
    cpu_last = state.cpu_done_at >= state.accel_done_at
    mgr.reserved = search.observe(cpu_last, time.monotonic() - state.submitted_at)
    history.append(mgr.reserved)


def _shutdown_manager(box) -> None:
    mgr, bridge = box
    box[0] = box[1] = None
    if mgr is not None:
        mgr.shutdown()
    if bridge is not None:
        bridge.shutdown()
