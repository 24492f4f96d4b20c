"""Mid-epoch checkpoint and resume: what reproduces an epoch's batch order, and how it is restored.

A sample's pixels are a pure function of (seed, epoch, index), so a loader's state needs no pixels:
the seed, the epoch bookkeeping, the number of batches already yielded in the epoch in progress,
and what reproduces the epoch's order -- the sampler's state as it was *before* the epoch's
`iter(batch_sampler)`. Resuming restores that state, iterates the batch sampler again and skips the
batches already yielded (index lists only: nothing is read or decoded), so the sampler also ends
the epoch in the state it would have had, and the following epochs are the same too.

How the order is captured, by sampler (checked in this order):
  * "state_dict": the batch sampler (if the user gave one) or the sampler has `state_dict()` and
    `load_state_dict()` (e.g. torchdata's stateful samplers). Required of it: a `state_dict()` taken
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
import warnings

import torch
from torch.utils.data import RandomSampler

VERSION = 1


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def order_owner(batch_sampler, sampler):
    """The object whose state decides the epoch's order, and how it is captured (see the module doc)."""
    if _stateful(batch_sampler):
        return batch_sampler, "state_dict"
    if _stateful(sampler):
        return sampler, "state_dict"
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        return sampler, "random_seed"
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        return sampler, "generator"
    if callable(getattr(sampler, "set_epoch", None)) and isinstance(getattr(sampler, "epoch", None), int):
        return sampler, "epoch"
    return sampler, "none"


def capture(batch_sampler, sampler) -> dict:
    """The order's state now, without side effects (for a state taken between epochs)."""
    owner, kind = order_owner(batch_sampler, sampler)
    if kind == "state_dict":
        return {"kind": kind, "state": copy.deepcopy(owner.state_dict())}
    if kind == "random_seed":
        return {"kind": kind, "seed": None}  # drawn from torch's global RNG when the epoch starts
    if kind == "generator":
        return {"kind": kind, "state": owner.generator.get_state()}
    if kind == "epoch":
        return {"kind": kind, "epoch": owner.epoch, "num_replicas": getattr(owner, "num_replicas", None),
                "rank": getattr(owner, "rank", None)}
    return {"kind": kind}


def warn_if_unresumable(batch_sampler, sampler) -> None:
    """A state is being taken of an order drawn from torch's global RNG: say it will not repeat."""
    if order_owner(batch_sampler, sampler)[1] == "none" and getattr(sampler, "generator", False) is None:
        warnings.warn(f"{type(sampler).__name__} draws its order from torch's global RNG (generator=None): a "
                      "resumed epoch will not repeat it. Give the sampler a torch.Generator (generator=...) "
                      "or a state_dict()/load_state_dict() to resume it exactly", UserWarning, stacklevel=3)


def check(saved: dict, batch_sampler, sampler) -> None:
    """ValueError when `saved` cannot reproduce the order of this loader's sampler."""
    owner, kind = order_owner(batch_sampler, sampler)
    if not isinstance(saved, dict) or "kind" not in saved:
        raise ValueError(f"state['sampler']={saved!r} is not a FusionFlowLoader sampler state")
    if saved["kind"] != kind:
        raise ValueError(f"the state's order was captured as {saved['kind']!r} but this loader's "
                         f"{type(owner).__name__} is captured as {kind!r}: build the loader with the same kind of "
                         "sampler (and generator=... or not) as the one that saved the state")
    if kind == "epoch":
        for key in ("num_replicas", "rank"):
            mine = getattr(owner, key, None)
            if saved.get(key) != mine:
                raise ValueError(f"the state is from a {type(owner).__name__} with {key}={saved.get(key)}, this "
                                 f"loader's has {key}={mine}: load each rank's own state into that rank's loader")


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
    for _ in range(skip):
        skipped = next(batches, None)
        if skipped is None:
            break
        if on_skip is not None:
            on_skip(skipped)
    return batches, snapshot
