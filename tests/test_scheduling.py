"""Tiny-batch split and sort: every position exactly once, sorted by bytes, deterministic."""

import itertools

import numpy as np
import pytest

from fusionflow.scheduling import split_sorted


@pytest.mark.parametrize("n,k", list(itertools.product(range(0, 13), range(1, 6))))
def test_split_covers_every_position_once_and_sorts(n, k):
    rng = np.random.default_rng(n * 10 + k)
    sizes = rng.integers(1, 1000, 50).tolist()
    indices = rng.choice(50, n, replace=False).tolist()
    tiny = split_sorted(indices, sizes, k)
    positions = [p for t in tiny for p in t.positions]
    assert sorted(positions) == list(range(n))
    assert len(tiny) == -(-n // k) and all(1 <= len(t.positions) <= k for t in tiny)
    for t in tiny:
        assert list(t.indices) == [indices[p] for p in t.positions]
        assert t.nbytes == sum(sizes[i] for i in t.indices)
        assert list(t.positions) == list(range(t.positions[0], t.positions[0] + len(t.positions)))
    keys = [(t.nbytes, t.positions[0]) for t in tiny]
    assert keys == sorted(keys)


def test_unknown_sizes_keep_sampler_order():
    tiny = split_sorted([9, 3, 7, 1, 5], None, 2)
    assert [t.indices for t in tiny] == [(9, 3), (7, 1), (5,)]


def test_bad_tiny_batch_size():
    with pytest.raises(ValueError, match="tiny_batch_size=0 must be >= 1"):
        split_sorted([1, 2], None, 0)
