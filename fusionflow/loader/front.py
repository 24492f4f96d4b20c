"""FusionFlowLoader: the DataLoader-compatible front. It holds its configuration (`loader.config`, a frozen
LoaderConfig; the DataLoader attributes are read from it) and its parts (`loader.parts`, fusionflow/loader/parts.py:
checkpoint, delivery, tracing, the GPU session, the runtime, the next-epoch speculation), which own the rest.
`iter(loader)` returns a per-epoch iterator (fusionflow/loader/epoch.py) that owns the epoch's state. The argument
reference is FusionFlowLoader's docstring."""

from __future__ import annotations

import os
import warnings

from torch.utils.data import Sampler

from fusionflow.accel.config import DaliAccelerator
from fusionflow.loader.checkpoint import policy_digest, warn_if_other_policy
from fusionflow.loader.config import resolve_config
from fusionflow.loader.dataset import AdoptedTransform, adopt_folder
from fusionflow.loader.delivery import warn_if_unsharded
from fusionflow.loader.epoch import InlineIterator, WorkerIterator
from fusionflow.loader.parts import LoaderParts
from fusionflow.loader.pickling import reduce_loader
from fusionflow.loader.stats import LoaderStats  # noqa: F401 (re-exported, as the loader module always did)
from fusionflow.runtime.host import Host

__all__ = ["FusionFlowLoader", "LoaderStats"]


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def _configured(name: str, doc: str) -> property:
    """A read-only attribute of the loader that is a field of its configuration."""
    return property(lambda self: getattr(self.config, name), doc=doc)


class FusionFlowLoader:
    """A drop-in `torch.utils.data.DataLoader` whose batches are augmented by CPU worker processes writing straight
    into shared memory, tiny-batch by tiny-batch (and, optionally, by DALI on the GPU and by Ray actors on other nodes).

        loader = FusionFlowLoader(ds, batch_size=256, shuffle=True, num_workers=8,
                                  policy="configs/randaugment.yaml", tiny_batch_size=4, seed=0)
        for epoch in range(E):
            loader.set_epoch(epoch)
            for images, labels in loader:   # uint8 [B, 3, H, W] (float32 if the policy normalises), int64 [B]
                ...

    Beyond DataLoader's arguments: `policy` (a shipped name, a YAML path or a dict; None: "default",
    the training crop + flip, with a log line once per process), `tiny_batch_size`
    (default min(4, batch_size)), `seed`, `device` ("cpu" or "cuda[:N]": batches are delivered there),
    `on_error` ("raise" or "skip"), `max_retries` (worker deaths a sample may cause), `pin_workers`
    ("auto": pin each worker to a core only when all local ranks' workers and their training processes get a core
    each; True/False force it), and the accelerator: `accelerator` (None -- CPU workers only, the default until the
    GPU path has been proven on a GPU -- or `fusionflow.DaliAccelerator(...)`, which configures DALI in one checked
    object: DALI takes each mini-batch's largest tiny-batches while the CPU workers take the smallest).
    `DaliAccelerator(device="gpu", sharing="auto", memory_bridge="auto", aot=True, taas=True,
    taas_last_k=True)` (fusionflow/accel/config.py): `device` "gpu" (the loader's device must be CUDA),
    "cpu" (DALI's CPU backend) or "auto" (the GPU when device is CUDA and DALI is installed, else no
    accelerator); `sharing` ("auto", "temporal", "spatial", "off") how DALI shares the GPU with training;
    the ablations `aot`, `taas`, `taas_last_k`. `memory_bridge` ("auto", "on", "off"): DALI's GPU memory
    is one arena carved out of PyTorch's caching allocator once, not a pool DALI grows beside it
    (fusionflow/accel/bridge/memory_bridge.py); "auto" turns it on when the accelerator is DALI on the GPU
    and the native part builds, "on" makes that a requirement (an error says what is missing).
    The string forms are still accepted and resolve to the same `loader.config`: `accelerator="dali-gpu"`,
    "dali-cpu" or "auto" with the loose arguments `gpu_sharing`, `memory_bridge`, `aot`, `taas`,
    `taas_last_k`; a loose one set beside a DaliAccelerator is refused (set it on the object).
    `loader.accelerator`, `loader.gpu_sharing`, ... hold the resolved values either way.
    `trace` (a file path, or None): write a Chrome/Perfetto timeline of the run there -- every tiny-batch on
    its worker's track, the training loop's waits at next() -- at close() and at the end of each iteration;
    `loader.trace(path)` does the same for a `with` block (fusionflow/loader/trace.py). `stage_times=True`: CPU
    workers time each stage of each sample (read, decode+crop+resize, flip, each op, write), summed per
    worker in `loader.stats.stage_seconds()` / `stage_shares()` (fusionflow/ops/stages.py). Both are off by default.
    `global_manager` ("auto": under torchrun with several local ranks, the ranks' loaders lend idle CPU
    workers to each other through one global manager per node; a string: join that named job, e.g.
    train and validation loaders of one process; None: no lending) -- see runtime/gm/manager.py.

    `collate_fn`: DataLoader's contract. None or `torch.utils.data.default_collate` cost nothing (the batch
    is already collated in place). Any other callable is called with the batch as a list of (image, target)
    samples -- images are views of the delivered batch tensor, on the loader's `device`; targets as the
    dataset returned them -- in the training process, after the batch is on its device, and the iteration
    yields what it returns: torchvision's `collate_fn=lambda b: mixup_cutmix(*default_collate(b))` works unchanged
    (and runs on the GPU when device is CUDA).

    `seed`: None (the default) takes the base seed the first epoch draws where DataLoader's iterator draws its own
    (from `generator` if given, else from torch's generator; no extra draw, so a shuffle's order stays DataLoader's):
    different at every launch and for every loader, reproducible where the script calls `torch.manual_seed` before
    its first epoch; kept for the loader's later epochs. Pass an int to fix it (e.g. to resume a run with the same
    augmentation); `loader.seed` holds the one in use (None before the first epoch starts).

    The arguments are resolved once, at construction, into `loader.config`, a frozen LoaderConfig (fusionflow/loader/
    config.py: every default chosen, every value checked; nothing is started or built until the first iteration).

    `cache` (None): a decoded-image cache for the node -- a byte budget ("64GB", an int) or a
    fusionflow.DecodedCache(size, max_side=320, path=None, admission="score", fill_share="auto"): every
    sample is decoded once, kept at a short side of at most max_side in memory every loader over the same
    dataset on the node shares, and later epochs crop from it (fast mode only; fusionflow/cache/,
    docs/cache.md). Filling uses the workers' spare time, paced while training waits for the loader.
    `loader.stats.cache` counts its hits, misses, bytes and the decode time saved.

    `num_workers` above the usable CPU cores warns (as DataLoader does) and runs; the workers then share cores.
    `sample_keys` ((image key, target key), or (image key,) for no targets): the dataset's samples are
    dicts -- WebDataset/`wids` samples (`("jpg", "cls")`, dotted keys match too), Hugging Face datasets
    with `Image(decode=False)` (`("image", "label")`) -- see fusionflow.datasets.wrappers.DictSamples. The dataset must
    be map-style (random access: augmentation is a function of the sample index); for tar shards use
    fusionflow.TarShards. `read_ahead` (None): for slow storage, the number of reads each CPU worker runs
    at once, ahead of the sample it augments (fusionflow.datasets.wrappers.ReadAhead; e.g. 4 on a network filesystem).
    A dataset must give raw samples (encoded bytes, PIL images or uint8 arrays): one whose dataset[0] is a
    float tensor/array (already transformed) is refused: at construction with num_workers=0, at its first read
    in a worker otherwise (the loader reads no sample in this process then, so a dataset that opens its file at
    its first read opens it in each worker, as with DataLoader). Items are (sample, target), or
    (sample, target, more, ...), or a bare sample, batched as default_collate batches them: [images, targets],
    [images, targets, mores, ...], or the images alone (runtime/targets.py batch_of).

    Targets: any type `default_collate` handles, delivered as DataLoader delivers them (floats as float64,
    tensors stacked, strings as a tuple of str, dicts per key). Python int targets travel as int64 in shared memory;
    any other target is pickled with its tiny-batch's completion (targets only, never pixels) and collated
    in the training process -- see runtime/targets.py.

    Checkpointing: `state_dict()` anywhere in an epoch, `load_state_dict(state)` on a fresh loader (any
    num_workers) resumes with the identical remaining batches and epochs -- see fusionflow/loader/checkpoint.py.

    Augmentation is a pure function of (seed, epoch, sample index). `set_epoch` sets the epoch (and
    forwards it to a DistributedSampler); an iteration that was not preceded by `set_epoch` uses the
    previous epoch + 1, so forgetting it never repeats last epoch's augmentation.

    DDP: the sampler deals each rank its share (a DistributedSampler, as with DataLoader). Iterating with one of
    torch's stock samplers under DDP, where each rank would read the whole set, warns: PyTorch Lightning and
    Accelerate put a DistributedSampler into torch DataLoaders only, never into this loader.

    Repeated augmentation: a sampler that yields an index several times in an epoch (timm's/DeiT's and
    torchvision's RASampler) gets a different augmentation for every copy. Each sample carries a copy
    number, `occurrence * world_size + rank` (fusionflow.scheduling.tiny_batches.Copies), into the draw
    (seed, epoch, index, copy), wherever its tiny-batch runs. rank/world_size are the sampler's
    `rank`/`num_replicas` (DistributedSampler, RASampler), else torch.distributed's, else 0/1: RASampler
    deals an index's copies to different ranks, so the rank must be part of the key for them to differ.
    Copy 0 (a single process's first occurrences, rank 0's in DDP) keeps the draw (seed, epoch, index).
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | None = None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        policy=None,
        tiny_batch_size: int | None = None,
        seed: int | None = None,
        device="cpu",
        on_error: str = "raise",
        max_retries: int = 2,
        pin_workers: bool | str = "auto",
        accelerator: str | DaliAccelerator | None = None,
        gpu_sharing: str = "auto",
        aot: bool = True,
        taas: bool = True,
        taas_last_k: bool = True,
        global_manager: str | None = "auto",
        memory_bridge: str = "auto",
        trace=None,
        stage_times: bool = False,
        remote_workers=None,
        sample_keys=None,
        read_ahead=None,
        cache=None,
    ):
        self._arguments = {k: v for k, v in locals().items() if k != "self"}  # what a pickled loader is rebuilt from
        # ---- resolution and validation (fusionflow/loader/config.py): every message names the value and the fix
        notes: list = []  # warnings for the caller, given even when a later argument is refused
        given, (dataset, policy) = dataset, adopt_folder(dataset, policy)  # torchvision's ImageFolder + transform
        self._adopted = AdoptedTransform(given, policy) if dataset is not given else None  # (watched at iter())
        try:
            cfg = resolve_config(
                dataset,
                batch_size=batch_size,
                shuffle=shuffle,
                sampler=sampler,
                batch_sampler=batch_sampler,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=drop_last,
                timeout=timeout,
                worker_init_fn=worker_init_fn,
                multiprocessing_context=multiprocessing_context,
                generator=generator,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                pin_memory_device=pin_memory_device,
                in_order=in_order,
                policy=policy,
                tiny_batch_size=tiny_batch_size,
                seed=seed,
                device=device,
                on_error=on_error,
                max_retries=max_retries,
                pin_workers=pin_workers,
                accelerator=accelerator,
                gpu_sharing=gpu_sharing,
                aot=aot,
                taas=taas,
                taas_last_k=taas_last_k,
                global_manager=global_manager,
                memory_bridge=memory_bridge,
                trace=trace,
                stage_times=stage_times,
                remote_workers=remote_workers,
                sample_keys=sample_keys,
                read_ahead=read_ahead,
                cache=cache,
                host=Host(cores=lambda: _usable_cpus()),
                notes=notes,
            )
        finally:
            for note in notes:
                warnings.warn(note, UserWarning, stacklevel=2)
        self.config = cfg  # as resolved at construction (load_state_dict may replace the seed)
        self.dataset = given  # as DataLoader keeps it (the samples read are `dataset`'s)
        self.parts = LoaderParts.build(cfg, dataset)  # what the loader is made of (fusionflow/loader/parts.py)
        self.stats = self.parts.stats

    # ---------------------------------------------------------------- configuration, as DataLoader names it
    batch_size = _configured("batch_size", "As given (1 by default); None with a batch_sampler, as DataLoader's.")
    drop_last = _configured("drop_last", "Whether the last incomplete batch is dropped.")
    sampler = _configured("sampler", "What the batch sampler draws indices from.")
    batch_sampler = _configured("batch_sampler", "The batch sampler in use (the caller's, or built).")
    num_workers = _configured("num_workers", "CPU worker processes (0: batches are made in this process).")
    prefetch_factor = _configured("prefetch_factor", "Mini-batches in flight (ring slots).")
    persistent_workers = _configured("persistent_workers", "Whether workers outlive an epoch.")
    timeout = _configured("timeout", "Seconds a batch may take (0: no limit).")
    worker_init_fn = _configured("worker_init_fn", "Called in each worker process at its start.")
    multiprocessing_context = _configured("multiprocessing_context", "How worker processes start.")

    @property
    def collate_fn(self):
        """As given, or DataLoader's default_collate for None (either way, batches are delivered as collated)."""
        from torch.utils.data import default_collate

        given = self.config.collate_fn
        return default_collate if given is None else given

    pin_memory = _configured("pin_memory", "Whether CPU batches are delivered in page-locked memory.")
    pin_memory_device = _configured("pin_memory_device", "As given (deprecated in DataLoader: ignored).")
    in_order = _configured("in_order", "As given; batches come in the sampler's order either way.")
    generator = _configured("generator", "As given: the sampler's and each iteration's base-seed draws take from it.")
    # ---------------------------------------------------------------- FusionFlow's own
    policy = _configured("policy", "The frozen augmentation Policy.")
    tiny_batch_size = _configured("tiny_batch_size", "Samples per tiny-batch.")
    capacity = _configured("capacity", "The largest mini-batch (shared memory is sized for it).")

    @property
    def seed(self) -> int | None:
        """The augmentation seed in use: as given, or loaded with load_state_dict, or (seed=None) drawn as the first
        epoch starts (None until then)."""
        return self.config.seed if self.config.seed is not None else self.parts.checkpoint.seed

    device = _configured("device", "Where batches are delivered (torch.device).")
    on_error = _configured("on_error", "'raise' or 'skip': what a sample that fails does.")
    max_retries = _configured("max_retries", "Worker deaths a sample may cause before its batch fails.")
    pin_workers = _configured("pin_workers", "Whether workers are pinned to cores ('auto' resolved).")
    accelerator = _configured("accelerator", "None, 'dali-cpu' or 'dali-gpu' ('auto', a DaliAccelerator resolved).")
    gpu_sharing = _configured("gpu_sharing", "'auto', 'temporal', 'spatial' or 'off'.")
    aot = _configured("aot", "One prebuilt DALI pipeline per policy (ahead of time).")
    taas = _configured("taas", "The accelerator takes the largest tiny-batches.")
    taas_last_k = _configured("taas_last_k", "The last K tiny-batches of a mini-batch are reserved for it.")
    memory_bridge = _configured("memory_bridge", "'auto', 'on' or 'off', as given.")
    job = _configured("job", "The global manager's job name, or None (no worker lending).")
    remote_workers = _configured("remote_workers", "A fusionflow.RayWorkers, or None.")

    # ---------------------------------------------------------------- DataLoader surface
    def __reduce__(self):
        """Pickled and copied as its class and arguments: a new loader of them (fusionflow/loader/pickling.py)."""
        return reduce_loader(self, FusionFlowLoader, self._arguments)

    def __len__(self) -> int:
        return len(self.config.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Set the augmentation epoch and forward it to the sampler (e.g. DistributedSampler), and to the batch sampler
        where it has a set_epoch of its own."""
        self.parts.checkpoint.set_epoch(epoch, self.config.sampler, self.config.batch_sampler)
        self.parts.next_epoch.on_set_epoch(epoch)

    def __iter__(self):
        """A new epoch: its iterator (it starts the workers, if they are not running, at its first next())."""
        # under DDP without a DistributedSampler each rank reads the whole set: said once per line that iterates
        warn_if_unsharded(self.config.sampler, self.config.batch_sampler, stacklevel=2)
        if self._adopted is not None:  # a torchvision folder's transform, read as the policy at construction
            self._adopted.check()
        epoch, progress = self.parts.checkpoint.begin()
        kind = InlineIterator if self.config.num_workers == 0 else WorkerIterator
        return kind(self.parts, self.config, epoch, progress)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop workers, return lent GPU blocks and release shared memory now (and write the trace, if
        any). The loader can be iterated again after."""
        self.parts.next_epoch.discard()
        self.parts.runtime.close()
        self.parts.tracing.flush()

    # ---------------------------------------------------------------- checkpointing (fusionflow/loader/checkpoint.py)
    def state_dict(self) -> dict:
        """The loader's position, to resume it exactly: small (no pixels), picklable, torch.save-able.

        Taken anywhere -- between epochs, or mid-epoch after k batches were yielded -- and loaded into
        a fresh loader over the same dataset (any num_workers) with `load_state_dict`, the resumed
        loader yields the rest of the epoch the state was taken in -- same indices and pixels -- and
        the same epochs after it. A state taken after a `break` (the epoch's iterator closed) resumes into the next
        epoch, as the original loader, iterated again, starts it (as DataLoader does; until 2026-12-01 it resumed the
        left epoch's remaining batches); after `set_epoch`, that epoch from its first batch, as the loader will."""
        cfg = self.config
        # (an epoch's start draws its base seed before the sampler draws: runtime/spec.py base_seed)
        state = self.parts.checkpoint.state_dict(
            self._shape(), self.seed, cfg.batch_sampler, cfg.sampler, cfg.generator
        )
        return {**state, "policy": policy_digest(cfg.policy)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the next iteration continues where that loader was. The state's
        seed replaces this loader's (the augmentation is a function of it); the loader must be built
        over a dataset of the same length with the same batch_size, drop_last and kind of sampler."""
        cfg = self.config
        self.parts.checkpoint.load_state_dict(state, self._shape(), cfg.batch_sampler, cfg.sampler)
        warn_if_other_policy(state, cfg.policy)
        self.parts.next_epoch.discard()
        seed = state["seed"]
        if seed is None:  # saved before any epoch started: none drawn yet (this loader draws its own anew)
            if not cfg.seed_given and self.seed is not None:  # drawn, or loaded from another state
                self.parts.runtime.stop()  # running workers hold that seed
                self.parts.checkpoint.forget_seed()
                self.config = cfg.with_config(seed=None)
            return
        if cfg.seed_given and seed != cfg.seed:
            warnings.warn(
                f"seed={cfg.seed} was given, but the state was saved with seed={seed}: the state's seed "
                "is used, so the resumed run augments as the saved one did",
                UserWarning,
                stacklevel=2,
            )
        if self.seed != seed:
            self.parts.runtime.stop()  # running workers hold the old seed
        if cfg.seed != seed:
            self.config = cfg.with_config(seed=seed)

    def _shape(self) -> dict:
        """What a state is checked against: a state fits only a loader of the same shape."""
        cfg = self.config
        return {
            "dataset_len": len(self.dataset),
            "batch_size": cfg.capacity if cfg.batch_size is None else cfg.batch_size,  # (capacity: at most the set)
            "drop_last": cfg.drop_last,
            "num_batches": _length(self),  # None: a batch sampler (or its sampler) without len()
        }

    # ---------------------------------------------------------------- tracing (fusionflow/loader/trace.py)
    def trace(self, path, max_events: int | None = None):
        """Record a timeline of what runs inside a `with` block and write it to `path` (trace-event
        JSON, fusionflow/loader/trace.py) at its end. Yields the recorder."""
        return self.parts.tracing.block(path, max_events)

    # ---------------------------------------------------------------- for tests and tools
    @property
    def _manager(self):
        """The running LocalManager, or None."""
        return self.parts.runtime.manager

    @property
    def _collate(self):
        """None when batches are delivered as they are (no collate_fn, or default_collate)."""
        return self.config.collate


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
