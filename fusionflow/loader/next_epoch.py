"""Epoch-boundary speculation: with persistent workers, the next epoch's first mini-batches are
submitted while the training loop still consumes the current epoch's last ones, so the workers do
not sit idle from the epoch's last submission until the next `iter()` submits again.

`NextEpoch` (one per loader) owns the speculation: the runtime and generation it runs on, the epoch
it guessed, the batches it drew and the ring slots they were submitted into.

1. The current epoch's iterator has submitted its last mini-batch; each ring slot it frees from then
   on is offered here (`offer`). The first offer guesses the next epoch: this epoch + 1 (what
   `set_epoch(e + 1)` or no `set_epoch` gives) and its first `prefetch_factor` batches, drawn by
   `peek_next` without changing any state (samplers where that cannot be known without
   side effects are not speculated on). Each offered slot gets the next guessed batch, submitted in
   the same generation, with seq numbers after the epoch's own.
2. The iterator ends: having delivered all its batches, the speculation stays (`seal`); otherwise
   (an error, a `break` in its last batches) it is discarded.
3. The next iterator starts, draws its real batches and asks to adopt (`adopt`): only if the same
   runtime is running, no other iterator started in between, its epoch and configuration are the
   guessed ones, and its first batches -- indices and repeated-augmentation copies -- equal the
   guessed batches one for one. Then it continues the generation: the speculated mini-batches are
   its first ones. Anything else discards them, and the iterator starts a new generation, as
   without speculation (the discarded slots' running tasks drain before new work is dispatched).

`set_epoch` to another epoch and `load_state_dict` discard it at once (the workers turn to real
work sooner); the check at adoption alone keeps every batch, order and exactly-once guarantee.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from fusionflow.loader.epoch import check_batch, copies_for
from fusionflow.loader.sampler_order import as_indices, next_global_seed, order_owner
from fusionflow.runtime.spec import base_seed

log = logging.getLogger("fusionflow.loader")


@dataclass
class _Guess:
    mgr: object  # the LocalManager it runs on
    generation: int
    epoch: int
    config: object  # the LoaderConfig it was drawn with (load_state_dict may replace it)
    batches: list  # [(indices tuple, copies tuple or None)] guessed, in order
    next_seq: int  # the seq the next submitted guess gets
    owner: weakref.ref | None = None  # the iterator whose freed slots it uses (weak: dropping it ends it)
    slots: list = field(default_factory=list)  # ring slots of the submitted guesses, in seq order
    sealed: bool = False  # its iterator ended having delivered all its batches


@dataclass
class Adoption:
    """What the next iterator continues: mini-batches first_seq .. next_seq - 1 of `generation` are
    in flight in `slots` (in seq order)."""

    generation: int
    first_seq: int
    next_seq: int
    slots: list


class NextEpoch:
    def __init__(self, stats, checkpoint):
        self._stats = stats  # counts speculated, adopted and discarded mini-batches
        self._checkpoint = checkpoint  # the loader's: a pending resume or a newer iteration stops a guess
        self._guess: _Guess | None = None
        self._tried = None  # weakref to the iterator that already guessed (or found it could not)

    def offer(self, tail, slots) -> None:
        """The exhausted iterator `tail.owner` (an epoch.EpochTail) offers its free ring slots (a
        SlotPool; the slots used are taken from it).
        A guess that fails (a sampler that raises, say) is dropped: the current epoch goes on, and the
        next one draws its batches itself, raising there if the sampler still does."""
        try:
            self._offer(tail, slots)
        except Exception:
            log.debug("next-epoch speculation dropped", exc_info=True)
            self.discard()

    def _offer(self, tail, slots) -> None:
        owner = tail.owner
        if self._tried is None or self._tried() is not owner:
            self._tried = weakref.ref(owner)
            self.discard()
            self._guess = self._make(tail)
        g = self._guess
        if g is None or g.owner() is not owner:
            return
        while slots and len(g.slots) < len(g.batches):
            slot = slots.take()
            indices, copies = g.batches[len(g.slots)]
            tail.mgr.submit(g.next_seq, tail.generation, slot, g.epoch, list(indices), copies)
            g.slots.append(slot)
            g.next_seq += 1
            self._stats.next_epoch_speculated += 1

    def _make(self, tail) -> _Guess | None:
        checkpoint, config, epoch = self._checkpoint, tail.config, tail.epoch
        if (
            checkpoint.resume is not None
            or checkpoint.abandoned is not None
            or checkpoint.current is not tail.owner.progress
        ):
            return None  # a load_state_dict is pending, or a newer iterator began
        guessed = peek_next(
            config.batch_sampler, config.sampler, epoch, epoch + 1, config.prefetch_factor, config.generator
        )
        if not guessed:
            return None
        copies = copies_for(config.sampler)
        batches = []
        for indices in guessed:
            try:
                check_batch(indices, config.capacity)
            except ValueError:  # the real epoch raises it, not the speculation
                break
            batches.append((tuple(indices), copies(indices)))
        return _Guess(tail.mgr, tail.generation, epoch + 1, config, batches, tail.next_seq, weakref.ref(tail.owner))

    def seal(self, owner, clean: bool) -> None:
        """`owner` ended: clean (all its batches delivered) keeps the speculation for the next iterator."""
        g = self._guess
        if g is not None and not g.sealed and g.owner() is owner:
            if clean:
                g.sealed = True
            else:
                self.discard()

    def on_set_epoch(self, epoch: int) -> None:
        if self._guess is not None and self._guess.epoch != epoch:
            self.discard()

    def discard(self) -> None:
        g, self._guess = self._guess, None
        if g is not None and g.slots:
            g.mgr.forget(g.generation, range(g.next_seq - len(g.slots), g.next_seq))
            self._stats.next_epoch_discarded += len(g.slots)

    def adopt(self, mgr, epoch: int, config, work) -> tuple[Adoption | None, list]:
        """The starting iterator's check; `work` yields its real (indices, copies). Returns the
        adoption (or None: start a new generation) and the real work it read, for the caller to
        submit first when nothing was adopted."""
        g, self._guess, self._tried = self._guess, None, None
        if g is None or not g.slots:
            return None, []
        read = []
        try:
            for _ in g.slots:
                item = next(work, None)
                if item is None:
                    break
                read.append(item)
        except BaseException:  # the real epoch's sampler raised: the guess goes, the error stays
            self._guess = g
            self.discard()
            raise
        real = [(tuple(indices), copies) for indices, copies in read]
        fits = (
            g.sealed
            and g.mgr is mgr
            and mgr.generation == g.generation
            and g.epoch == epoch
            and g.config is config
            and real == g.batches[: len(g.slots)]
        )
        if not fits:
            self._guess = g
            self.discard()
            return None, read
        self._stats.next_epoch_adopted += len(g.slots)
        first = g.next_seq - len(g.slots)
        return Adoption(g.generation, first, g.next_seq, list(g.slots)), []


_PEEKABLE = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


def peek_next(batch_sampler, sampler, epoch: int, next_epoch: int, k: int, base=None) -> list | None:
    """The first `k` batches the next epoch's `start_epoch` will draw if nothing changes until then,
    computed now and leaving every state as it was: the sampler's, its generator's, torch's global
    RNG. None where that cannot be known without side effects: a batch sampler other than torch's
    BatchSampler, or a sampler other than torch's own (a custom one might draw from a global RNG or
    count its iterations), or a resume pending. A guess, not a promise: the caller compares it with
    the batches the epoch really draws (the user may reseed torch or call set_epoch in between). `base`: the
    generator the epoch's base seed is drawn from first (runtime/spec.py base_seed; None: torch's global RNG)."""
    if type(batch_sampler) is not BatchSampler or type(sampler) not in _PEEKABLE:
        return None
    owner, kind = order_owner(batch_sampler, sampler)
    if owner is not sampler or kind == "state_dict":
        return None
    if kind == "none" and type(sampler) is not SequentialSampler:
        return None  # e.g. SubsetRandomSampler / WeightedRandomSampler without a generator: global RNG

    def take():  # the batches as start_epoch hands them on (ints); a batch it would refuse ends the guess
        guess = []
        for batch in itertools.islice(iter(batch_sampler), k):
            try:
                guess.append(as_indices(batch))
            except (TypeError, ValueError):
                break
        return guess

    if kind == "random_seed":  # the seed start_epoch will draw from torch's global RNG, drawn from a copy of it
        seed = next_global_seed(after=1 if base is None else 0)  # (after the base seed's draw)
        sampler.generator = torch.Generator().manual_seed(seed)
        try:
            return take()
        finally:
            sampler.generator = None
    if kind == "generator":
        state = sampler.generator.get_state()
        try:
            if base is sampler.generator:  # after the base seed's draw
                base_seed(base)
            return take()
        finally:
            sampler.generator.set_state(state)
    if kind == "epoch":  # DistributedSampler: an epoch that follows the loader's is taken to go on doing so
        was = sampler.epoch
        sampler.set_epoch(was + next_epoch - epoch if was == epoch else was)
        try:
            return take()
        finally:
            sampler.set_epoch(was)
    return take()  # SequentialSampler: the same order every epoch
