"""How many samples a caller's batch_sampler puts in a batch at most: shared memory is allocated for that many
up front. Its `batch_size` attribute where it has one (torch's BatchSampler), else the longest batch of one pass
over it, a pass that leaves no trace (`largest_batch`): DataLoader never iterates a batch sampler before the
first epoch, so ours must not shift its pass count or the random streams it draws from."""

from __future__ import annotations

import collections.abc
import itertools

import torch


def batch_capacity(batch_sampler) -> int:
    """The largest batch a batch_sampler gives (shared memory is allocated for it up front): its
    `batch_size` attribute (torch's BatchSampler), else the longest batch of one pass over it -- any
    re-iterable of index lists DataLoader accepts (a list of lists, a sampler class of one's own)."""
    capacity = getattr(batch_sampler, "batch_size", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1:
        return capacity
    if isinstance(batch_sampler, collections.abc.Iterator):  # (asked without iter(): its __iter__ may draw)
        raise ValueError(
            f"batch_sampler={type(batch_sampler).__name__}: a one-pass iterator (a generator) gives one epoch "
            "at most; pass something iterable once per epoch (a list of index lists, a Sampler of batches)"
        )
    try:
        capacity = largest_batch(batch_sampler)
    except TypeError as e:
        raise ValueError(f"batch_sampler must yield lists of indices ({e})") from None
    if capacity is None:
        raise ValueError(
            f"batch_sampler={type(batch_sampler).__name__} has no batch_size attribute, and one pass over it did not "
            f"end within {PROBE_BATCHES:,} batches (an endless sampler?): shared memory is sized for its largest "
            "batch up front, so give it a batch_size attribute (the most indices a batch holds)"
        )
    if capacity < 1:
        raise ValueError("batch_sampler yields no non-empty batch")
    return capacity


def largest_batch(batch_sampler) -> int | None:
    """The longest batch of one pass over `batch_sampler` (0 for none; None: no end within PROBE_BATCHES batches),
    a pass that leaves no trace (DataLoader's own first pass is the first epoch's): over a shallow copy (a pass
    counter of its own advances on the copy), with the random generators it holds -- itself, its sampler,
    anything of theirs a few attributes deep (`_held_rngs`) -- and Python's, NumPy's and torch's global ones put
    back after. Its len() is not asked (one may make a pass, or say 10**9 for an endless sampler)."""
    import copy

    try:
        probe = copy.copy(batch_sampler)
    except Exception:  # cannot be copied: its own state advances by one pass
        probe = batch_sampler
    kept = [(restore, state) for restore, state in [*map(_saved, _held_rngs(probe)), *global_rng_states()] if restore]
    try:
        lengths = list(map(len, itertools.islice(probe, PROBE_BATCHES + 1)))
    finally:
        for restore, state in kept:
            restore(state)
    return None if len(lengths) > PROBE_BATCHES else max(lengths, default=0)


PROBE_BATCHES = 1_000_000  # batches of one pass at most (an endless batch sampler is refused past them)


def _held_rngs(owner, depth: int = 3, breadth: int = 64) -> list:
    """The random generators `owner` holds up to `depth` attributes deep: in its attributes, dicts, lists and
    tuples (a sampler wrapped in a sampler of one's own, generators kept in a dict), `breadth` of each at most;
    never in modules, arrays or tensors, nor in an object that fails to be looked at (a dead weakref proxy)."""
    import random
    import types

    import numpy as np

    rngs, seen, level = [], set(), [owner]
    rng_types = (torch.Generator, random.Random, np.random.RandomState, np.random.Generator)
    skip = (str, bytes, torch.Tensor, np.ndarray, types.ModuleType, type)
    for _ in range(depth + 1):
        found = []
        for obj in level:
            try:
                if id(obj) in seen or isinstance(obj, skip):
                    continue
                seen.add(id(obj))
                if isinstance(obj, rng_types):
                    rngs.append(obj)
                elif isinstance(obj, dict):
                    found += itertools.islice(obj.values(), breadth)
                elif isinstance(obj, (list, tuple)):
                    found += obj[:breadth]
                elif hasattr(obj, "__dict__"):
                    found += itertools.islice(vars(obj).values(), breadth)
            except Exception:  # (ReferenceError: a weakref.proxy whose object is gone)
                continue
        level = found
    return rngs


def global_rng_states() -> list:
    """(how to put it back, its state now) for Python's, NumPy's and torch's (CPU) global generators."""
    import random

    import numpy as np

    return [
        (random.setstate, random.getstate()),
        (np.random.set_state, np.random.get_state()),
        (torch.set_rng_state, torch.get_rng_state()),
    ]


def _saved(rng):
    """(how to put `rng`'s state back, its state now) for a random generator (torch's, NumPy's, Python's);
    (None, None) for anything else."""
    import random

    import numpy as np

    if isinstance(rng, torch.Generator):
        return rng.set_state, rng.get_state()
    if isinstance(rng, random.Random) and not isinstance(rng, random.SystemRandom):  # (the OS's: no state)
        return rng.setstate, rng.getstate()
    if isinstance(rng, np.random.RandomState):
        return rng.set_state, rng.get_state()
    if isinstance(rng, np.random.Generator):
        bits = rng.bit_generator
        return (lambda state: setattr(bits, "state", state)), bits.state
    return None, None
