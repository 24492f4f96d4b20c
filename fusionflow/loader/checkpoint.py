"""Mid-epoch checkpoint and resume: the loader's epoch bookkeeping (`Checkpoint`, which
FusionFlowLoader's `state_dict()` / `load_state_dict()` and `set_epoch()` delegate to); what
reproduces an epoch's batch order and how it is restored: loader/sampler_order.py.

A sample's pixels are a pure function of (seed, epoch, index), so a loader's state needs no pixels:
the seed, the epoch bookkeeping, the number of batches already yielded in the epoch in progress,
and what reproduces the epoch's order -- the sampler's state as it was *before* the epoch's
`iter(batch_sampler)`. Resuming restores that state, iterates the batch sampler again and skips the
batches already yielded (index lists only: nothing is read or decoded), so the sampler also ends
the epoch in the state it would have had, and the following epochs are the same too.
"""

from __future__ import annotations

import copy
import itertools
import math
import numbers
import warnings
from dataclasses import dataclass

from fusionflow.loader.sampler_order import (
    capture,
    captured_before_batch_generators,
    check,
    check_payload,
    counted,
    next_global_seed,
    order_owner,
    start_epoch,
    warn_if_unresumable,
)
from fusionflow.runtime.spec import base_seed, next_base_seed

VERSION = 1


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
    left: bool = False  # its iterator was closed (or dropped: a `break`) before the epoch's end

    def over(self) -> bool:
        """Left, or every batch yielded (taken with next() up to its length, StopIteration never seen)."""
        return self.done or self.left or (self.drawn_all and self.yielded >= self.drawn)


class Checkpoint:
    """The loader's position across epochs: the epoch number (set, or counted by iterations), the
    pending resume from `load_state_dict`, and the newest iteration's `EpochProgress`. Knows nothing
    of workers; the loader passes what a state is checked against (`LoaderShape`)."""

    def __init__(self):
        self.epoch, self.epoch_set, self.iterations = 0, False, 0
        self.resume: tuple | None = None  # (sampler state, batches to skip) for the next iteration
        self.abandoned: tuple | None = None  # a loaded epoch left by set_epoch: (its order's state, _drawn)
        self._begun_pending = False  # an iteration began with `resume` pending (one dropped before its first next())
        self._drawn: tuple = (1, False)  # the loaded epoch's batches drawn and whether all were (`_redraw`)
        self.current: EpochProgress | None = None  # the newest iteration's progress, if an epoch is in progress
        self.loaded: dict | None = None  # the state load_state_dict took, while nothing has moved since
        self._base_seed: int | None = None  # the newest epoch's base seed (`base_seed`)
        self._seed: int | None = None  # the augmentation seed drawn for a loader given none (`settled`)
        self._settled: tuple | None = None  # (a seedless configuration, it with that seed): `settled`

    def set_epoch(self, epoch: int, sampler, batch_sampler=None) -> None:
        """Set the augmentation epoch and forward it to the sampler (e.g. DistributedSampler) and to a batch sampler
        of the caller's with a set_epoch of its own (a distributed or bucketing batch sampler)."""
        integer = isinstance(epoch, numbers.Integral) and not isinstance(epoch, bool)  # numpy's too
        if not integer or not 0 <= epoch < EPOCHS:  # (the draw's epoch field: 2**64 and past failed every sample)
            raise ValueError(f"epoch={epoch!r} must be a non-negative integer below 2**63")
        epoch = int(epoch)  # numpy's integers too
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
        # an epoch left (its iterator closed by a `break`, or every batch taken with next()), or iterated while set to
        # another number: the next iter() starts the set epoch anew, and a state says so. The same number while it is
        # iterated (a script calling set_epoch inside its loop) keeps its position.
        cur = self.current
        if cur is not None and not cur.done and (cur.over() or epoch != self.epoch):
            self.current = None
        mid_epoch = self.loaded is not None and self.loaded.get("batches_yielded") is not None
        if not (mid_epoch and epoch == self.epoch):  # (the loaded epoch's own number: still that state)
            self.loaded = None
        self.epoch, self.epoch_set = epoch, True
        for owner in (sampler, batch_sampler) if batch_sampler is not sampler else (sampler,):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)

    def upcoming(self) -> int | None:
        """The epoch the next `begin` moves on to (the previous + 1), None where it keeps the epoch it has (the first
        iteration, `set_epoch` called, a loaded state's resume pending): a caller running epochs itself (a shared
        producer's serve) tells it to the sampler through set_epoch."""
        advances = self.iterations and not self.epoch_set and not (self.resume is not None and self._begun_pending)
        return self.epoch + 1 if advances else None

    def begin(self) -> tuple[int, EpochProgress]:
        """A new iteration: its epoch (the previous + 1 unless `set_epoch` was called, or a loaded state's resume is
        still pending: an iterator made and dropped before its first next() took none of it) and its progress, which
        becomes the current one (an epoch is in progress from iter() on)."""
        if self.upcoming() is not None:
            self.epoch += 1
        self.epoch_set, self.loaded, self._begun_pending = False, None, self.resume is not None
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
        return counted(batches, progress)

    def _redraw(self, batch_sampler, sampler) -> None:
        """The left epoch's draw, made again from its saved state and dropped: the saved run had drawn that epoch's
        order (when its iteration started) before the next, which it drew from the state that draw left. Restoring
        the saved state alone replayed the left epoch's order as the next one's."""
        if self.abandoned is not None:
            (left, drawn, drawn_all), self.abandoned = self.abandoned, None
            batches = start_epoch(batch_sampler, sampler, left, 0)[0]  # as far as the saved run had taken it
            # every batch drawn (a save at the epoch's last batch, before the sampler's end was seen in this process):
            # to the end, as the saved run's loop went on (torch's RandomSampler draws once more there)
            whole = drawn_all or drawn >= _length_of(batch_sampler)
            for _ in batches if whole else itertools.islice(batches, drawn):
                pass

    def base_seed(self, config) -> int:
        """The epoch's base seed (runtime/spec.py base_seed) from `config.generator`, drawn as the iteration starts,
        before `batches` (after a left epoch's draw made again, `_redraw`, as the saved run made that one first);
        resuming an epoch whose order came from torch's global RNG, the one that epoch drew: a script that restores
        torch's RNG state with the loader's finds it where the saved run had it, so later epochs repeat too."""
        self._redraw(config.batch_sampler, config.sampler)
        saved = self.resume[0] if self.resume is not None else None
        seed = saved.get("base_seed") if isinstance(saved, dict) and saved.get("kind") == "random_seed" else None
        drawn = base_seed(config.generator) if seed is None or saved.get("peeked") else None  # (peeked: `state_dict`)
        self._base_seed = drawn if seed is None else seed
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
        cur = self.current  # an epoch left (its iterator closed: a `break`) is over: the next iter() starts the next
        in_epoch = cur is not None and not (cur.done or cur.left)  # epoch, and so does a resumed loader's (not so at
        # its last batch with the iterator alive: workers may have drawn every batch before it was taken)
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
        if in_epoch and order.get("kind") == "random_seed" and order.get("seed") is None:  # iter() called, nothing
            # drawn yet: the first next() draws the base seed (from `draws_first`, else torch's RNG), then the order's
            base = next_base_seed(draws_first)
            order = {
                **order,
                "seed": next_global_seed(after=int(draws_first is None)),
                "base_seed": base,
                "peeked": True,
            }
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
        resume it. The seed is the caller's to apply (`state["seed"]`). Nothing changes unless all of it is valid."""
        validate(state, shape)
        if captured_before_batch_generators(state["sampler"], batch_sampler, sampler):
            warnings.warn(
                "the state was saved before FusionFlow captured a batch sampler's own generator: the resumed epoch's "
                "order is not restored (samples may repeat or be missed); a state saved now restores it",
                UserWarning,
                stacklevel=3,
            )
            state = {**state, "sampler": capture(batch_sampler, sampler)}  # as it was resumed then: nothing restored
        check(state["sampler"], batch_sampler, sampler)
        check_payload(state["sampler"], order_owner(batch_sampler, sampler)[0])
        yielded = state["batches_yielded"]
        self.epoch, self.epoch_set, self.iterations = state["epoch"], state["epoch_set"], state["iterations"]
        if yielded is not None:  # the next iteration is the saved epoch itself: no epoch + 1
            self.epoch_set, self.iterations = True, max(0, self.iterations - 1)
        saved = state["sampler"]
        if yielded is None and saved.get("kind") == "epoch":  # between epochs: the sampler's epoch now, and a
            order_owner(batch_sampler, sampler)[0].set_epoch(saved["epoch"])  # set_epoch after it wins, as a script's
            saved = None
        self.resume, self.abandoned, self._begun_pending = (saved, yielded), None, False  # yielded None: between epochs
        drawn = state.get("batches_drawn")  # absent from a state saved before session 41: at least the batches
        self._drawn = tuple(drawn) if drawn is not None else (max(1, yielded or 0), False)  # yielded were drawn
        self.current, self.loaded = None, copy.deepcopy(state)


def _length_of(batch_sampler) -> float:
    try:
        return len(batch_sampler)
    except TypeError:  # (no len(): never taken as wholly drawn)
        return math.inf


EPOCHS = 2**63  # epochs a loader counts (an epoch's draws key on it; each next epoch adds one)


def _count(value) -> bool:  # (a state's numbers are Python ints: a numpy one would not load with weights_only)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate(state, shape: dict) -> None:
    """ValueError naming the field when `state` is not a state_dict() this loader (`shape`) can resume."""
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
    most = shape["num_batches"] if shape["num_batches"] is not None else float("inf")  # a batch sampler without len()
    drawn = state.get("batches_drawn")
    fields = {  # field: (valid, what it must be)
        "seed": (state.get("seed") is None or _count(state.get("seed")), "a non-negative int or None"),
        "epoch": (_count(state.get("epoch")) and state["epoch"] < EPOCHS, "a non-negative int below 2**63"),
        "epoch_set": (isinstance(state.get("epoch_set"), bool), "a bool"),
        "iterations": (_count(state.get("iterations")), "a non-negative int"),
        "batches_yielded": (
            state.get("batches_yielded") is None
            or (_count(state["batches_yielded"]) and state["batches_yielded"] <= most),
            f"an int in [0, {most}] or None",
        ),
        "batches_drawn": (
            drawn is None
            or (
                isinstance(drawn, (list, tuple)) and len(drawn) == 2 and _count(drawn[0]) and isinstance(drawn[1], bool)
            ),
            "[an int >= 0, a bool] or None",
        ),
        "sampler": (isinstance(state.get("sampler"), dict), "a dict"),
    }
    for key, (valid, must) in fields.items():
        if key not in state and key != "batches_drawn":  # (absent from a state saved before session 41)
            raise ValueError(f"the state has no {key!r}: pass what loader.state_dict() returned, whole")
        if not valid:
            raise ValueError(f"state[{key!r}]={state[key]!r} must be {must}: pass what loader.state_dict() returned")


def policy_digest(policy) -> str:
    """What a state says of the policy that made its pixels (not where the policy was read from, nor its name)."""
    import dataclasses
    import hashlib

    return hashlib.sha256(repr(dataclasses.replace(policy, name="", source="")).encode()).hexdigest()[:16]


def warn_if_other_policy(state: dict, policy) -> None:
    """A state saved by a loader with another policy (a state of before session 48 says none): resumed, with a
    warning -- the order is the saved run's, the pixels this policy's (a progressive resize changes it on purpose)."""
    mine = policy_digest(policy)
    if state.get("policy", mine) != mine:
        warnings.warn(
            "the state was saved by a loader with another policy: the remaining batches are the saved run's samples, "
            "their pixels this loader's policy's (build the loader with the saved run's policy to repeat them)",
            UserWarning,
            stacklevel=3,
        )
