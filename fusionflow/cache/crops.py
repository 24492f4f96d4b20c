"""Refurbishing (`DecodedCache(reuse_crop_epochs=R)`): each sample's cropped and resized image kept for
the R epochs that reuse its crop, so those epochs skip the decode, the cache lookup and the resample,
and only draw and apply their own ops (Revamper's "refurbished" samples, USENIX ATC 2021).

What is reused is decided by the draw (policy/sampling.py `draw`: the crop, its filter and the flips
of epoch R * (epoch // R)), not here: every worker kind augments alike whether or not this store holds
the sample. The store only spares the work. It is one loader's (its crops depend on its seed and
policy), in a segment of its own: `len(dataset)` slots of the output size (uint8 HWC, before the
flip), each with a tag -- a hash of the crop's draw and the sample's content key, 0 while the slot is
being written. A reader
checks the tag before and after copying the slot (a seqlock: a write of the next period's crop by
another worker, e.g. the next epoch's speculation, makes it recompute, never read half of each).
Two workers writing one slot (a straggler's second copy) write the same pixels.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from fusionflow.cache.store import disown_all, map_shared
from fusionflow.runtime.shm import allocate

MAGIC = 0x46464352_4F505331  # "FFCROPS1"
HEADER = 8


def crop_tag(d, content: int) -> int:
    """A non-zero 62-bit tag of the draw's crop (its uniforms and filter; the flips are applied after) of the sample
    whose encoded bytes have `content` (cache/store.py content_key: a file replaced under the same index, or a
    dataset giving another image per epoch, is not served the old image's crop), the same in every process: Python
    hashes floats, ints and their tuples alike everywhere, but not None (its address, before 3.12) or a str
    (randomised per process), so those enter as codes."""
    resample = _RESAMPLE_CODES.get(d.crop_resample, len(_RESAMPLE_CODES))
    return (hash((d.crop_u, d.crops or (), resample, content)) & (2**62 - 1)) | 1


_RESAMPLE_CODES = {None: 0, "bilinear": 1, "bicubic": 2, "nearest": 3}


def crops_bytes(entries: int, size: tuple[int, int]) -> int:
    return (HEADER + entries) * 8 + entries * size[0] * size[1] * 3


class CropStore:
    def __init__(self, fd: int):
        self.fd = fd
        self._map, map_fds = map_shared(fd, os.fstat(fd).st_size)
        self._disown = weakref.finalize(self, disown_all, map_fds)  # as CacheStore's
        head = np.frombuffer(self._map, np.int64, HEADER)
        if head[0] != MAGIC:
            raise ValueError("not a FusionFlow crop store")
        n, h, w = (int(v) for v in head[1:4])
        self.tags = np.frombuffer(self._map, np.int64, n, HEADER * 8)
        self.slots = np.frombuffer(self._map, np.uint8, n * h * w * 3, (HEADER + n) * 8).reshape(n, h, w, 3)

    @classmethod
    def create(cls, fd: int, entries: int, size: tuple[int, int]) -> CropStore:
        """Size the segment and reserve every page now (it is refused up front if it cannot be had)."""
        total = crops_bytes(entries, size)
        os.ftruncate(fd, total)
        allocate(fd, 0, total)
        os.pwrite(fd, np.array([MAGIC, entries, *size, 0, 0, 0, 0], np.int64).tobytes(), 0)
        return cls(fd)

    def get(self, index: int, tag: int) -> np.ndarray | None:
        """A copy of sample `index`'s kept crop if it is the one `tag` names, else None."""
        if not 0 <= index < len(self.tags) or self.tags[index] != tag:
            return None
        out = self.slots[index].copy()
        return out if self.tags[index] == tag else None  # rewritten while copied: recompute

    def put(self, index: int, tag: int, arr: np.ndarray) -> None:
        if not 0 <= index < len(self.tags) or arr.shape != self.slots.shape[1:]:
            return
        self.tags[index] = 0
        self.slots[index] = arr
        self.tags[index] = tag

    def close(self) -> None:
        self.tags = self.slots = None
        self._disown()
        try:
            self._map.close()
        except BufferError:
            pass
