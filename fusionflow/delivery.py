"""Turning filled batches into what a FusionFlowLoader iteration yields, and the inline iteration.

`BatchDelivery` (a base class of FusionFlowLoader): on_error applied to a batch's failures
(`_select`), the batch as tensors the caller owns -- copied out of the ring, pinned, or copied to
the CUDA device with an event that frees the ring slot (`_deliver`) --, targets that are not all
ints collated as DataLoader collates them (`_collate_targets`), the loader's stats per batch, and
the num_workers=0 iteration, which fills the batches in the training process itself with the same
per-sample body as a CPU worker (fusionflow/sample.py). The worker iteration (`_iter_workers`) and
the GPU-merged delivery stay in loader.py, beside the runtime they drive.

`plain` / `collated` wrap an iteration: batches as delivered, or through a user's collate_fn.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from fusionflow.errors import SampleError
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.runtime import targets as ff_targets
from fusionflow.sample import run_sample
from fusionflow.scheduling.tiny_batches import Copies

SKIP_CAUSES = {"ImageTooLargeError": "pixel_limit", "DecodeError": "corrupt"}  # loader.stats.skipped_by_cause


class BatchDelivery:
    """FusionFlowLoader's batch delivery (see the module docstring); uses the loader's attributes."""

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

    def _copied(self, stream):
        """A blocking event (the host sleeps on it instead of spinning) recorded on `stream` after
        this batch's copies out of the ring: the slot is reused, or the ring unmapped, only after it."""
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        if self._manager is not None:
            self._manager.copy_event = event
        return event

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
                failure = run_sample(self.dataset, pipe, pos, index, copy, self.seed, epoch, buf, labels, side, clock)
                if failure is not None:
                    failures.append(failure)
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
            return map_tensors(collated, lambda t: t.to(self._alloc_device))
        if self.pin_memory:
            return map_tensors(collated, lambda t: t.pin_memory())
        return collated

    def _check_batch(self, indices) -> None:
        if len(indices) > self.capacity:
            raise ValueError(f"the batch sampler yielded a batch of {len(indices)} samples, more than its "
                             f"batch_size={self.capacity}")


def plain(batches):
    """(images, targets) of the inner iteration's (images, targets, per-sample targets or None)."""
    try:
        for images, labels, _ in batches:
            yield images, labels
    finally:
        batches.close()  # a break or an exception in the training loop ends the inner iteration now


def collated(batches, collate_fn):
    """DataLoader's collate_fn contract on delivered batches: `collate_fn` gets the batch as a list of
    (image, target) samples -- images are views of the delivered batch tensor (on the loader's device),
    targets as the dataset gave them (Python ints on the fast path) -- and what it returns is what the
    iteration yields. It runs here, in the training process, after the batch is on its device."""
    try:
        for images, labels, objs in batches:
            yield collate_fn(list(zip(images.unbind(0), labels.tolist() if objs is None else objs)))
    finally:
        batches.close()  # a break or an exception in the training loop ends the inner iteration now


def map_tensors(obj, fn):
    """`fn` applied to every tensor in a collated structure (dicts, lists, tuples, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return out if type(obj) is dict else type(obj)(out)
        except TypeError:  # a mapping that cannot be built from a dict: as default_collate does
            return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj
