"""Delivery: turning a filled batch into what a FusionFlowLoader iteration yields.

on_error applied to a batch's failures (`select`), the batch as tensors the caller owns -- copied
out of the ring, pinned, or copied to the CUDA device with an event that frees the ring slot
(`deliver`; a mini-batch made partly on the GPU comes through the loader's GpuSession) --, targets
that are not all ints collated as DataLoader collates them (`collate_targets`), and the loader's
stats per batch (`account`). The per-epoch iterators (fusionflow/loader/epoch.py) call it; it holds no
epoch state.
"""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import torch

from fusionflow.errors import EmptyBatch, sample_error
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.counters import append_bounded
from fusionflow.runtime.cuda_host import record_copies

SKIP_CAUSES = {"ImageTooLargeError": "pixel_limit", "DecodeError": "corrupt"}  # loader.stats.skipped_by_cause
NONE_KEPT_WARN = 256  # samples skipped before the loader kept any: said once (it goes on: a bad run may end)


class Delivery:
    """Batches out to the caller: where they go (`device`; `alloc_device` is where delivered tensors
    live -- the device itself, or the CPU when tests replace torch.cuda with a fake), pinned or not,
    what a failed sample does (`on_error`), and the stats that count each batch."""

    def __init__(self, stats, device: torch.device, pin_memory: bool, on_error: str):
        self.stats, self.device, self.pin_memory, self.on_error = stats, device, pin_memory, on_error
        self.alloc_device = device
        self.warned_skip = False  # on_error='skip' warns once per loader
        self.empty_batches = 0  # mini-batches on_error='skip' left empty (not delivered)
        self.tally = [0, 0]  # samples kept, mini-batches left empty by on_error="skip" (the loader's life; an
        # iteration's `all_failed` takes its difference)
        self.last_skipped = None  # the newest failure on_error='skip' dropped
        self.unkept = 0  # samples skipped before any was kept (NONE_KEPT_WARN; None once said)

    def from_ring(self, mgr, state, gpu=None):
        """A completed mini-batch's ring slot -> (images, labels, the targets as the dataset gave them when not all
        are ints -- then collated by the iterator, unless a collate_fn takes them --, the CUDA event after the copies
        out of the slot or None)."""
        n = state.size
        keep = self.select(n, state.failures)
        objs = (
            ff_targets.gather(mgr.board.ring.labels[state.slot], range(n) if keep is None else keep, state.targets)
            if state.targets
            else None
        )  # targets that are not all ints
        merged = gpu.deliver_merged(mgr, state, keep) if gpu is not None else None
        if merged is not None:
            images_t, labels_t, event = merged
        else:
            imgs, labs = mgr.board.ring.images[state.slot], mgr.board.ring.labels[state.slot]
            imgs, labs = (imgs[:n], labs[:n]) if keep is None else (imgs[keep], labs[keep])
            images_t, labels_t, event = self.deliver(imgs, labs, mgr)
        return images_t, labels_t, objs, event

    def deliver(self, images: np.ndarray, labels: np.ndarray, mgr=None):
        """Turn a filled batch (views into the ring, or the inline buffer) into tensors the caller owns."""
        if self.device.type == "cuda":
            pinned = mgr is not None and mgr.cuda_registered  # the ring is page-locked
            with torch.cuda.device(self.device.index):
                stream = torch.cuda.current_stream(self.device)  # the caller's stream on the loader's device
                out = torch.from_numpy(images).to(self.alloc_device, non_blocking=pinned)
                labels_t = torch.from_numpy(labels if pinned else labels.copy()).to(
                    self.alloc_device, non_blocking=pinned
                )
                return out, labels_t, record_copies(stream, mgr)
        if self.pin_memory:
            src = torch.from_numpy(images)
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            return out, torch.from_numpy(labels.copy()).pin_memory(), None
        return torch.from_numpy(images.copy()), torch.from_numpy(labels.copy()), None

    def select(self, n: int, failures):
        """Positions of a batch of `n` to deliver after applying on_error to its failures (None: all); raises
        EmptyBatch where none is left (not under DDP: an empty batch then). A dataset failing every sample raises
        at the epoch's end (`all_failed`), not sooner: a run of failures at the start (a broken class folder that
        sorts first, a bad shard) says nothing of the samples after it (until 2026-12-01 two empty mini-batches and
        16 samples raised, and a sequential loader lost every good sample behind them)."""
        if not failures:
            self.tally[0] += n
            return None
        failures = sorted(failures, key=lambda f: f.position)
        if self.on_error == "raise":
            f = failures[0]
            raise sample_error(
                f.index, f.what, f.exc_type, f.message, f.traceback, exc_class=f.exc_class, attributes=f.attributes
            )
        bad = {f.position for f in failures}
        self.stats.skipped += len(bad)
        self.stats.skipped_indices.extend(f.index for f in failures)
        for f in failures:
            cause = SKIP_CAUSES.get(f.exc_type, "error")
            self.stats.skipped_by_cause[cause] = self.stats.skipped_by_cause.get(cause, 0) + 1
        if not self.warned_skip:
            self.warned_skip = True
            f = failures[0]
            warnings.warn(
                f"on_error='skip': dropping {f.what} ({f.exc_type}: {f.message}); further skips are "
                f"counted in loader.stats.skipped without another warning",
                stacklevel=user_stacklevel(),
            )
        keep = [p for p in range(n) if p not in bad]
        self.unkept = None if self.unkept is None or self.tally[0] else self.unkept + len(bad)
        if self.unkept is not None and self.unkept >= NONE_KEPT_WARN and not keep:
            self.unkept = None
            last = failures[-1]
            warnings.warn(
                f"on_error='skip': none of the first {NONE_KEPT_WARN}+ samples loaded (the latest: {last.what}, "
                f"{last.exc_type}); the loader goes on, and an epoch with none raises at its end: check the data",
                stacklevel=user_stacklevel(),
            )
        self.tally[0] += len(keep)
        self.last_skipped = failures[-1]
        if not keep:  # an empty batch is not delivered (a training step on none fails or gives NaN) ...
            self.empty_batches += 1
            self.tally[1] += 1
            if not distributed():  # ... but under DDP every rank must step as often as the others
                raise EmptyBatch
        return keep

    def all_failed(self, since: tuple, epoch: int):
        """The SampleError to raise at an epoch's end when on_error='skip' dropped every one of its samples (a
        dataset that fails them all, a mount lost after a good epoch), else None. `since`: `tally` at its start."""
        kept, emptied = (now - then for now, then in zip(self.tally, since))
        if kept or not emptied:
            return None
        return _fails_them_all(self.last_skipped, f"epoch {epoch} failed ({emptied} mini-batch(es)), none was")

    def account(self, wait: float, n: int) -> None:
        """One batch of `n` samples delivered after the training loop waited `wait` s for it."""
        self.stats.batches += 1
        self.stats.refresh_cache()
        self.stats.samples += n
        append_bounded(self.stats.wait_seconds, wait)

    def collate_targets(self, objs: list):
        """Targets that are not all ints, as DataLoader delivers them: default_collate, then to the device."""
        return ff_targets.collate(objs, self.alloc_device if self.device.type == "cuda" else None, self.pin_memory)


def torch_rank_world() -> tuple[int, int]:
    """This process's (rank, world size) in torch.distributed; (0, 1) where it is not initialised."""
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _fails_them_all(f, which: str):
    """The SampleError of a dataset that fails every sample (`f`: a failure of it; `which`: what failed)."""
    return sample_error(
        f.index,
        f.what,
        f.exc_type,
        f.message,
        f.traceback,
        hint=f"every sample of {which} delivered: on_error='skip' drops a bad sample, not a dataset that fails "
        "them all",
        exc_class=f.exc_class,
        attributes=f.attributes,
    )


def distributed() -> bool:
    """Whether this process is one rank of several (torch.distributed initialised, world size > 1)."""
    return torch_rank_world()[1] > 1


# torch's samplers that deal every rank the whole dataset (a subclass may shard: not judged)
_WHOLE_SET = (
    torch.utils.data.RandomSampler,
    torch.utils.data.SequentialSampler,
    torch.utils.data.SubsetRandomSampler,
    torch.utils.data.WeightedRandomSampler,
)


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, for its caller, of the first frame outside the fusionflow package: the script's
    line that iterates, however deep the path to the warning (the worker and inline iterators differ)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_unsharded(sampler, batch_sampler, stacklevel: int) -> bool:
    """Under DDP, warn (at the caller's `stacklevel`) when the loader's sampler is one of torch's stock samplers,
    which give every rank the whole dataset: what a script gets from a framework that puts a DistributedSampler
    into torch DataLoaders only (PyTorch Lightning's `use_distributed_sampler`, Accelerate's `prepare`), each
    sample then trained on once per rank an epoch. Python shows it once per line that iterates. Whether it warned.
    A batch sampler of the script's own class is not judged (it may shard, whatever sampler it exposes)."""
    if type(sampler) not in _WHOLE_SET or type(batch_sampler) is not torch.utils.data.BatchSampler:
        return False
    rank, world = torch_rank_world()
    if world <= 1:
        return False
    warnings.warn(
        f"FusionFlowLoader: this process is rank {rank} of {world} (torch.distributed), but the loader's sampler, "
        f"a {type(sampler).__name__}, gives every rank the whole dataset: each sample is read {world} times an "
        "epoch. Pass sampler=torch.utils.data.DistributedSampler(dataset) (and call loader.set_epoch(epoch) each "
        "epoch); PyTorch Lightning and Hugging Face Accelerate insert one into a torch DataLoader only, never into "
        "a FusionFlowLoader. If each rank is meant to read the whole set (evaluation on one rank, a dataset split "
        "per rank already), ignore this warning.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
    return True
