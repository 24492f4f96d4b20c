"""How many samples a caller's batch_sampler puts in a batch at most: shared memory is allocated for that many
up front. Its `batch_size` attribute where it has one (torch's BatchSampler), else the longest batch of one pass
over it, a pass that leaves no trace (`largest_batch`): DataLoader never iterates a batch sampler before the
first epoch, so ours must not shift its pass count or the random streams it draws from."""

from __future__ import annotations

import collections.abc
import itertools

import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)


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
        capacity, limit = largest_batch(batch_sampler)
    except TypeError as e:
        raise ValueError(f"batch_sampler must yield lists of indices ({e})") from None
    if capacity is None:
        raise ValueError(
            f"batch_sampler={type(batch_sampler).__name__} has no batch_size attribute, and one pass over it did not "
            f"end within {limit:,} batches (an endless sampler?): shared memory is sized for its largest "
            "batch up front, so give it a batch_size attribute (the most indices a batch holds)"
        )
    if capacity < 1:
        raise ValueError("batch_sampler yields no non-empty batch")
    return capacity


def largest_batch(batch_sampler) -> tuple[int | None, int]:
    """(the longest batch of one pass over `batch_sampler`: 0 for none, None for no end within the limit; the
    limit), a pass that leaves no trace (DataLoader's own first pass is the first epoch's): over a copy
    (`_probe_copy`: a pass counter of its own or of a sampler it wraps, or an index stream it reads, advances on the
    copy), with the random generators it holds -- itself, its sampler, anything of theirs a few attributes deep
    (`_held`) -- and Python's, NumPy's and torch's global ones put back after. Past PROBE_BATCHES the copy's len()
    is asked for a longer bound (`probe_limit`), never the caller's (one may make a pass)."""
    probe = _probe_copy(batch_sampler)
    states = [*map(_saved, _held(probe, _is_rng)), *global_rng_states()]
    kept = [(restore, state) for restore, state in states if restore]
    limit = PROBE_BATCHES
    try:
        batches = iter(probe)
        lengths = list(map(len, itertools.islice(batches, limit + 1)))
        if len(lengths) > limit and (limit := probe_limit(probe)) > PROBE_BATCHES:
            lengths += map(len, itertools.islice(batches, limit + 1 - len(lengths)))
    finally:
        for restore, state in kept:
            restore(state)
    return (None if len(lengths) > limit else max(lengths, default=0)), limit


PROBE_BATCHES = 1_000_000  # batches of one pass at most (an endless batch sampler is refused past them)...
PROBE_BY_LEN = 10_000_000  # ...or as many as its len() says where that is more, up to these (a bucketing sampler
# over a large set; an endless one that says 10**9 is refused after PROBE_BATCHES)


def probe_limit(batch_sampler) -> int:
    """How many batches the probe's pass may take before it calls the batch sampler endless: PROBE_BATCHES, or its
    len() where that says more, up to PROBE_BY_LEN (past it, len() is not taken for a bound)."""
    try:
        said = len(batch_sampler)
    except Exception:  # (no len(), or one that fails)
        return PROBE_BATCHES
    return said if isinstance(said, int) and PROBE_BATCHES < said <= PROBE_BY_LEN else PROBE_BATCHES


def _probe_copy(batch_sampler):
    """A copy of `batch_sampler` whose pass leaves the original as it was: a deep copy, sharing the datasets it refers
    to (a pass reads them, never changes them; copying one may cost gigabytes); a shallow one where it cannot be
    deep-copied (a generator inside), else itself (its own state then advances by one pass)."""
    import copy

    try:
        shared = {id(d): d for d in _held(batch_sampler, _is_dataset) if d is not batch_sampler}
        return copy.deepcopy(batch_sampler, shared)
    except Exception:
        try:
            return copy.copy(batch_sampler)
        except Exception:
            return batch_sampler


def _is_rng(obj) -> bool:  # a random generator whose state a pass may advance
    import random

    import numpy as np

    return isinstance(obj, (torch.Generator, random.Random, np.random.RandomState, np.random.Generator))


def _is_dataset(obj) -> bool:
    """What a sampler reads and a pass never changes: a torch Dataset (a sampler's data_source), or anything else
    indexed with a length that is no sampler nor builtin container (a Hugging Face dataset)."""
    from torch.utils.data import Dataset, Sampler

    if isinstance(obj, Dataset):
        return True
    kind = type(obj)
    indexed = callable(getattr(kind, "__getitem__", None)) and callable(getattr(kind, "__len__", None))
    return indexed and not isinstance(obj, (Sampler, list, tuple, dict, range, str, bytes, bytearray, memoryview))


def _held(owner, wanted, depth: int = 3, breadth: int = 64) -> list:
    """The objects for which `wanted` is true that `owner` holds up to `depth` attributes deep: in its attributes,
    dicts, lists and tuples (a sampler wrapped in a sampler of one's own, generators kept in a dict), `breadth` of
    each at most; never in modules, arrays or tensors, nor in an object that fails to be looked at (a dead weakref
    proxy); not inside one found."""
    import types

    import numpy as np

    held, seen, level = [], set(), [owner]
    skip = (str, bytes, torch.Tensor, np.ndarray, types.ModuleType, type)
    for _ in range(depth + 1):
        found = []
        for obj in level:
            try:
                if id(obj) in seen or isinstance(obj, skip):
                    continue
                seen.add(id(obj))
                if wanted(obj):
                    held.append(obj)
                elif isinstance(obj, dict):
                    found += itertools.islice(obj.values(), breadth)
                elif isinstance(obj, (list, tuple)):
                    found += obj[:breadth]
                elif hasattr(obj, "__dict__"):
                    found += itertools.islice(vars(obj).values(), breadth)
            except Exception:  # (ReferenceError: a weakref.proxy whose object is gone)
                continue
        level = found
    return held


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


# torch's samplers, whose len() is what they yield: a batch_size above it is sized to it (a large validation batch
# over a small set took shared memory for the batch_size -- 1.2 GB for 8 images at 4096 -- or failed for lack of it)
EXACT_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


def ring_rows(capacity: int, tiny_batch_size: int, sampler) -> tuple[int, int]:
    """(rows, tiny_batch_size): the shared memory's rows a batch -- `capacity`, or fewer where `sampler` (batch_size's,
    None beside a batch_sampler) is one of torch's and yields fewer samples -- and the tiny-batch size within them."""
    rows = min(capacity, max(1, exact_len(sampler) or capacity)) if sampler is not None else capacity
    return rows, min(tiny_batch_size, rows)


def exact_len(sampler) -> int | None:
    """len(sampler) where it is exactly what the sampler yields (torch's own samplers), else None."""
    if type(sampler) not in EXACT_SAMPLERS:
        return None
    try:
        return len(sampler)
    except TypeError:
        return None
