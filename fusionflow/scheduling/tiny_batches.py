"""Mini-batch -> tiny-batches sorted by aggregate encoded size.

Consecutive samples of the mini-batch (in sampler order) form tiny-batches of `tiny_batch_size`
(the last may be shorter); the list is sorted ascending by the tiny-batches' total encoded bytes,
ties broken by position, so the order is deterministic. CPU workers take from the front (smallest
first); the GPU worker takes from the back (largest first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class TinyBatch:
    positions: tuple[int, ...]  # where its samples go in the mini-batch
    indices: tuple[int, ...]  # their dataset indices
    nbytes: int  # total encoded size (0 where unknown)


def split_sorted(indices: Sequence[int], sizes: Sequence[int] | None, tiny_batch_size: int) -> list[TinyBatch]:
    if tiny_batch_size < 1:
        raise ValueError(f"tiny_batch_size={tiny_batch_size} must be >= 1")
    tiny = []
    for start in range(0, len(indices), tiny_batch_size):
        idx = tuple(int(i) for i in indices[start:start + tiny_batch_size])
        nbytes = sum(int(sizes[i]) for i in idx) if sizes is not None else 0
        tiny.append(TinyBatch(tuple(range(start, start + len(idx))), idx, nbytes))
    tiny.sort(key=lambda t: (t.nbytes, t.positions[0]))
    return tiny
