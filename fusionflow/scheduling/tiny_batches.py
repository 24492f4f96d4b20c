"""Mini-batch -> tiny-batches sorted by aggregate encoded size.

Consecutive samples of the mini-batch (in sampler order) form tiny-batches of `tiny_batch_size`
(the last may be shorter); the list is sorted ascending by the tiny-batches' total encoded bytes,
ties broken by position, so the order is deterministic. CPU workers take from the front (smallest
first); the GPU worker takes from the back (largest first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TinyBatch:
    positions: tuple[int, ...]  # where its samples go in the mini-batch
    indices: tuple[int, ...]  # their dataset indices
    nbytes: int  # total encoded size (0 where unknown)
    copies: tuple[int, ...] = ()  # their copy numbers (Copies); () when all are 0


def split_sorted(
    indices: Sequence[int], sizes: Sequence[int] | None, tiny_batch_size: int, copies: Sequence[int] | None = None
) -> list[TinyBatch]:
    if tiny_batch_size < 1:
        raise ValueError(f"tiny_batch_size={tiny_batch_size} must be >= 1")
    tiny = []
    for start in range(0, len(indices), tiny_batch_size):
        idx = tuple(int(i) for i in indices[start : start + tiny_batch_size])
        nbytes = sum(int(sizes[i]) for i in idx if i < len(sizes)) if sizes is not None else 0  # a grown dataset
        cps = tuple(int(c) for c in copies[start : start + tiny_batch_size]) if copies is not None else ()
        tiny.append(TinyBatch(tuple(range(start, start + len(idx))), idx, nbytes, cps if any(cps) else ()))
    tiny.sort(key=lambda t: (t.nbytes, t.positions[0]))
    return tiny


class Copies:
    """Copy numbers for repeated augmentation: a sampler such as timm's/torchvision's RASampler
    yields an index several times per epoch, and each occurrence must be augmented differently.

    The copy number of a sample is ``occurrence * world_size + rank``: `occurrence` counts the
    index's earlier appearances in this epoch's sampler order on this rank (0 for the first), and
    the rank tells apart the copies that a distributed sampler deals to different ranks (RASampler
    deals the 3 copies of an index to 3 ranks, where each is its rank's first occurrence). Copy 0
    -- every sample of an ordinary single-process sampler, and rank 0's first occurrences -- keeps
    the draw it always had. Pure: the same sampler order gives the same numbers; one per epoch.
    """

    def __init__(self, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in 0..world_size-1={world_size - 1}")
        self.rank, self.world_size = rank, world_size
        self._seen = np.zeros(0, np.uint32)  # occurrences so far, by dataset index

    def __call__(self, indices: Sequence[int]) -> list[int]:
        """The copy numbers of the next batch of the epoch's sampler order."""
        top = max((int(i) for i in indices), default=-1)
        if top >= len(self._seen):
            self._seen = np.concatenate(
                [self._seen, np.zeros(max(top + 1, 2 * len(self._seen)) - len(self._seen), np.uint32)]
            )
        out = []
        for i in map(int, indices):
            occurrence = int(self._seen[i])
            self._seen[i] += 1
            out.append(occurrence * self.world_size + self.rank)
        return out
