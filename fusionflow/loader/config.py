"""FusionFlowLoader's arguments, resolved once into a frozen `LoaderConfig`.

Each `resolve_*` function takes the arguments it needs (and, where a default depends on the machine,
a `Host`) and returns resolved values or raises the ValueError/TypeError that names the value and
the fix; those that ask the machine (device, accelerator, memory bridge, job, remote workers) are in
fusionflow/loader/host.py. Nothing here starts a process, allocates shared memory or builds
native code: that happens at the first iteration (the allocator bridge's native part included).
`resolve_config` applies them in the order the loader always validated its arguments, so the first
wrong argument is the one reported. tests/test_loader_config.py drives it with a table of argument combinations."""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import numbers
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from fusionflow.accel.config import RUN_SAMPLES, RUNS_IN_FLIGHT_CPU, loose_defaults
from fusionflow.cache.config import resolve_cache
from fusionflow.loader.batch_capacity import batch_capacity, ring_rows
from fusionflow.loader.dataset import resolve_samples
from fusionflow.loader.host import check_remote_workers, resolve_dali, resolve_job
from fusionflow.policy import load_policy
from fusionflow.runtime.cores import local_ranks, rank_cores
from fusionflow.runtime.host import Host, resolve_device, resolve_pin_memory

log = logging.getLogger("fusionflow.loader")  # its messages keep the loader's logger name, as before the move
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class LoaderConfig:
    """FusionFlowLoader's arguments after resolution: every default chosen, every value checked."""

    batch_sampler: Any  # the caller's, or BatchSampler(sampler, batch_size, drop_last)
    sampler: Any  # what the batch sampler draws from (set_epoch and checkpoints reach it)
    batch_size: int | None  # as given (1 by default); None with a batch_sampler, as DataLoader's
    drop_last: bool
    capacity: int  # the largest mini-batch: shared memory is allocated for this many samples
    tiny_batch_size: int
    num_workers: int
    prefetch_factor: int  # mini-batches in flight
    persistent_workers: bool
    timeout: float
    on_error: str
    max_retries: int
    pin_workers: bool | str
    seed: int | None  # None: the first epoch's base seed, once drawn (loader/checkpoint.py `Checkpoint.settled`)
    seed_given: bool  # False: derived
    device: torch.device  # "cpu", or "cuda" with its index resolved
    policy: Any  # the frozen Policy
    accelerator: str | None  # None, "dali-cpu" or "dali-gpu" ("auto" and a DaliAccelerator resolved)
    gpu_sharing: str  # "auto", "temporal", "spatial" or "off"
    aot: bool
    taas: bool
    taas_last_k: bool
    memory_bridge: str  # as given (or a DaliAccelerator's): "auto", "on" or "off"
    bridge_why_off: str | None  # None: lend DALI an arena of PyTorch's memory (if the bridge starts)
    job: str | None  # the global manager's job name; None: no lending
    collate_fn: Any  # as given
    collate: Any  # None: batches as delivered (None or default_collate); else the callable
    pin_memory: bool
    trace_path: str | None
    stage_names: tuple | None  # stage_times=True: the policy's stages
    worker_init_fn: Any
    multiprocessing_context: Any
    remote_workers: Any = None  # a fusionflow.RayWorkers, or None
    generator: Any = None  # as given: each iteration's base-seed draw takes from it, as DataLoader's does
    sample_keys: tuple | None = None  # (image key[, target key]) for dict samples (datasets/wrappers.py DictSamples)
    dali_threads: int = 1  # DALI's CPU threads (DaliAccelerator(threads=...))
    dali_run_samples: int = RUN_SAMPLES  # the most samples in one DALI run (DaliAccelerator(run_samples=...))
    dali_runs_in_flight: int = RUNS_IN_FLIGHT_CPU  # DALI runs in flight at most (DaliAccelerator(runs_in_flight=...))
    dali_hw_decoder_load: float | None = None  # DaliAccelerator(hw_decoder_load=...)
    read_ahead: int | None = None  # reads each CPU worker runs ahead (datasets/wrappers.py ReadAhead), or None
    cache: Any = None  # a fusionflow.DecodedCache (cache= resolved), or None
    pin_memory_device: str = ""  # as given: DataLoader's, deprecated there and ignored here
    in_order: bool = True  # as given: batches are delivered in order either way

    def with_config(self, **changes) -> LoaderConfig:
        """A copy with `changes` (field=value): a loader's resumed seed, a SharedLoader's ring depth.
        The configuration itself never changes; whoever needs another one derives it."""
        return dataclasses.replace(self, **changes)


def resolve_collate(collate_fn):
    """None when the batch is delivered as is (None or torch's default_collate: it is already collated
    in place), else the callable."""
    from torch.utils.data import default_collate

    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(
            f"collate_fn={collate_fn!r} must be callable (or None): it is called with the batch's "
            "list of (image, target) samples, as DataLoader calls it"
        )
    return None if collate_fn is None or collate_fn is default_collate else collate_fn


def resolve_num_workers(num_workers, cores: int, notes: list, context=None) -> int:
    """num_workers checked (a count above the cores a note), and `context`, how they start (check_context)."""
    check_context(context)
    if not _is_int(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0 (0 runs in this process)")
    num_workers = int(num_workers)  # numpy's integers too, as DataLoader takes them
    if context is not None and num_workers == 0:  # as DataLoader refuses it
        raise ValueError(
            f"multiprocessing_context={context!r} starts worker processes, but num_workers=0 loads in this process: "
            "pass num_workers > 0, or leave multiprocessing_context unset"
        )
    # under torchrun, this rank's part of the node's cores (the other ranks have workers), unless the launcher
    # already bound this process to fewer cores than the node has (then `cores` is its part)
    share = rank_cores(cores) if cores >= (os.cpu_count() or cores) else cores
    if num_workers > share:  # as DataLoader does: a warning, not an error (workers then share cores)
        whose = (
            f"the {cores} CPU cores this process may use"
            if share == cores
            else f"this rank's {share} of the {cores} CPU cores this process may use ({local_ranks()} ranks share them)"
        )
        notes.append(
            f"num_workers={num_workers} exceeds {whose}; FusionFlow runs best with one worker per core: "
            f"use num_workers<={share}"
        )
    return num_workers


def resolve_batching(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, generator):
    """(batch_sampler, sampler, capacity, batch_size) as DataLoader combines its arguments; capacity is the
    largest batch, batch_size the loader's attribute (None beside a batch_sampler, as DataLoader's)."""
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler is mutually exclusive with batch_size, shuffle, sampler and "
                "drop_last: leave those at their defaults when you pass a batch_sampler"
            )
        capacity, batch_size = batch_capacity(batch_sampler), None
    else:
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 (unbatched loading is not supported)")
        batch_size = int(batch_size)  # (torch's BatchSampler refuses numpy's integers)
        if sampler is not None and shuffle:
            raise ValueError(
                "sampler is mutually exclusive with shuffle=True: shuffle inside your sampler "
                "(e.g. DistributedSampler(shuffle=True)) and leave shuffle unset"
            )
        if sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        capacity = batch_size
    return batch_sampler, getattr(batch_sampler, "sampler", sampler), capacity, batch_size


def _is_int(value) -> bool:  # Python's or numpy's integers (a count computed with numpy), never a bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def resolve_tiny_batch_size(tiny_batch_size, capacity: int) -> int:
    if tiny_batch_size is None:
        tiny_batch_size = min(4, capacity)
    if not _is_int(tiny_batch_size) or tiny_batch_size < 1:
        raise ValueError(f"tiny_batch_size={tiny_batch_size!r} must be an integer >= 1")
    if tiny_batch_size > capacity:
        raise ValueError(
            f"tiny_batch_size={tiny_batch_size} is larger than batch_size={capacity}: "
            f"use tiny_batch_size <= batch_size (typically 1-8)"
        )
    return int(tiny_batch_size)


ACCELERATOR_PREFETCH = 4  # ring slots by default with an accelerator (bench_cooperation, 2026-11-25)


def resolve_prefetch(prefetch_factor, num_workers: int) -> int:
    if prefetch_factor is None:
        prefetch_factor = 2
    elif num_workers == 0:
        raise ValueError("prefetch_factor needs num_workers > 0 (with 0 workers nothing runs ahead)")
    if not _is_int(prefetch_factor) or prefetch_factor < 1:
        raise ValueError(f"prefetch_factor={prefetch_factor!r} must be an integer >= 1 (mini-batches in flight)")
    return int(prefetch_factor)


def check_context(ctx) -> None:
    """multiprocessing_context as DataLoader takes it: a start method's name or a context, refused here, not at
    the first iteration."""
    if isinstance(ctx, str):
        try:
            multiprocessing.get_context(ctx)
        except ValueError:
            methods = ", ".join(multiprocessing.get_all_start_methods())
            raise ValueError(
                f"multiprocessing_context={ctx!r} is not a start method here; use one of {methods}"
            ) from None
    elif ctx is not None and not isinstance(ctx, multiprocessing.context.BaseContext):
        raise TypeError(f"multiprocessing_context={ctx!r} must be a start method's name or a multiprocessing context")


def check_run_options(persistent_workers, num_workers: int, timeout, on_error, max_retries, pin_workers) -> None:
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout < math.inf:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds >= 0 (0 waits forever)")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r} must be one of {ON_ERROR}")
    if not _is_int(max_retries) or max_retries < 0:
        raise ValueError(f"max_retries={max_retries!r} must be an integer >= 0")
    if pin_workers not in (True, False, "auto"):
        raise ValueError(f"pin_workers={pin_workers!r} must be 'auto', True or False")


def resolve_pinning(pin_memory, pin_memory_device, in_order, device: torch.device, host: Host, notes: list) -> dict:
    """pin_memory resolved, with DataLoader's newer keywords taken as it takes them: `pin_memory_device`
    (deprecated there: the current accelerator is pinned for) and `in_order` (False lets DataLoader return a
    batch whose workers finished early before an older one; here each mini-batch is spread over all the
    workers as tiny-batches, so none waits behind one worker's slow batch, and they come in order either way:
    a permitted order)."""
    if not isinstance(pin_memory_device, str):
        raise TypeError(f"pin_memory_device={pin_memory_device!r} must be a str (DataLoader's; deprecated there)")
    if not isinstance(in_order, bool):
        raise TypeError(f"in_order={in_order!r} must be True or False")
    if pin_memory and pin_memory_device:
        notes.append(
            f"pin_memory_device={pin_memory_device!r} is deprecated in DataLoader and ignored here too: "
            "batches are pinned for the loader's CUDA device"
        )
    pin = resolve_pin_memory(pin_memory, device, host.cuda_available, notes)
    return dict(pin_memory=pin, pin_memory_device=pin_memory_device, in_order=in_order)


def note_unused_knobs(accelerator, loose: dict, notes: list) -> None:
    """The accelerator's loose arguments set, the accelerator itself left out (None): a note that they do nothing."""
    defaults = loose_defaults()
    unused = [f"{k}={v!r}" for k, v in loose.items() if v != defaults[k]]
    if accelerator is None and unused:
        notes.append(
            f"{', '.join(unused)} set without an accelerator: it does nothing with accelerator=None (the default); "
            "pass accelerator='dali-gpu' (or a fusionflow.DaliAccelerator) to run DALI beside the CPU workers"
        )


def resolve_seed(seed, generator) -> int | None:
    """The seed as given, checked (None: the loader takes its first epoch's base seed, drawn when it starts)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator={generator!r} must be a torch.Generator or None")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise ValueError(
            f"seed={seed!r} must be a non-negative integer (or None: drawn as the first epoch starts, from "
            "generator if given, else from torch's generator, as DataLoader draws its base seed)"
        )
    return None if seed is None else int(seed)


def resolve_trace(trace):
    from fusionflow.loader.trace import check_path

    return None if trace is None else check_path(trace)


_SAID_DEFAULT_POLICY = False


def resolve_policy(policy):
    """The frozen Policy; without one (policy=None) the training default, said once per process: a
    validation loader that forgets policy= would otherwise evaluate random crops without a word."""
    global _SAID_DEFAULT_POLICY
    if policy is None:
        policy = load_policy("default")
        if not _SAID_DEFAULT_POLICY:
            _SAID_DEFAULT_POLICY = True
            log.warning(
                "FusionFlowLoader: no policy= given, so the training default applies (RandomResizedCrop to "
                '%dx%d + horizontal flip, random per sample). For validation pass policy="eval" (Resize + '
                "CenterCrop), or policy_from_transform(your_eval_transform)",
                *policy.size,
            )
        return policy
    return load_policy(policy)


def resolve_stage_names(stage_times, policy):
    if not isinstance(stage_times, bool):
        raise TypeError(f"stage_times={stage_times!r} must be True or False")
    if not stage_times:
        return None
    from fusionflow.ops.stages import stage_names

    return stage_names(policy)


def resolve_config(
    dataset,
    *,
    batch_size,
    shuffle,
    sampler,
    batch_sampler,
    num_workers,
    collate_fn,
    pin_memory,
    drop_last,
    timeout,
    worker_init_fn,
    multiprocessing_context,
    generator,
    prefetch_factor,
    persistent_workers,
    policy,
    tiny_batch_size,
    seed,
    device,
    on_error,
    max_retries,
    pin_workers,
    accelerator,
    gpu_sharing,
    aot,
    taas,
    taas_last_k,
    global_manager,
    memory_bridge,
    trace,
    stage_times,
    remote_workers=None,
    sample_keys=None,
    read_ahead=None,
    cache=None,
    pin_memory_device="",
    in_order=True,
    host: Host | None = None,
    notes: list | None = None,
) -> LoaderConfig:
    """FusionFlowLoader's arguments (the same names; no defaults here: the loader's signature holds
    them) resolved and checked, in the order the loader reports them. Warnings to give the caller
    (UserWarning) are appended to `notes` as messages, also when a later argument raises."""
    host, notes = (Host() if host is None else host), ([] if notes is None else notes)
    collate = resolve_collate(collate_fn)
    num_workers = resolve_num_workers(num_workers, host.cores(), notes, multiprocessing_context)
    sample_keys, read_ahead = resolve_samples(dataset, sample_keys, read_ahead, num_workers)
    batch_sampler, sampler, capacity, batch_size = resolve_batching(
        dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, generator
    )
    tiny_batch_size = resolve_tiny_batch_size(tiny_batch_size, capacity)  # against the batch size given
    capacity, tiny_batch_size = ring_rows(capacity, tiny_batch_size, sampler if batch_size is not None else None)
    prefetch = resolve_prefetch(prefetch_factor, num_workers)
    check_run_options(persistent_workers, num_workers, timeout, on_error, max_retries, pin_workers)
    seed_given, seed = seed is not None, resolve_seed(seed, generator)
    resolved = resolve_device(device, host)
    pinning = resolve_pinning(pin_memory, pin_memory_device, in_order, resolved, host, notes)
    policy = resolve_policy(policy)
    loose = dict(gpu_sharing=gpu_sharing, aot=aot, taas=taas, taas_last_k=taas_last_k, memory_bridge=memory_bridge)
    dali = resolve_dali(accelerator, loose, device, resolved, num_workers, host, policy, notes)  # a DaliAccelerator too
    note_unused_knobs(accelerator, loose, notes)
    if prefetch_factor is None and dali["accelerator"] is not None:
        prefetch = ACCELERATOR_PREFETCH  # the accelerator runs ahead: its shares of the next mini-batches
    job = resolve_job(global_manager, num_workers, host.job_key)
    trace_path = resolve_trace(trace)
    stage_names = resolve_stage_names(stage_times, policy)
    check_remote_workers(remote_workers, num_workers, persistent_workers, notes)
    cache = resolve_cache(cache, policy)
    if cache is not None and cache.reuse_crop_epochs > 1:  # in the draw: every worker kind reuses alike
        policy = dataclasses.replace(policy, crop_epochs=cache.reuse_crop_epochs)
    return LoaderConfig(
        batch_sampler=batch_sampler,
        sampler=sampler,
        batch_size=batch_size,  # None beside a batch_sampler, as DataLoader's
        drop_last=drop_last,
        capacity=capacity,
        tiny_batch_size=tiny_batch_size,
        num_workers=num_workers,
        prefetch_factor=prefetch,
        persistent_workers=persistent_workers,
        timeout=timeout,
        on_error=on_error,
        max_retries=int(max_retries),
        pin_workers=pin_workers,
        seed=seed,
        seed_given=seed_given,
        device=resolved,
        policy=policy,
        **dali,  # accelerator, gpu_sharing, aot, taas, taas_last_k, memory_bridge, bridge_why_off, dali_threads, ...
        job=job,
        collate_fn=collate_fn,
        collate=collate,
        **pinning,  # pin_memory, and DataLoader's pin_memory_device and in_order as given
        trace_path=trace_path,
        stage_names=stage_names,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context,
        remote_workers=remote_workers,
        generator=generator,
        sample_keys=sample_keys,
        read_ahead=read_ahead,
        cache=cache,
    )
