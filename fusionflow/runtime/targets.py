"""Targets (labels) of any type, delivered as DataLoader delivers them.

The mode is decided per sample, where the sample is read (a CPU worker, the accelerator, or the
training process with num_workers=0):

  * a Python `int` within int64 (class indices: ImageFolder, most datasets) is written into the
    batch ring's int64 label slot -- the shared-memory fast path, nothing pickled;
  * any other target (a float, a numpy scalar, a tensor -- one-hot or soft labels --, a string, a
    dict, a tuple, ...) travels pickled with its tiny-batch's completion message, as
    `{position: target}`. Targets are small; pixels never travel this way.

The training process then delivers a mini-batch's targets in sampler order: when every kept sample's
target was an int (the common case) as the ring's int64 tensor, exactly what `default_collate` makes
of Python ints; otherwise it rebuilds the list of targets -- ring ints as Python ints, the others as
they arrived -- and collates it with `torch.utils.data.default_collate`, so floats arrive as float64,
tensors stacked, strings as lists, dicts and tuples collated per key / field, exactly as DataLoader
would deliver them. A mini-batch whose targets are all None (samples without targets: `sample_keys=(image
key,)`, a shard set's `target_key=None`) delivers None in their place. A dataset whose items are the image
alone, or (image, a, b, ...), has its samples' targets marked (`NO_TARGET`, `Columns`: runtime/sample.py
split_item) and its batches shaped as default_collate shapes them (`batch_of`).
"""

from __future__ import annotations

import numpy as np

from fusionflow.scheduling.queue import positions_of

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Columns(tuple):
    """A sample's targets when dataset[i] was (sample, a, b, ...): (a, b, ...), delivered as default_collate
    delivers such samples -- [images, a's, b's, ...] -- and given to a collate_fn as (image, a, b, ...)."""

    __slots__ = ()

    def __reduce__(self):
        return Columns, (tuple(self),)


class NoTarget:
    """The target of a bare sample (dataset[i] was the image alone): the batch is the images tensor alone, as
    default_collate makes it. One instance, `NO_TARGET`, kept by pickling."""

    __slots__ = ()

    def __reduce__(self):
        return "NO_TARGET"

    def __repr__(self) -> str:
        return "NO_TARGET"


NO_TARGET = NoTarget()


def batch_of(images, targets):
    """The delivered batch, shaped as default_collate shapes the dataset's samples: [images, targets], the
    images alone (bare samples), or [images, a's, b's, ...] (samples of several targets)."""
    if targets is NO_TARGET:
        return images
    return [images, *targets] if type(targets) is Columns else [images, targets]


def sample_of(image, target):
    """One sample for a collate_fn, shaped as the dataset returned it."""
    if target is NO_TARGET:
        return image
    return (image, *target) if type(target) is Columns else (image, target)


def in_ring(target) -> bool:
    """Does this target take the shared-memory fast path? (bool is an int subclass but collates to a
    bool tensor, and numpy integers collate to their own dtype: those go the general way.)"""
    return type(target) is int and INT64_MIN <= target <= INT64_MAX


def store(labels_row, position: int, target, side: dict) -> None:
    """Put one sample's target where it travels: the ring's label slot, or `side` ({position: target})."""
    if in_ring(target):
        labels_row[position] = target
    else:
        side[position] = target


def store_works(ring_labels, works, targets) -> list:
    """Store `targets` (in the order of the works' positions) for each work's ring slot; returns
    [(work, its side dict of targets that are not ints)], as `complete` takes them. When every target
    is a ring int (the common case), one array assignment stores them all."""
    if targets and set(map(type, targets)) == {int}:
        try:
            values = np.asarray(targets, np.int64)
        except OverflowError:  # beyond int64: the per-sample path sends those on the side
            values = None
        if values is not None:
            slots = np.repeat([w.slot for w in works], list(map(len, map(positions_of, works))))
            ring_labels[slots, [p for w in works for p in w.positions]] = values
            return [(w, {}) for w in works]
    done, k = [], 0
    for work in works:
        side = {}
        for pos in work.positions:
            store(ring_labels[work.slot], pos, targets[k], side)
            k += 1
        done.append((work, side))
    return done


def gather(labels_row, positions, side: dict) -> list:
    """The targets of `positions` (in order) as the dataset returned them: ring ints as Python ints."""
    return [side[p] if p in side else int(labels_row[p]) for p in positions]


def collate(objs: list, device=None, pin_memory: bool = False):
    """Targets that are not all ints, as DataLoader delivers them: default_collate, then each tensor
    moved to `device` (a torch.device, or None to stay on the host), else pinned if `pin_memory`."""
    from torch.utils.data import default_collate

    if all(o is None for o in objs):  # samples without targets (sample_keys=(image key,), target_key=None)
        return None
    if len(set(map(_shape, objs))) > 1:
        raise TypeError(
            "one batch holds samples of different shapes (bare samples, (sample, target) pairs, "
            "(sample, target, ...) of different lengths): every dataset[i] must have one shape"
        )
    if objs and objs[0] is NO_TARGET:
        return NO_TARGET
    collated = default_collate(tuple(objs))  # DataLoader collates a column of zip(*batch): a tuple
    # (so strings arrive as a tuple of str, exactly as DataLoader delivers a (sample, str) dataset's)
    collated = Columns(collated) if objs and type(objs[0]) is Columns else collated  # its columns, marked
    if device is not None:
        return map_tensors(collated, lambda t: t.to(device))
    if pin_memory:
        return map_tensors(collated, lambda t: t.pin_memory())
    return collated


def _shape(target):
    """The shape of the sample a target came with: "bare", "pair", or its targets' count."""
    return "bare" if target is NO_TARGET else len(target) if type(target) is Columns else "pair"


def map_tensors(obj, fn):
    """`fn` applied to every tensor in a collated structure (dicts, lists, tuples, namedtuples)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return out if type(obj) is dict else type(obj)(out)
        except TypeError:  # a mapping that cannot be built from a dict: as default_collate does
            return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj
