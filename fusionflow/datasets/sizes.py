"""A dataset's `sizes` (each sample's encoded bytes: the tiny-batches are sorted by them), checked before use.

A `sizes` that is not one number >= 0 per sample ((width, height) pairs, too few, NaN, a method) used to fail an
epoch with a bare TypeError or IndexError that never named it; it is now ignored, with a warning naming the user's
dataset class once, and the tiny-batches go unsorted."""

from __future__ import annotations

import warnings

import numpy as np

WARNED: set = set()  # the user's dataset classes whose `sizes` were said to be ignored (once each)


def encoded_sizes(dataset) -> list[int] | None:
    """`dataset.sizes` as a list of ints, or None when the dataset has none or they are not len(dataset) numbers
    >= 0 (then warned once per user dataset class)."""
    sizes = getattr(dataset, "sizes", None)
    if sizes is None:
        return None
    why = None
    try:
        values = np.asarray(sizes)
        if values.ndim != 1 or values.dtype.kind not in "iuf" or len(values) != len(dataset):
            shape = f" of shape {values.shape} and dtype {values.dtype}" if values.ndim else ""
            why = f"a {type(sizes).__name__}{shape}"
        elif not (np.isfinite(values).all() and (values >= 0).all()):
            why = "with negative or non-finite values"
    except Exception as exc:  # a method, a generator, ragged lists
        why = f"a {type(sizes).__name__} ({type(exc).__name__}: {exc})"
    if why is None:
        return values.astype(np.int64).tolist()
    user = user_dataset(dataset)
    if type(user) not in WARNED:
        WARNED.add(type(user))
        warnings.warn(
            f"fusionflow: {type(user).__name__}.sizes is {why}, not one encoded size in bytes per sample "
            f"({len(dataset)}): ignored, so tiny-batches are not sorted by size (rename the attribute if it means "
            "something else)",
            UserWarning,
            stacklevel=3,
        )
    return None


def user_dataset(dataset):
    """The user's dataset inside FusionFlow's views of it (ReadAhead, DictSamples, SplitViews: their `.dataset`)."""
    while type(dataset).__module__.startswith("fusionflow.datasets") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset
