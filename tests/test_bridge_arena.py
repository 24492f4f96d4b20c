"""The allocator bridge's native sub-allocator (kernels/lent_arena.h), built with the host compiler
and driven through its C API with made-up addresses (the arena never touches the memory).

The reference is independent: the free gaps of each region are recomputed from the live
allocations alone, and the arena must pick the smallest gap that fits at the requested alignment.
"""

import ctypes
import random

import pytest

from fusionflow import native

MIB = 1 << 20
NONE, MIXED = 2**64 - 2, 2**64 - 1
S1, S2 = 0x51, 0x52  # two "streams"


class Arena:
    def __init__(self, lib):
        self.lib, self.h = lib, lib.ff_arena_new()

    def lend(self, base, size):
        return native.call(self.lib.ff_arena_lend, self.h, base, size)

    def accept(self, on=True):
        self.lib.ff_arena_set_accepting(self.h, int(on))

    def alloc(self, n, align=256, stream=S1):
        tag = ctypes.c_uint64(0)
        err = ctypes.create_string_buffer(256)
        p = self.lib.ff_arena_allocate(self.h, n, align, stream, ctypes.byref(tag), err, 256)
        if err.value:
            raise native.BridgeError(err.value.decode())
        return p, tag.value

    def free(self, p, stream=S1):
        return native.call(self.lib.ff_arena_deallocate, self.h, p, stream)

    def reclaim(self, cap=64):
        bases, sizes = (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
        n = native.call(self.lib.ff_arena_reclaim, self.h, bases, sizes, cap)
        return sorted(zip(bases[:n], sizes[:n]))

    def stats(self):
        out = (ctypes.c_uint64 * 6)()
        self.lib.ff_arena_stats(self.h, out)
        return dict(zip(("lent", "live", "peak", "served", "allocations", "regions"), out))

    def close(self):
        self.lib.ff_arena_delete(self.h)


@pytest.fixture(scope="module")
def lib():
    return native.load_arena()


@pytest.fixture
def arena(lib):
    a = Arena(lib)
    yield a
    a.close()


def align_up(p, a):
    return (p + a - 1) // a * a


def gaps(regions, live):
    """Free gaps per region from the live allocations alone: [(size, start, region_base)]."""
    out = []
    for base, size in regions.items():
        cur = base
        for p, n in sorted((p, n) for p, n in live.items() if base <= p < base + size):
            if p > cur:
                out.append((p - cur, cur, base))
            cur = p + n
        if cur < base + size:
            out.append((base + size - cur, cur, base))
    return out


def expected_pointer(regions, live, n, align):
    fits = [(size, start) for size, start, base in gaps(regions, live) if align_up(start, align) + n <= start + size]
    if not fits:
        return 0
    best = min(size for size, _ in fits)
    return {align_up(start, align) for size, start in fits if size == best}


def test_serves_only_inside_an_open_window(arena):
    arena.lend(0x10000000, 4 * MIB)
    assert arena.alloc(MIB)[0] == 0  # no window open yet
    arena.accept()
    p, tag = arena.alloc(MIB)
    assert p == 0x10000000 and tag == NONE
    assert arena.stats()["live"] == MIB and arena.stats()["lent"] == 4 * MIB


def test_best_fit_alignment_and_no_merge_across_adjacent_regions(arena):
    # two blocks that touch in the address space (PyTorch splits segments): never one range
    arena.lend(0x1000000, 2 * MIB)
    arena.lend(0x1200000, 1 * MIB)
    arena.accept()
    p, _ = arena.alloc(MIB)  # the 1 MiB region is the best fit
    assert p == 0x1200000
    q, _ = arena.alloc(MIB + 1)  # does not fit across the boundary: from the 2 MiB region
    assert q == 0x1000000
    r, _ = arena.alloc(100, align=4096)  # leftover starts at 0x1100100 -> aligned up
    assert r == align_up(0x1000000 + MIB + 1, 4096)
    assert arena.alloc(2 * MIB)[0] == 0
    with pytest.raises(native.BridgeError, match="power of two"):
        arena.alloc(10, align=384)


def test_freed_on_stream_tags(arena):
    arena.lend(0x4000000, 4 * MIB)
    arena.accept()
    a, _ = arena.alloc(MIB, stream=S1)
    b, _ = arena.alloc(MIB, stream=S1)
    arena.free(a, stream=S1)
    assert arena.alloc(MIB, stream=S2) == (a, S1)  # reuse on S2 must wait for S1
    arena.free(a, stream=S2)
    arena.free(b, stream=S1)  # merges with a's range (S2) and the untouched tail
    p, tag = arena.alloc(3 * MIB, stream=S1)
    assert p == 0x4000000 and tag == MIXED


def test_reclaim_returns_idle_regions_and_keeps_pinned_ones(arena):
    arena.lend(0x1000000, MIB)
    arena.lend(0x3000000, 2 * MIB)
    arena.accept()
    held, _ = arena.alloc(4096)  # lands in the 1 MiB region (best fit)
    other, _ = arena.alloc(MIB + 5)
    arena.free(other, stream=S2)
    assert arena.reclaim() == [(0x3000000, 2 * MIB)]
    s = arena.stats()
    assert (s["lent"], s["regions"], s["live"]) == (MIB, 1, 4096)
    assert arena.alloc(16)[0] == 0  # window closed
    arena.free(held, stream=S2)  # the borrower lets go later
    arena.accept()
    p, tag = arena.alloc(MIB)
    assert p == 0x1000000 and tag == S2  # freed after the close: S2 is waited for
    arena.free(p)
    assert arena.reclaim() == [(0x1000000, MIB)]
    assert arena.stats()["lent"] == 0 and arena.stats()["served"] == 4096 + MIB + 5 + MIB


def test_reclaim_forgets_stream_tags_of_pinned_regions(arena):
    arena.lend(0x1000000, MIB)
    arena.accept()
    a, _ = arena.alloc(4096, stream=S1)
    b, _ = arena.alloc(4096, stream=S1)
    arena.free(a, stream=S1)
    assert arena.reclaim() == []  # b pins the region
    arena.accept()
    assert arena.alloc(4096, stream=S2) == (a, NONE)  # the close ordered S1 before the next window


def test_bad_calls_are_refused_without_damage(arena):
    arena.lend(0x1000000, MIB)
    for base, size in ((0x1000000 + 4096, 10), (0x1000000 - 10, 11), (0x2000000, 0)):
        with pytest.raises(native.BridgeError, match="overlaps|empty"):
            arena.lend(base, size)
    with pytest.raises(native.BridgeError, match="not served by the arena"):
        arena.free(0x1000000)
    arena.lend(0x2000000, MIB)
    with pytest.raises(native.BridgeError, match="smaller than the number of lent regions"):
        arena.reclaim(cap=1)
    assert arena.stats()["regions"] == 2  # nothing was handed back by the refused call
    assert arena.reclaim() == [(0x1000000, MIB), (0x2000000, MIB)]


@pytest.mark.parametrize("seed", range(6))
def test_random_against_gap_reference(arena, seed):
    rng = random.Random(seed)
    regions = {}
    base = 0x7F0000000000
    for _ in range(rng.randint(1, 5)):
        size = rng.choice([1, 2, 3, 8]) * MIB + rng.randrange(0, 4096, 512)
        regions[base] = size
        arena.lend(base, size)
        base += size + rng.choice([0, 0, 4096])  # some regions touch
    arena.accept()
    live = {}
    for _ in range(600):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            arena.free(p, stream=rng.choice([S1, S2]))
            del live[p]
        else:
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, MIB), rng.randint(MIB, 3 * MIB)])
            align = rng.choice([1, 256, 4096])
            want = expected_pointer(regions, live, n, align)
            p, _ = arena.alloc(n, align)
            if want == 0:
                assert p == 0
            else:
                assert p in want
                live[p] = n
        s = arena.stats()
        assert s["live"] == sum(live.values()) and s["allocations"] == len(live)
    idle = sorted((b, n) for b, n in regions.items() if not any(b <= p < b + n for p in live))
    assert arena.reclaim() == idle
    for p in list(live):
        arena.free(p)
    assert arena.reclaim() == sorted(set(regions.items()) - set(idle))
    assert arena.stats()["lent"] == 0
