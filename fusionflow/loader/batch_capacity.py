"""How many samples a caller's batch_sampler puts in a batch at most: shared memory is allocated for that many
up front. Its `batch_size` attribute where it has one (torch's BatchSampler), else the longest batch of one pass
over it, a pass that leaves no trace (`largest_batch`): DataLoader never iterates a batch sampler before the
first epoch, so ours must not shift its pass count or the random streams it draws from."""

from __future__ import annotations

import torch


def batch_capacity(batch_sampler) -> int:
    """The largest batch a batch_sampler gives (shared memory is allocated for it up front): its
    `batch_size` attribute (torch's BatchSampler), else the longest batch of one pass over it -- any
    re-iterable of index lists DataLoader accepts (a list of lists, a sampler class of one's own)."""
    capacity = getattr(batch_sampler, "batch_size", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1:
        return capacity
    if iter(batch_sampler) is batch_sampler:
        raise ValueError(
            f"batch_sampler={type(batch_sampler).__name__}: a one-pass iterator (a generator) gives one epoch "
            "at most; pass something iterable once per epoch (a list of index lists, a Sampler of batches)"
        )
    try:
        capacity = largest_batch(batch_sampler)
    except TypeError as e:
        raise ValueError(f"batch_sampler must yield lists of indices ({e})") from None
    if capacity < 1:
        raise ValueError("batch_sampler yields no non-empty batch")
    return capacity


def largest_batch(batch_sampler) -> int:
    """The longest batch of one pass over `batch_sampler` (0 for none), a pass that leaves no trace (DataLoader's
    own first pass is the first epoch's): over a shallow copy (a pass counter of its own advances on the copy), with
    the random generators it or its sampler hold (torch's, NumPy's, Python's) and Python's, NumPy's and torch's
    global ones put back after."""
    import copy

    try:
        probe = copy.copy(batch_sampler)
    except Exception:  # cannot be copied: its own state advances by one pass
        probe = batch_sampler
    owners = [probe, getattr(probe, "sampler", None)]
    held = [g for o in owners if o is not None and hasattr(o, "__dict__") for g in vars(o).values()]
    kept = [(restore, state) for restore, state in [*map(_saved, held), *_global_states()] if restore is not None]
    try:
        return max(map(len, probe), default=0)
    finally:
        for restore, state in kept:
            restore(state)


def _global_states() -> list:
    """(how to put it back, its state now) for Python's, NumPy's and torch's global generators."""
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
