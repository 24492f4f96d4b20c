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
    before = ff_segments()
    ring = BatchRing(LAYOUT)
    try:
        st = os.fstat(ring.fd)
        assert st.st_blocks * 512 >= LAYOUT.nbytes  # ftruncate alone would leave it sparse (0 blocks)
        assert ff_segments() == before  # its name is gone already: the descriptor is the handle
    finally:
        ring.close()


@pytest.mark.parametrize("where", ["mmap", "reserve"])
def test_an_interrupt_while_the_ring_is_made_leaves_no_segment_and_no_descriptor(monkeypatch, where):
    """Ctrl-C while the ring is being made (here: a KeyboardInterrupt from its mapping or its reservation) leaves
    nothing behind. It used to leave the ring's name in /dev/shm for good when it landed in the mapping (session
    33's sweep: a ring's size each time, GBs at real batch sizes)."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    opened = []
    real_shm = shm.posix_ipc.SharedMemory

    def recording(*args, **kwargs):
        seg = real_shm(*args, **kwargs)
        opened.append(seg.fd)
        return seg

    monkeypatch.setattr(shm.posix_ipc, "SharedMemory", recording)
    if where == "mmap":
        monkeypatch.setattr(shm.mmap, "mmap", interrupted)
    else:
        monkeypatch.setattr(shm, "reserve", interrupted)
    before, owned = ff_segments(), set(shm._OWNED_FDS)
    with pytest.raises(KeyboardInterrupt):
        BatchRing(LAYOUT)
    assert ff_segments() == before and shm._OWNED_FDS == owned
    with pytest.raises(OSError):
        os.fstat(opened[0])  # closed


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
