"""The shared-memory batch ring: `depth` mini-batch slots that workers write samples into.

One POSIX shared-memory segment (posix_ipc) per loader, named ``/ff_<24 random hex>`` (not
guessable) and created with mode 0600. Layout, all C-contiguous:

    images  [depth, batch_size, *sample_shape]   policy's output dtype (uint8 or float32)
    labels  [depth, batch_size]                  int64

Ownership: the local manager creates and unlinks it; workers attach by name. If the training
process dies without unlinking, its orphaned workers unlink it (see runtime/worker.py), so the
name never outlives the job by more than a watchdog period.
"""
from __future__ import annotations

import mmap
import secrets
from dataclasses import dataclass

import numpy as np
import posix_ipc

PREFIX = "/ff_"


@dataclass(frozen=True)
class RingLayout:
    depth: int
    batch_size: int
    sample_shape: tuple[int, ...]
    dtype: str

    @property
    def image_bytes(self) -> int:
        return self.depth * self.batch_size * int(np.prod(self.sample_shape)) * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.image_bytes + self.depth * self.batch_size * 8


class BatchRing:
    """A mapping of the ring segment; `images` and `labels` are numpy views into it."""

    def __init__(self, layout: RingLayout, name: str | None = None):
        self.layout = layout
        self.owner = name is None
        if self.owner:
            name = PREFIX + secrets.token_hex(12)
            seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=layout.nbytes)
        else:
            seg = posix_ipc.SharedMemory(name)
        self.name = name
        try:
            self._map = mmap.mmap(seg.fd, layout.nbytes)
        finally:
            seg.close_fd()
        buf = np.frombuffer(self._map, np.uint8)
        shape = (layout.depth, layout.batch_size, *layout.sample_shape)
        self.images = buf[:layout.image_bytes].view(layout.dtype).reshape(shape)
        self.labels = buf[layout.image_bytes:layout.nbytes].view(np.int64).reshape(layout.depth, layout.batch_size)

    def unlink(self) -> None:
        unlink(self.name)

    def close(self) -> None:
        """Drop this process's mapping (views must not be used afterwards)."""
        self.images = self.labels = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported (e.g. a pinned tensor); the OS frees it at exit
                pass
            self._map = None


def unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
