"""Mid-epoch checkpoint and resume: the loader's epoch bookkeeping (`Checkpoint`, which
FusionFlowLoader's `state_dict()` / `load_state_dict()` and `set_epoch()` delegate to), what
reproduces an epoch's batch order, and how it is restored.

A sample's pixels are a pure function of (seed, epoch, index), so a loader's state needs no pixels:
the seed, the epoch bookkeeping, the number of batches already yielded in the epoch in progress,
and what reproduces the epoch's order -- the sampler's state as it was *before* the epoch's
`iter(batch_sampler)`. Resuming restores that state, iterates the batch sampler again and skips the
batches already yielded (index lists only: nothing is read or decoded), so the sampler also ends
the epoch in the state it would have had, and the following epochs are the same too.

How the order is captured, by sampler (checked in this order; a DistributedSampler whose `state_dict()` holds only
its position in the epoch -- torchdata's StatefulDistributedSampler: `yielded` -- is "epoch": that position, taken
before `iter()`, was the previous epoch's count, and the loader skips what it yielded itself):
  * "state_dict": the batch sampler (if the user gave one) or the sampler has `state_dict()` and
    `load_state_dict()`. Required of it: a `state_dict()` taken
    before `iter()` and loaded into a fresh instance makes `iter()` yield the same order, and the
    state is picklable. (A mid-epoch position inside the sampler's own state is not used: the loader
    runs ahead of the training loop by `prefetch_factor` batches, so it counts delivered batches itself.)
  * "random_seed": torch's RandomSampler without a generator draws one seed from torch's global RNG
    per epoch, as DataLoader's does; the loader records that seed, so the resumed epoch is the same.
    The epochs after it draw from the global RNG again, exactly as DataLoader does: to have those
    the same too, pass `generator=` (or restore `torch.get_rng_state()` alongside the checkpoint).
  * "generator": the sampler has a `generator` attribute holding a torch.Generator (RandomSampler,
    SubsetRandomSampler, WeightedRandomSampler with generator=...): its state is recorded.
  * "epoch": the sampler has `set_epoch` and an `epoch` attribute (DistributedSampler): its order
    is a function of (its seed, epoch), which is recorded and set again.
  * "none": anything else (SequentialSampler, a custom sampler without state_dict) must yield the
    same order every time it is iterated in the same state. A sampler that draws from torch's global
    RNG cannot be resumed exactly: give it a `generator` attribute or a `state_dict`/`load_state_dict`.
"""

from __future__ import annotations

import copy
import itertools
import operator
import warnings
from dataclasses import dataclass

import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
)

from fusionflow.runtime.spec import base_seed, next_base_seed

VERSION = 1
# what an epoch-ordered sampler's (DistributedSampler's) order follows besides its epoch: a state fits one alike
EPOCH_SAMPLER_KEYS = ("num_replicas", "rank", "shuffle", "seed", "drop_last")
POSITION_KEYS = {"yielded", "next_yielded"}  # a state_dict of these is a place in an epoch (torchdata's samplers)
_PLAIN = (bool, int, float, str, type(None))


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _position_only(sampler) -> bool:
    """A stateful sampler whose state_dict() is only its position in the epoch (the loader counts that itself)."""
    if not _stateful(sampler):
        return True
    state = sampler.state_dict()
    return isinstance(state, dict) and set(state) <= POSITION_KEYS


def order_owner(batch_sampler, sampler):
    """The object whose state decides the epoch's order, and how it is captured (see the module doc)."""
    if _stateful(batch_sampler):
        return batch_sampler, "state_dict"
    epoch_ordered = callable(getattr(sampler, "set_epoch", None)) and isinstance(getattr(sampler, "epoch", None), int)
    if epoch_ordered and isinstance(sampler, DistributedSampler) and _position_only(sampler):  # its order is (seed,
        return sampler, "epoch"  # epoch)'s; its state_dict, its place in it (torchdata's StatefulDistributedSampler)
    if _stateful(sampler):
        return sampler, "state_dict"
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        return sampler, "random_seed"
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        return sampler, "generator"
    if epoch_ordered:
        return sampler, "epoch"
    return sampler, "none"


def capture(batch_sampler, sampler, draws_first=None) -> dict:
    """The order's state now, without side effects (for a state taken between epochs). `draws_first`: the
    generator the next iteration takes its base seed from before the sampler draws (runtime/spec.py base_seed):
    where that is the sampler's, the state after that draw, as the epoch will find it."""
    owner, kind = order_owner(batch_sampler, sampler)
    if kind == "state_dict":
        return {"kind": kind, "state": copy.deepcopy(owner.state_dict())}
    if kind == "random_seed":
        return {"kind": kind, "seed": None}  # drawn from torch's global RNG when the epoch starts
    if kind == "generator":
        generator = owner.generator
        if draws_first is not None and draws_first is generator:
            generator = torch.Generator().set_state(generator.get_state())  # a copy: the draw leaves it alone
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        return {"kind": kind, "state": generator.get_state()}
    if kind == "epoch":
        keys = {key: getattr(owner, key, None) for key in EPOCH_SAMPLER_KEYS}  # plain values: a sampler of one's own
        return {"kind": kind, "epoch": owner.epoch, **{k: v for k, v in keys.items() if isinstance(v, _PLAIN)}}
    return {"kind": kind}


def warn_if_unresumable(batch_sampler, sampler, stacklevel: int = 3) -> None:
    """A state is being taken of an order drawn from torch's global RNG: say it will not repeat."""
    if order_owner(batch_sampler, sampler)[1] == "none" and getattr(sampler, "generator", False) is None:
        warnings.warn(
            f"{type(sampler).__name__} draws its order from torch's global RNG (generator=None): a "
            "resumed epoch will not repeat it. Give the sampler a torch.Generator (generator=...) "
            "or a state_dict()/load_state_dict() to resume it exactly",
            UserWarning,
            stacklevel=stacklevel,
        )


def check(saved: dict, batch_sampler, sampler) -> None:
    """ValueError when `saved` cannot reproduce the order of this loader's sampler."""
    owner, kind = order_owner(batch_sampler, sampler)
    if not isinstance(saved, dict) or "kind" not in saved:
        raise ValueError(f"state['sampler']={saved!r} is not a FusionFlowLoader sampler state")
    if saved["kind"] != kind:
        raise ValueError(
            f"the state's order was captured as {saved['kind']!r} but this loader's "
            f"{type(owner).__name__} is captured as {kind!r}: build the loader with the same kind of "
            "sampler (and generator=... or not) as the one that saved the state"
        )
    if kind == "epoch":
        for key in EPOCH_SAMPLER_KEYS:
            mine = getattr(owner, key, None)
            if key in saved and saved[key] != mine:  # (a state of an older version lacks shuffle, seed, drop_last)
                fix = "load each rank's own state into that rank's loader" if key == "rank" else "build it as saved"
                raise ValueError(
                    f"the state is from a {type(owner).__name__} with {key}={saved[key]}, this "
                    f"loader's has {key}={mine}: {fix} (the order follows it)"
                )


def start_epoch(batch_sampler, sampler, saved: dict | None, skip: int, on_skip=None):
    """Begin an epoch: restore `saved` (if resuming), capture the order's state, iterate the batch
    sampler and skip `skip` batches (each handed to `on_skip`, if given). Returns (iterator of index
    lists, the captured state)."""
    owner, kind = order_owner(batch_sampler, sampler)
    if saved is not None:
        if kind == "state_dict":
            owner.load_state_dict(copy.deepcopy(saved["state"]))
        elif kind == "generator":
            owner.generator.set_state(saved["state"])
        elif kind == "epoch":
            owner.set_epoch(saved["epoch"])
    if kind == "random_seed":
        seed = saved.get("seed") if saved is not None else None
        if seed is None:  # the draw RandomSampler itself makes at the start of an epoch, at the same point
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        snapshot = {"kind": kind, "seed": seed}
        owner.generator = torch.Generator().manual_seed(seed)
        try:  # the sampler reads its generator when its iteration starts: start it, then hand it back
            batches = iter(batch_sampler)
            first = next(batches, None)
        finally:
            owner.generator = None
        batches = iter(()) if first is None else itertools.chain([first], batches)
    else:
        snapshot = capture(batch_sampler, sampler)
        batches = iter(batch_sampler)
    batches = map(as_indices, batches)
    for _ in range(skip):
        skipped = next(batches, None)
        if skipped is None:
            break
        if on_skip is not None:
            on_skip(skipped)
    return batches, snapshot


def as_indices(batch) -> list[int]:
    """A batch of the batch sampler as Python ints, whatever integer type it yields (a sampler over
    `torch.arange` yields 0-d tensors, numpy's ints): a sample is its index wherever it runs."""
    indices = []
    for i in batch:
        try:
            indices.append(operator.index(i))
        except TypeError:
            raise TypeError(f"the sampler yielded index {i!r} ({type(i).__name__}): indices must be integers") from None
    if indices and min(indices) < 0:
        raise ValueError(
            f"the sampler yielded index {min(indices)}: FusionFlow takes indices 0..len(dataset)-1 (a sample's "
            "augmentation is drawn from its index, so -1 and len(dataset)-1 would be two different samples)"
        )
    return indices


def _counted(batches, progress):
    """`batches`, counted into `progress` as the loader takes them (what a left epoch's `_redraw` repeats)."""
    for batch in batches:
        progress.drawn += 1
        yield batch
    progress.drawn_all = True


@dataclass
class EpochProgress:
    """One iteration's place in its epoch, owned by its iterator: batches yielded so far, what
    reproduces the epoch's order (`start`, None until its first batch is drawn), and whether the
    epoch is complete. Only the `Checkpoint`'s current one is read by `state_dict()`."""

    yielded: int = 0
    start: dict | None = None
    done: bool = False
    drawn: int = 0  # batches taken from the batch sampler (ahead of `yielded` by the prefetch)
    drawn_all: bool = False  # the batch sampler's iteration ended (a sampler may draw again at its end)


class Checkpoint:
    """The loader's position across epochs: the epoch number (set, or counted by iterations), the
    pending resume from `load_state_dict`, and the newest iteration's `EpochProgress`. Knows nothing
    of workers; the loader passes what a state is checked against (`LoaderShape`)."""

    def __init__(self):
        self.epoch, self.epoch_set, self.iterations = 0, False, 0
        self.resume: tuple | None = None  # (sampler state, batches to skip) for the next iteration
        self.abandoned: tuple | None = None  # a loaded epoch left by set_epoch: (its order's state, _drawn)
        self._drawn: tuple = (1, False)  # the loaded epoch's batches drawn and whether all were (`_redraw`)
        self.current: EpochProgress | None = None  # the newest iteration's progress, if an epoch is in progress
        self.loaded: dict | None = None  # the state load_state_dict took, while nothing has moved since
        self._base_seed: int | None = None  # the newest epoch's base seed (`base_seed`)
        self._seed: int | None = None  # the augmentation seed drawn for a loader given none (`settled`)
        self._settled: tuple | None = None  # (a seedless configuration, it with that seed): `settled`

    def set_epoch(self, epoch: int, sampler) -> None:
        """Set the augmentation epoch and forward it to the sampler (e.g. DistributedSampler)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be a non-negative integer")
        if self.resume is not None and self.resume[1] and epoch != self.epoch:
            warnings.warn(
                f"set_epoch({epoch}) after load_state_dict of a state in the middle of epoch "
                f"{self.epoch}: epoch {epoch} starts from its first batch; call set_epoch({self.epoch}) "
                "(or none) to resume the saved epoch's remaining batches",
                UserWarning,
                stacklevel=3,
            )
            saved, self.resume = self.resume[0], None  # a sampler ordered by epoch (DistributedSampler) takes the
            if saved.get("kind") in ("generator", "state_dict"):  # new one, a seed is drawn anew; a generator's or
                self.abandoned = (saved, *self._drawn)  # a state_dict's goes on from where the left epoch left it
        mid_epoch = self.loaded is not None and self.loaded.get("batches_yielded") is not None
        if not (mid_epoch and epoch == self.epoch):  # (the loaded epoch's own number: still that state)
            self.loaded = None
        self.epoch, self.epoch_set = epoch, True
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def begin(self) -> tuple[int, EpochProgress]:
        """A new iteration: its epoch (the previous + 1 unless `set_epoch` was called) and its
        progress, which becomes the current one (an epoch is in progress from iter() on)."""
        if self.iterations and not self.epoch_set:
            self.epoch += 1
        self.epoch_set, self.loaded = False, None
        self.iterations += 1
        start, yielded = self.resume if self.resume is not None else (None, 0)
        self.current = EpochProgress(yielded=yielded or 0, start=start)
        return self.epoch, self.current

    def batches(self, progress: EpochProgress, batch_sampler, sampler, copies=None):
        """The epoch's batches of indices, drawn when the iteration starts; records what reproduces
        them (or restores it, resuming). Batches skipped on resume still pass through `copies`
        (repeated augmentation's counter), so the copies after the resume point get the numbers
        they would have had."""
        saved, skip = self.resume if self.resume is not None else (None, None)
        self.resume = None
        batches, snapshot = start_epoch(batch_sampler, sampler, saved, skip or 0, on_skip=copies)
        if snapshot.get("kind") == "random_seed":  # the draw before it, from the same global RNG
            snapshot["base_seed"] = self._base_seed
        if progress is self.current:
            progress.start, progress.yielded = snapshot, skip or 0
        progress.drawn = skip or 0
        return _counted(batches, progress)

    def _redraw(self, batch_sampler, sampler) -> None:
        """The left epoch's draw, made again from its saved state and dropped: the saved run had drawn that epoch's
        order (when its iteration started) before the next, which it drew from the state that draw left. Restoring
        the saved state alone replayed the left epoch's order as the next one's."""
        if self.abandoned is not None:
            (left, drawn, drawn_all), self.abandoned = self.abandoned, None
            batches = start_epoch(batch_sampler, sampler, left, 0)[0]  # as far as the saved run had taken it
            for _ in batches if drawn_all else itertools.islice(batches, drawn):
                pass

    def base_seed(self, config) -> int:
        """The epoch's base seed (runtime/spec.py base_seed) from `config.generator`, drawn as the iteration starts,
        before `batches` (after a left epoch's draw made again, `_redraw`, as the saved run made that one first);
        resuming an epoch whose order came from torch's global RNG, the one that epoch drew: a script that restores
        torch's RNG state with the loader's finds it where the saved run had it, so later epochs repeat too."""
        self._redraw(config.batch_sampler, config.sampler)
        saved = self.resume[0] if self.resume is not None else None
        seed = saved.get("base_seed") if isinstance(saved, dict) and saved.get("kind") == "random_seed" else None
        self._base_seed = base_seed(config.generator) if seed is None else seed
        return self._base_seed

    def settled(self, config):
        """`config` with the augmentation seed in use, after the epoch's `base_seed`: its own, or for seed=None the
        first epoch's base seed -- drawn where DataLoader draws its iterators' (from the loader's generator, else
        torch's), so a script seeding torch before its first epoch reproduces, a loader built anew draws anew, and
        two loaders zipped draw two -- kept for every epoch after (the same object: next_epoch.py adopts by it)."""
        return self.seeded(config, self._base_seed)

    def seeded(self, config, drawn: int):
        """`config` with the augmentation seed in use: its own, else the one drawn for this loader before, else
        `drawn` (from now on the loader's: a SharedLoader's first epoch, served ahead, draws it so)."""
        if config.seed is not None:
            return config
        if self._seed is None:
            self._seed = drawn
        if self._settled is None or self._settled[0] is not config:
            self._settled = (config, config.with_config(seed=self._seed))
        return self._settled[1]

    @property
    def seed(self) -> int | None:
        """The seed drawn for a loader given none (`settled`), None before its first epoch starts."""
        return self._seed

    def forget_seed(self) -> None:
        """A state without a seed was loaded (saved before any epoch started): the next epoch draws one anew."""
        self._seed = self._settled = None

    def state_dict(self, shape: dict, seed: int | None, batch_sampler, sampler, draws_first=None) -> dict:
        """See FusionFlowLoader.state_dict; `shape`: the loader's dataset_len, batch_size,
        drop_last and num_batches."""
        cur = self.current
        in_epoch = cur is not None and not cur.done
        warn_if_unresumable(batch_sampler, sampler, stacklevel=4)  # the caller of loader.state_dict()
        if self.loaded is not None:  # taken right after load_state_dict (a save at start-up): that state again
            return copy.deepcopy({**self.loaded, **shape, "seed": seed})
        if seed is None and draws_first is not None and self.resume is None:  # seed=None, none drawn yet: the one
            seed = next_base_seed(draws_first)  # the first epoch will draw from the generator, so a resumed loader's
            # pixels are this run's whatever its own generator's seed (it draws from that before the order's restored)
        if not in_epoch or cur.start is None:  # (iter() called, its first batch not yet drawn)
            self._redraw(batch_sampler, sampler)  # so the state captured is the one the next epoch draws from
        # a loaded state not yet drawn from (load_state_dict, then set_epoch): the next epoch draws from it, not from
        # the sampler's live state (a fresh generator's: the resumed run's next epoch repeated the first's order)
        pending = self.resume[0] if self.resume is not None else None
        if in_epoch and cur.start is not None:
            order = cur.start
        else:
            order = pending if pending is not None else capture(batch_sampler, sampler, draws_first)
        return {
            "version": VERSION,
            **shape,
            "seed": seed,
            "epoch": self.epoch,
            "epoch_set": self.epoch_set,
            "iterations": self.iterations,
            "batches_yielded": cur.yielded if in_epoch else None,
            "batches_drawn": [cur.drawn, cur.drawn_all] if in_epoch else None,
            "sampler": copy.deepcopy(order),
        }

    def load_state_dict(self, state: dict, shape: dict, batch_sampler, sampler) -> None:
        """Check `state` against this loader (`shape`, the sampler) and make the next iteration
        resume it. The seed is the caller's to apply (`state["seed"]`)."""
        if not isinstance(state, dict) or state.get("version") != VERSION:
            raise ValueError(
                f"state={type(state).__name__} is not a FusionFlowLoader.state_dict() of version "
                f"{VERSION}: pass what loader.state_dict() returned"
            )
        for key, value in shape.items():
            if state.get(key) != value:
                raise ValueError(
                    f"the state is from a loader with {key}={state.get(key)!r}, this loader has "
                    f"{key}={value!r}: build the loader as the one that saved the state was built "
                    "(same dataset length, batch_size, drop_last and sampler)"
                )
        check(state["sampler"], batch_sampler, sampler)
        yielded, num_batches = state["batches_yielded"], shape["num_batches"]
        most = num_batches if num_batches is not None else float("inf")  # a batch sampler without len()
        if yielded is not None and not (isinstance(yielded, int) and 0 <= yielded <= most):
            raise ValueError(f"state['batches_yielded']={yielded!r} must be an int in [0, {most}]")
        self.epoch, self.epoch_set, self.iterations = state["epoch"], state["epoch_set"], state["iterations"]
        if yielded is not None:  # the next iteration is the saved epoch itself: no epoch + 1
            self.epoch_set, self.iterations = True, max(0, self.iterations - 1)
        saved = state["sampler"]
        if yielded is None and saved.get("kind") == "epoch":  # between epochs: the sampler's epoch now, and a
            order_owner(batch_sampler, sampler)[0].set_epoch(saved["epoch"])  # set_epoch after it wins, as a script's
            saved = None
        self.resume, self.abandoned = (saved, yielded), None  # yielded None: a state between epochs
        drawn = state.get("batches_drawn")  # absent from a state saved before session 41: at least the batches
        ok = isinstance(drawn, (list, tuple)) and len(drawn) == 2  # yielded were drawn (and an endless batch
        self._drawn = (int(drawn[0]), bool(drawn[1])) if ok else (max(1, yielded or 0), False)  # sampler ends)
        self.current, self.loaded = None, copy.deepcopy(state)
