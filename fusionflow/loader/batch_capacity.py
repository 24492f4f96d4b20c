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
    the random generators it or its sampler hold and Python's, NumPy's and torch's global ones put back after."""
    import copy
    import random

    import numpy as np

    try:
        probe = copy.copy(batch_sampler)
    except Exception:  # cannot be copied: its own state advances by one pass
        probe = batch_sampler
    owners = [probe, getattr(probe, "sampler", None)]
    held = [g for o in owners if o is not None and hasattr(o, "__dict__") for g in vars(o).values()]
    generators = [g for g in held if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators], random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        return max(map(len, probe), default=0)
    finally:
        for g, state in zip(generators, states[0]):
            g.set_state(state)
        random.setstate(states[1])
        np.random.set_state(states[2])
        torch.set_rng_state(states[3])
