"""The shared-memory batch ring: reserved at creation, so a small /dev/shm fails there with a fix."""

import errno
import os

import pytest

from fusionflow import SharedMemoryError
from fusionflow.runtime import shm
from fusionflow.runtime.shm import BatchRing, RingLayout

LAYOUT = RingLayout(2, 16, (3, 64, 64), "uint8")


def ff_segments():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("ff_"))


def test_ring_pages_are_reserved_at_creation_not_sparse():
    ring = BatchRing(LAYOUT)
    try:
        st = os.stat("/dev/shm" + ring.name)
        assert st.st_blocks * 512 >= LAYOUT.nbytes  # ftruncate alone would leave it sparse (0 blocks)
    finally:
        ring.close()
        ring.unlink()


def test_too_little_free_space_fails_before_creating_anything(monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda path=shm.SHM_DIR: 64 * 2**20 - 1)
    big = RingLayout(2, 512, (3, 224, 224), "uint8")
    before = ff_segments()
    with pytest.raises(SharedMemoryError) as info:
        BatchRing(big)
    msg = str(info.value)
    assert f"({big.nbytes} bytes)" in msg and f"/dev/shm has 64.0 MiB ({64 * 2**20 - 1} bytes) free" in msg
    assert "--shm-size" in msg and "batch_size" in msg and "prefetch_factor=2" in msg
    assert ff_segments() == before


def test_failed_reservation_is_an_error_and_leaves_no_segment(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = ff_segments()
    with pytest.raises(SharedMemoryError, match=r"reserving it failed \(No space left on device\); /dev/shm has"):
        BatchRing(LAYOUT)
    assert ff_segments() == before


def test_filesystem_without_fallocate_falls_back_to_a_sparse_segment(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    ring = BatchRing(LAYOUT)
    ring.images[:] = 7
    ring.close()
    ring.unlink()
