"""The per-epoch iterators `iter(FusionFlowLoader)` returns: each owns its epoch's state.

`WorkerIterator` (num_workers > 0): the epoch's generation on the loader's runtime (a newer
iterator abandons an older one's unfinished work), the free ring slots, the mini-batches submitted
and delivered, the slot whose GPU copies the caller still holds (released at the next call), and the
epoch's `EpochProgress` (batches yielded, for checkpoints). `InlineIterator` (num_workers=0): the
same batches made in the training process itself, with the per-sample body CPU workers run
(fusionflow/runtime/sample.py).

Both start lazily, as a generator would: nothing is started or drawn until the first `next()`. An
iteration ends at its last batch, at an exception (re-raised), at `close()`, or when the iterator is
dropped: its unfinished work is forgotten, and without persistent workers the runtime is stopped. A
failing sample (SampleError, on_error='raise') is not such an exception: as DataLoader, the mini-batch
holding it is lost and the iteration goes on at the next one if the caller calls `next()` again (its
workers, without persistent_workers, stay until the iterator is dropped -- as DataLoader's -- which the
exception's traceback delays while it is kept). After any other exception, the next `next()` says the
iteration ended there (once; StopIteration after), so a caller that catches it and goes on does not take
the rest of the epoch for delivered.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data._utils.pin_memory import pin_memory as pin_batch  # DataLoader's: tensors, custom types

from fusionflow.datasets.wrappers import start_reads
from fusionflow.errors import EmptyBatch, FusionFlowError, SampleError
from fusionflow.loader.batch_capacity import global_rng_states
from fusionflow.loader.delivery import torch_rank_world
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.sample import run_samples
from fusionflow.runtime.slots import SlotPool
from fusionflow.scheduling.tiny_batches import Copies


def copies_for(sampler) -> Copies:
    """A fresh copy counter for an epoch, on this loader's rank (repeated augmentation): the sampler's
    rank/num_replicas, else torch.distributed's, else 0/1."""
    rank, world = getattr(sampler, "rank", None), getattr(sampler, "num_replicas", None)
    if not (isinstance(rank, int) and isinstance(world, int)):
        rank, world = torch_rank_world()
    return Copies(rank, world)


@dataclass(frozen=True)
class EpochTail:
    """What an iteration that has submitted its last mini-batch tells the next epoch's speculation
    (loader/next_epoch.py): who it is, the runtime and generation it runs on, the seq the next
    submission gets, its configuration and epoch."""

    owner: object  # the iterator (its `progress` says whether it is still the loader's newest)
    mgr: object  # the LocalManager
    generation: int
    next_seq: int
    config: object
    epoch: int


def check_batch(indices, capacity: int) -> None:
    if len(indices) > capacity:
        raise ValueError(
            f"the batch sampler yielded a batch of {len(indices)} samples, more than the {capacity} shared memory "
            "holds (batch_size, or the sampler's length when the loader was made if smaller: make a new loader when "
            "the dataset grows; a batch sampler without batch_size is sized by its first pass: give it the largest)"
        )


def collate_aside(collate, batch, key):
    """`collate(batch)` on random streams of its own, as DataLoader's workers call a collate_fn: torch's (CPU),
    Python's and NumPy's global streams are seeded from `key` (seed, epoch, batch) for the call and put back after.
    A collate_fn that draws (mixup, cutmix) drew from the training process's streams, so with workers the next
    epoch's shuffle (and the script's own draws) differed from DataLoader's; its draws are now reproducible too."""
    import random

    seed, saved = hash(key) & (2**63 - 1), global_rng_states()
    torch.default_generator.manual_seed(seed)  # (the CPU's only: the GPU's stream is training's)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        return collate(batch)
    finally:
        for restore, state in saved:
            restore(state)


class EpochIterator:
    """What both iterators share: the loader's parts they use, the epoch, its progress, and the
    output as the caller gets it (the batch, or what the user's collate_fn returns)."""

    def __init__(self, parts, config, epoch: int, progress):
        self.config = config  # this epoch's configuration (load_state_dict may replace the loader's)
        # the samples as the loader reads them (sample_keys, read_ahead: loader/dataset.py wrap_samples)
        self.dataset, self.epoch, self.progress = parts.runtime.dataset, epoch, progress
        self._checkpoint, self._delivery, self._tracing = parts.checkpoint, parts.delivery, parts.tracing
        self._stats, self._runtime = parts.stats, parts.runtime
        self._started = self._ended = False
        self._tally: tuple | None = None  # Delivery.tally as the epoch started (None: resumed, `all_failed` not asked)
        self._failed: str | None = None  # the exception that ended the iteration, until a next() has said so

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """The epoch's mini-batches, as DataLoader's iterator says (its batch sampler's length)."""
        return len(self.config.batch_sampler)

    def __next__(self):
        images_t, labels_t, objs = self._advance(self._next_batch)
        collate = self.config.collate
        if collate is None:  # as default_collate shapes the samples: [images, targets] (runtime/targets.py batch_of)
            if objs is not None:  # targets that are not all ints: default_collate's (never before a user's collate)
                labels_t = self._delivery.collate_targets(objs)
            return ff_targets.batch_of(images_t, labels_t)
        # DataLoader's collate_fn contract: the batch as a list of samples shaped as the dataset gave them --
        # images are views of the delivered batch tensor (on the loader's device), targets as the dataset
        # gave them (Python ints on the fast path) -- run here, after the batch is on its device.
        targets = labels_t.tolist() if objs is None else objs
        batch = [ff_targets.sample_of(x, t) for x, t in zip(images_t.unbind(0), targets)]
        if self.config.num_workers == 0:  # in the training process, as DataLoader's: its random streams
            out = collate(batch)
        else:  # DataLoader calls it in a worker: the training process's streams are not drawn from
            out = collate_aside(collate, batch, (self.config.seed, self.epoch, self.progress.yielded))
        return pin_batch(out) if self.config.pin_memory else out  # what it returns pinned, as DataLoader pins it

    def _advance(self, step):
        """One step of the iteration (the epoch starts at the first): what `step()` returns. The
        epoch's end (StopIteration) and any exception but a failing sample's end the iteration."""
        if self._ended:
            failed, self._failed = self._failed, None
            if failed is not None:
                raise FusionFlowError(
                    f"this iteration ended at the {failed} an earlier next() raised: the rest of its epoch was not "
                    "delivered. Start a new iteration (iter(loader)), or resume from a loader.state_dict() taken "
                    "before it; a failing sample alone (SampleError) does not end an iteration"
                )
            raise StopIteration
        try:
            if not self._started:
                self._started = True
                self._tally = tuple(self._delivery.tally) if not self.progress.yielded else None
                self._start()
            while True:
                try:
                    out = step()
                    break
                except EmptyBatch:  # on_error='skip' left it no sample: the next one instead (a resume skips it)
                    self.progress.yielded += 1
        except StopIteration:
            self.progress.done = True  # the epoch is complete
            self._end(finished=True)
            failed = self._delivery.all_failed(self._tally, self.epoch) if self._tally is not None else None
            if failed is not None:
                raise failed from None
            raise
        except SampleError:  # one mini-batch's failing sample (on_error='raise'): that batch is lost, as DataLoader
            self.progress.yielded += 1  # loses it; a next() goes on with the next one (a resume skips it too)
            raise
        except BaseException as exc:
            self._end(finished=False)
            self._failed = type(exc).__name__
            raise
        self.progress.yielded += 1
        return out

    def close(self) -> None:
        """End the iteration now (as a `break` out of the loop does, once the iterator is dropped)."""
        if self._started and not self._ended:
            self._end(finished=False)
        self._ended = True
        self.progress.left = not self.progress.done  # (Checkpoint.set_epoch: a left epoch starts anew)

    def __del__(self):
        self.close()

    def _batches(self, copies):
        return self._checkpoint.batches(self.progress, self.config.batch_sampler, self.config.sampler, copies)

    def _start(self) -> None:
        raise NotImplementedError

    def _next_batch(self):
        raise NotImplementedError

    def _end(self, finished: bool) -> None:
        self._ended = True
        self._tracing.flush()


class WorkerIterator(EpochIterator):
    """One epoch on the loader's worker processes (and accelerator / remote worker kinds). Its
    mini-batches are seqs first_seq, first_seq + 1, ... of its generation: 0 on, or after those the
    previous epoch's iterator speculated for it (fusionflow/loader/next_epoch.py)."""

    def __init__(self, parts, config, epoch: int, progress, slots: SlotPool | None = None):
        super().__init__(parts, config, epoch, progress)
        self._gpu, self._next_epoch = parts.gpu, parts.next_epoch
        self._mgr = None  # the runtime this epoch runs on (started at the first next())
        self._gen = None  # this epoch's generation on it
        # ring slots with no mini-batch in them (all of them, unless the caller holds some: a SharedLoader)
        self._slots = SlotPool(range(self.config.prefetch_factor)) if slots is None else slots
        self._pending = None  # (slot, CUDA event) of the batch the caller holds on the GPU path
        self._first_seq = self._submitted = self._delivered = 0
        self._exhausted = False
        self._drawing_failed: BaseException | None = None  # the sampler's error, raised once what it drew is delivered

    def _start(self) -> None:
        seed = self._checkpoint.base_seed(self.config)  # every epoch, as DataLoader's iterator draws one
        self.config = self._checkpoint.settled(self.config)  # seed=None: the first epoch's base seed
        self._mgr = mgr = self._runtime.start(self.config, self._delivery.alloc_device, seed)
        copies = self._copies = copies_for(self.config.sampler)
        # (indices, copy numbers) of each mini-batch; the generator must not refer to self (no cycle:
        # a dropped iterator ends at once)
        self._work = ((indices, copies(indices)) for indices in self._batches(copies))
        adopted, read = self._next_epoch.adopt(mgr, self.epoch, self.config, self._work)
        if adopted is not None:  # the previous iterator already submitted this epoch's first mini-batches
            self._gen = adopted.generation
            self._first_seq = self._delivered = adopted.first_seq
            self._submitted = adopted.next_seq
            self._slots.withdraw(adopted.slots)
        else:
            self._gen = mgr.new_generation()
            mgr.abandon(self._gen - 1)  # a previous iterator left unfinished: its work is forgotten
            self._work = itertools.chain(read, self._work)
        self._refill()

    def _refill(self) -> None:
        """Submit the epoch's next mini-batches into the free ring slots; once the epoch has none
        left, offer the slots to the next epoch's speculation (persistent workers only)."""
        while self._slots and not self._exhausted:
            try:
                item = next(self._work, None)
                if item is not None:
                    check_batch(item[0], self.config.capacity)
            except Exception as exc:  # the batch sampler raised, or drew a batch refused: the batches drawn before it
                self._drawing_failed, item = exc, None  # are delivered first, as without workers (then it raises)
            if item is None:
                self._exhausted = True
                break
            self._mgr.submit(self._submitted, self._gen, self._slots.take(), self.epoch, list(item[0]), item[1])
            self._submitted += 1
        if self._exhausted and self._slots and self.config.persistent_workers:
            tail = EpochTail(self, self._mgr, self._gen, self._submitted, self.config, self.epoch)
            self._next_epoch.offer(tail, self._slots)

    # ---------------------------------------------------------------- for a holder of ring slots (SharedLoader)
    def advance(self, step):
        """One step of the iteration, as `next()` takes one, with `step()` in place of the batch's
        delivery (the epoch starts at the first; its end and any exception end the iteration)."""
        return self._advance(step)

    def in_flight(self) -> bool | None:
        """True: a submitted mini-batch is not yet delivered; False: none is, but the epoch has more
        to submit once a slot is free; None: the epoch has nothing left."""
        if self._delivered < self._submitted:
            return True
        if self._exhausted:
            self._raise_drawing_failure()
        return None if self._exhausted else False

    def wait_next(self):
        """The next mini-batch's filled ring state, its slot kept (neither copied out nor reused):
        the caller returns the slot with `give_back`. Counted in stats and the trace as a wait."""
        seq, t0 = self._delivered, time.perf_counter()
        state = self._mgr.wait(seq, self._gen, self.config.timeout)
        self._delivered += 1
        self._waited(time.perf_counter() - t0, seq, state.size)
        return state

    def _waited(self, wait: float, seq: int, n: int, ready_ns: int | None = None) -> None:
        """Mini-batch `seq` of `n` samples delivered after the training loop waited `wait` s (until `ready_ns`,
        monotonic; default now): counted in stats and the trace, and told to the decoded-image cache
        (fill_share="auto" paces while it waits)."""
        self._delivery.account(wait, n)
        self._tracing.wait(wait, seq, n, ready_ns)
        cache = self._runtime.cache_attachment
        if cache is not None:
            cache.delivered(wait)

    def give_back(self, slot: int) -> None:
        """A ring slot taken with `wait_next` is free again: the next mini-batch is submitted into it."""
        if not self._ended:
            self._slots.give(slot)
            self._refill()

    def _next_batch(self):
        mgr, gpu = self._mgr, self._gpu
        if self._pending is not None:  # the caller is done with the previous batch's GPU copies
            slot, event = self._pending
            self._pending = None
            event.synchronize()
            self._slots.give(slot)
            self._refill()
        if self._delivered >= self._submitted:
            self._raise_drawing_failure()
            raise StopIteration
        t0 = time.perf_counter()
        if gpu is not None:
            gpu.mark_step()
            gpu.open_window(mgr)
        try:
            state = mgr.wait(self._delivered, self._gen, self.config.timeout)
        finally:
            if gpu is not None:
                gpu.close_window(mgr)
        wait, ready_ns = time.perf_counter() - t0, time.monotonic_ns()  # (before the copy out of the ring)
        try:
            images_t, labels_t, objs, event = self._delivery.from_ring(mgr, state, gpu)
        except (EmptyBatch, SampleError):  # nothing was copied out: its slot goes back (the caller may go on)
            self._delivered += 1
            self._slots.give(state.slot)
            self._refill()
            raise
        self._waited(wait, self._delivered, len(images_t), ready_ns)
        if gpu is not None:
            gpu.sync_stats()
        self._delivered += 1
        if event is None:
            self._slots.give(state.slot)
            self._refill()
        else:
            self._pending = (state.slot, event)
        return images_t, labels_t, objs

    def _raise_drawing_failure(self) -> None:
        """Every batch drawn is delivered: the sampler's error that ended the drawing, if one did, is raised now."""
        if (failed := self._drawing_failed) is not None:
            self._drawing_failed = None
            raise failed

    def _end(self, finished: bool) -> None:
        self._ended = True
        if self._pending is not None:  # the last batch's copy out of its slot must end before the slot is reused
            try:
                self._pending[1].synchronize()
            except Exception:  # a CUDA error at teardown: the slot is not reused by this iterator anyway
                pass
        self._pending = None
        if self._mgr is not None:
            # every batch delivered (the caller stopped right after the last, without StopIteration): clean too
            clean = finished or (self._exhausted and self._delivered >= self._submitted)
            self._next_epoch.seal(self, clean)
            self._runtime.end_iteration(self._mgr, self._gen, clean, self.config.persistent_workers)
        self._tracing.flush()


class InlineIterator(EpochIterator):
    """One epoch made in the training process (num_workers=0), sample by sample."""

    def _start(self) -> None:
        from fusionflow.ops.pipeline import CpuPipeline

        self._checkpoint.base_seed(self.config)  # drawn as DataLoader's iterator draws it
        cfg = self.config = self._checkpoint.settled(self.config)  # seed=None: the first epoch's base seed
        cache = self._runtime.cache(cfg)
        self._pipe = CpuPipeline(cfg.policy, cache=cache.reader() if cache is not None else None)
        self._buf = np.empty((cfg.capacity, *cfg.policy.out_shape), cfg.policy.out_dtype)
        self._labels = np.empty(cfg.capacity, np.int64)
        self._copies = copies_for(cfg.sampler)
        self._clock = None
        if cfg.stage_names is not None:
            from fusionflow.ops.stages import StageClock

            self._clock = StageClock(cfg.stage_names)
        self._seq = 0
        self._indices = self._batches(self._copies)

    def _next_batch(self):
        cfg, buf, labels = self.config, self._buf, self._labels
        indices = next(self._indices)  # StopIteration: the epoch is complete
        t0 = time.perf_counter()
        check_batch(indices, cfg.capacity)
        side = {}  # targets that are not ints (runtime/targets.py)
        start_reads(self.dataset, indices)  # read_ahead=
        failures = run_samples(self.dataset, self._pipe, range(len(indices)), indices, self._copies(indices), cfg.seed,
                               self.epoch, buf, labels, side, self._clock)  # fmt: skip
        n = len(indices)
        try:
            keep = self._delivery.select(n, failures)  # EmptyBatch, SampleError: the caller may go on to the next
        except (EmptyBatch, SampleError):
            self._seq += 1  # its number stays its own, as on the workers' path
            raise
        imgs, labs = (buf[:n], labels[:n]) if keep is None else (buf[keep], labels[keep])
        objs = ff_targets.gather(labels, range(n) if keep is None else keep, side) if side else None
        wait = time.perf_counter() - t0
        self._delivery.account(wait, len(imgs))
        if self._clock is not None:
            self._stats.add_stage_times(cfg.stage_names, "inline", self._clock.take())
        self._tracing.wait(wait, self._seq, len(imgs))
        self._seq += 1
        images_t, labels_t, _ = self._delivery.deliver(imgs, labs)
        return images_t, labels_t, objs
