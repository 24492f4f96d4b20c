"""What reproduces an epoch's batch order, how it is captured before the epoch's `iter(batch_sampler)` and how
it is restored (loader/checkpoint.py's `Checkpoint` keeps the captured state; next_epoch.py peeks with it).

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
    is a function of (its seed, epoch), which is recorded and set again; so is a batch sampler of the caller's
    with both (a bucketing one) over a sampler without.
  * "none": anything else (SequentialSampler, a custom sampler without state_dict) must yield the
    same order every time it is iterated in the same state. A sampler that draws from torch's global
    RNG cannot be resumed exactly: give it a `generator` attribute or a `state_dict`/`load_state_dict`.
"""

from __future__ import annotations

import copy
import itertools
import operator
import warnings

import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
)

from fusionflow.runtime.spec import base_seed  # the one draw of a seed (an epoch's base seed, RandomSampler's)

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


def _epoch_ordered(obj) -> bool:
    return callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int)


def order_owner(batch_sampler, sampler):
    """The object whose state decides the epoch's order, and how it is captured (see the module doc)."""
    if _stateful(batch_sampler):
        return batch_sampler, "state_dict"
    epoch_ordered = _epoch_ordered(sampler)
    if _epoch_ordered(batch_sampler) and not epoch_ordered:  # a bucketing or distributed batch sampler of one's own
        return batch_sampler, "epoch"  # (not recorded until session 48: a resume replayed epoch 0's order)
    if epoch_ordered and isinstance(sampler, DistributedSampler) and _position_only(sampler):  # its order is (seed,
        return sampler, "epoch"  # epoch)'s; its state_dict, its place in it (torchdata's StatefulDistributedSampler)
    if _stateful(sampler):
        return sampler, "state_dict"
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        return sampler, "random_seed"
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        return sampler, "generator"
    if isinstance(getattr(batch_sampler, "generator", None), torch.Generator):  # a batch sampler that draws its own
        return batch_sampler, "generator"  # order (bucketing by size) from a generator of its own
    if epoch_ordered:
        return sampler, "epoch"
    return sampler, "none"


def capture(batch_sampler, sampler, draws_first=None) -> dict:
    """The order's state now, without side effects (for a state taken between epochs). `draws_first`: the
    generator the next iteration takes its base seed from before the sampler draws (runtime/spec.py base_seed):
    where that is the sampler's, the state after that draw, as the epoch will find it."""
    owner, kind = order_owner(batch_sampler, sampler)
    if kind == "state_dict":
        return {"kind": kind, "state": copy.deepcopy(owner.state_dict()), **identity(owner)}
    if kind == "random_seed":
        return {"kind": kind, "seed": None, **identity(owner)}  # drawn from torch's global RNG when the epoch starts
    if kind == "generator":
        generator = owner.generator
        if draws_first is not None and draws_first is generator:
            generator = torch.Generator().set_state(generator.get_state())  # a copy: the draw leaves it alone
            base_seed(generator)
        return {"kind": kind, "state": generator.get_state(), **identity(owner)}
    if kind == "epoch":
        keys = {key: getattr(owner, key, None) for key in EPOCH_SAMPLER_KEYS}  # plain values: a sampler of one's own
        plain = {k: v for k, v in keys.items() if isinstance(v, _PLAIN)}
        return {"kind": kind, "epoch": owner.epoch, **plain, **identity(owner)}
    return {"kind": kind, **identity(owner)}


def identity(owner) -> dict:
    """What else a captured order is only valid for: the class of the object it was taken from (a RandomSampler's
    generator state replays as another order in a WeightedRandomSampler) and a RandomSampler's `replacement`."""
    found = {"owner": type(owner).__qualname__}
    if isinstance(getattr(owner, "replacement", None), bool):
        found["replacement"] = owner.replacement
    return found


def warn_if_unresumable(batch_sampler, sampler, stacklevel: int = 3) -> None:
    """A state is being taken of an order drawn from torch's global RNG: say it will not repeat."""
    if order_owner(batch_sampler, sampler)[1] != "none":
        return
    drawing = next((s for s in (sampler, batch_sampler) if getattr(s, "generator", False) is None), None)
    if drawing is not None:
        warnings.warn(
            f"{type(drawing).__name__} draws its order from torch's global RNG (generator=None): a "
            "resumed epoch will not repeat it. Give it a torch.Generator (generator=...) "
            "or a state_dict()/load_state_dict() to resume it exactly",
            UserWarning,
            stacklevel=stacklevel,
        )


def captured_before_batch_generators(saved, batch_sampler, sampler) -> bool:
    """A state saved before session 46 of a batch sampler with a generator of its own: captured as "none" then (its
    order was not restorable), "generator" now."""
    owner, kind = order_owner(batch_sampler, sampler)
    legacy = isinstance(saved, dict) and saved.get("kind") == "none" and "owner" not in saved
    return legacy and kind == "generator" and owner is batch_sampler


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
    mine = identity(owner)  # (absent from a state saved before session 46)
    if any(key in saved and saved[key] != mine.get(key) for key in ("owner", "replacement")):
        raise ValueError(
            f"the state's order was taken from a {_described(saved)}, this loader's sampler is a {_described(mine)}: "
            "build the loader with the sampler that saved the state (its order follows it)"
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


def _described(identity: dict) -> str:
    replacement = f"(replacement={identity['replacement']})" if "replacement" in identity else ""
    return f"{identity.get('owner')}{replacement}"


def check_payload(saved: dict, owner) -> None:
    """ValueError when the kind's own fields in `saved` (already `check`ed) cannot be restored into `owner`."""
    kind, problem = saved["kind"], None
    if kind == "state_dict" and "state" not in saved:
        problem = "has no 'state'"
    elif kind == "random_seed" and not all(_seed_like(saved.get(k)) for k in ("seed", "base_seed")):
        problem = f"has seed={saved.get('seed')!r}, base_seed={saved.get('base_seed')!r} (ints or None)"
    elif kind == "epoch" and not (isinstance(saved.get("epoch"), int) and saved["epoch"] >= 0):
        problem = f"has epoch={saved.get('epoch')!r} (a non-negative int)"
    elif kind == "generator":
        try:
            torch.Generator(device=owner.generator.device).set_state(saved["state"])
        except (KeyError, TypeError, RuntimeError, ValueError) as e:
            problem = f"holds no state of a {owner.generator.device} torch.Generator ({type(e).__name__}: {e})"
    if problem is not None:
        raise ValueError(f"the state's sampler order ({kind!r}) {problem}: pass what loader.state_dict() returned")


def next_global_seed(after: int = 0) -> int:
    """The seed `start_epoch` would draw from torch's global RNG after `after` draws, read from a copy of it."""
    rng = torch.Generator().set_state(torch.get_rng_state())
    for _ in range(after):
        base_seed(rng)
    return base_seed(rng)


def _seed_like(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


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
        if seed is None or saved.get("peeked"):  # the draw RandomSampler makes at the start of an epoch, at the same
            drawn = base_seed()  # point (peeked: taken from the RNG as
            seed = drawn if seed is None else seed  # the saved run took it, so a restored RNG goes on alike)
        snapshot = {"kind": kind, "seed": seed, **identity(owner)}
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


def counted(batches, progress):
    """`batches`, counted into `progress` as the loader takes them (what a left epoch's `_redraw` repeats)."""
    for batch in batches:
        progress.drawn += 1
        yield batch
    progress.drawn_all = True
