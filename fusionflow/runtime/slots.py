"""SlotPool: the free slots of the batch ring, as one iteration sees them. The iteration takes a slot
for each mini-batch it submits and gives it back once the batch is delivered (or, on the GPU path,
once its copies are done); at the epoch's end it offers what is free to the loader's next-epoch
speculation, which takes slots from the same pool. A SharedLoader's epoch starts with the
slots its clients do not hold and gives a slot back when the last client releases it. One owner: the
iterator; the others are handed the pool, never a list to edit.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotPool:
    def __init__(self, slots: Iterable[int]):
        self._free = list(slots)

    def __len__(self) -> int:
        return len(self._free)

    def __bool__(self) -> bool:
        return bool(self._free)

    def __contains__(self, slot: int) -> bool:
        return slot in self._free

    def take(self) -> int:
        """The free slot that has been free longest (IndexError when none is)."""
        return self._free.pop(0)

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def withdraw(self, slots: Iterable[int]) -> None:
        """These slots are in use elsewhere (mini-batches the previous epoch speculated into them)."""
        used = set(slots)
        self._free = [s for s in self._free if s not in used]
