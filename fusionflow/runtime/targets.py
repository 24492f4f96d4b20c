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

import collections
import functools

import numpy as np

from fusionflow.scheduling.queue import positions_of

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Columns(tuple):
    """A sample's targets when dataset[i] was (sample, a, b, ...): (a, b, ...), delivered as default_collate
    delivers such samples -- [images, a's, b's, ...] -- and given to a collate_fn as (image, a, b, ...)."""

    __slots__ = ()

    def __reduce__(self):
        return Columns, (tuple(self),)


class Fields:
    """A sample's targets when dataset[i] was a namedtuple (sample, a, ...): its class `kind` and (a, ...),
    delivered as default_collate delivers namedtuples -- kind(images, a's, ...) -- and given to a collate_fn
    as kind(image, a, ...)."""

    __slots__ = ("kind", "values")

    def __init__(self, kind: type, values):
        self.kind, self.values = kind, tuple(values)

    def __reduce__(self):  # the class by its names: a process that cannot import it (a Ray actor, a SharedLoader
        # client: another script's __main__) makes a namedtuple of the same name and fields (`_named`)
        kind = self.kind
        return _fields_of, (kind.__module__, kind.__qualname__, tuple(kind._fields), self.values)

    def __eq__(self, other) -> bool:
        return type(other) is Fields and (self.kind, self.values) == (other.kind, other.values)

    def __hash__(self) -> int:
        return hash((self.kind, self.values))


def _fields_of(module: str, qualname: str, names: tuple, values) -> Fields:
    return Fields(_named(module, qualname, names), values)


def _named(module: str, qualname: str, names: tuple) -> type:
    """The namedtuple class `module.qualname` if this process can import it with those fields (looked up each time:
    a notebook may define it anew), else one made here with the same name and fields (`_stand_in`)."""
    import importlib

    try:
        kind = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
        if isinstance(kind, type) and tuple(getattr(kind, "_fields", ())) == names:
            return kind
    except (ImportError, AttributeError):
        pass
    return _stand_in(module, qualname, names)


@functools.cache
def _stand_in(module: str, qualname: str, names: tuple) -> type:
    """Made once: the batches of a class this process cannot import are all of one class."""
    kind = collections.namedtuple(qualname.rpartition(".")[2], names)
    kind.__module__, kind.__qualname__ = module, qualname
    return kind


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
    if type(targets) is Fields:
        return targets.kind(images, *targets.values)
    return [images, *targets] if type(targets) is Columns else [images, targets]


def sample_of(image, target):
    """One sample for a collate_fn, shaped as the dataset returned it."""
    if target is NO_TARGET:
        return image
    if type(target) is Fields:
        return target.kind(image, *target.values)
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
    named = objs[0].kind if objs and type(objs[0]) is Fields else None
    collated = default_collate(tuple(o.values for o in objs) if named else tuple(objs))  # DataLoader collates a
    # column of zip(*batch): a tuple (so strings arrive as a tuple of str, as DataLoader delivers a (sample, str)'s)
    if device is not None:
        collated = map_tensors(collated, lambda t: t.to(device))
    elif pin_memory:
        collated = map_tensors(collated, lambda t: t.pin_memory())
    if named:
        return Fields(named, collated)
    return Columns(collated) if objs and type(objs[0]) is Columns else collated  # its columns, marked


def _shape(target):
    """The shape of the sample a target came with: "bare", "pair", or its targets' count."""
    if type(target) is Fields:
        return (target.kind, len(target.values))
    return "bare" if target is NO_TARGET else len(target) if type(target) is Columns else "pair"


def is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


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
    if is_namedtuple(obj):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj
