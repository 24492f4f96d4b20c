"""The allocator bridge's block ledger, across processes, without a GPU."""

import multiprocessing as mp
import os
import re
import signal

import pytest

from fusionflow.accel.bridge.ledger import Block, BlockLedger, select_blocks

MIB = 1 << 20
FREE = [Block(0x1000, 64 * MIB), Block(0x9000, 2 * MIB), Block(0x5000, 20 * MIB), Block(0x7000, 20 * MIB)]


@pytest.fixture
def ledger():
    led = BlockLedger(capacity=8)
    yield led
    led.close()
    assert not os.path.exists("/dev/shm" + led.name) and not os.path.exists("/dev/shm/sem." + led.name[1:])


def test_select_largest_first_within_budget():
    assert [b.size for b in select_blocks(FREE, 90 * MIB)] == [64 * MIB, 20 * MIB, 2 * MIB]
    assert select_blocks(FREE, MIB) == []
    assert select_blocks(FREE, 10**12) == sorted(FREE, key=lambda b: (-b.size, b.address))


def test_yield_borrow_release_reclaim(ledger):
    lent = ledger.yield_blocks(FREE, 90 * MIB)
    assert ledger.totals() == {"lent_bytes": 86 * MIB, "borrowed_bytes": 0}
    b = ledger.borrow_block(10 * MIB)
    assert b.size == 20 * MIB  # best fit, not the largest
    assert ledger.borrow_block(30 * MIB).size == 64 * MIB
    assert ledger.borrow_block(30 * MIB) is None
    assert ledger.totals()["borrowed_bytes"] == 84 * MIB
    with pytest.raises(TimeoutError, match=r"2 lent GPU blocks still borrowed by pid\(s\) \[\d+\]"):
        ledger.reclaim(timeout=0.05)
    ledger.release_block(b.address)
    ledger.release_block(0x1000)
    with pytest.raises(KeyError):
        ledger.release_block(0x1000)
    back = ledger.reclaim(timeout=1)
    assert sorted(back, key=lambda x: x.address) == sorted(lent, key=lambda x: x.address)
    assert ledger.totals() == {"lent_bytes": 0, "borrowed_bytes": 0}
    assert ledger.yield_blocks(FREE, 10**12) and ledger.totals()["lent_bytes"] == 106 * MIB  # slots reused


def test_take_back_released_keeps_what_is_still_borrowed(ledger):
    ledger.yield_blocks(FREE, 10**12)
    held = ledger.borrow_block(30 * MIB)  # the 64 MiB block
    done = ledger.borrow_block(MIB)  # the 2 MiB block, released below
    ledger.release_block(done.address)
    back = ledger.take_back_released()
    assert sorted(b.size for b in back) == [2 * MIB, 20 * MIB, 20 * MIB]
    assert ledger.totals() == {"lent_bytes": 64 * MIB, "borrowed_bytes": 64 * MIB}
    assert ledger.take_back_released() == []
    ledger.release_block(held.address)
    assert [b.address for b in ledger.take_back_released()] == [held.address]
    assert ledger.totals() == {"lent_bytes": 0, "borrowed_bytes": 0}
    assert len(ledger.yield_blocks(FREE, 10**12)) == 4  # every record is free for reuse


def test_ledger_full(ledger):
    with pytest.raises(RuntimeError, match="ledger full"):
        ledger.yield_blocks([Block(i, 1) for i in range(9)], 100)


def _borrower(name, size, conn, hold):
    led = BlockLedger(name=name)
    b = led.borrow_block(size)
    conn.send(b.address if b else None)
    if hold == "release":
        conn.recv()
        led.release_block(b.address)
        conn.send("released")
        conn.recv()
    else:
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the block


def test_other_process_borrows_and_releases(ledger):
    ledger.yield_blocks(FREE, 10**12)
    parent, child = mp.Pipe()
    p = mp.get_context("fork").Process(target=_borrower, args=(ledger.name, 50 * MIB, child, "release"))
    p.start()
    assert parent.recv() == 0x1000
    assert ledger.totals()["borrowed_bytes"] == 64 * MIB
    with pytest.raises(TimeoutError):
        ledger.reclaim(timeout=0.05)
    parent.send("go")
    assert parent.recv() == "released"
    assert len(ledger.reclaim(timeout=1)) == 4
    parent.send("bye")
    p.join(5)


def test_dead_borrowers_blocks_are_reclaimed(ledger):
    ledger.yield_blocks(FREE, 10**12)
    parent, child = mp.Pipe()
    p = mp.get_context("fork").Process(target=_borrower, args=(ledger.name, MIB, child, "die"))
    p.start()
    assert parent.recv() == 0x9000
    p.join(5)
    assert len(ledger.reclaim(timeout=1)) == 4


def test_names_are_private(ledger):
    assert re.fullmatch(r"/ffl_[0-9a-f]{24}", ledger.name)
    assert os.stat("/dev/shm" + ledger.name).st_mode & 0o777 == 0o600


def test_lock_held_by_a_dead_process_is_reported(ledger, monkeypatch):
    import fusionflow.accel.bridge.ledger as L

    monkeypatch.setattr(L, "LOCK_TIMEOUT_S", 0.05)
    ledger._lock.acquire()  # as if a process died inside the critical section
    try:
        with pytest.raises(RuntimeError, match="lock not acquired within 0.05 s"):
            ledger.totals()
    finally:
        ledger._lock.release()


def test_bulk_lend_to_self_and_release(ledger):
    """The in-process bridge's bulk calls: blocks recorded borrowed by this process in one pass,
    released in one pass (unknown addresses reported, not raised), then taken back."""
    ledger.lend_to_self(FREE[:3])
    assert ledger.totals() == {"lent_bytes": 86 * MIB, "borrowed_bytes": 86 * MIB}
    assert ledger.release_blocks([0x1000, 0x5000, 0xDEAD]) == [0xDEAD]
    assert sorted(b.address for b in ledger.take_back_released()) == [0x1000, 0x5000]
    assert ledger.totals() == {"lent_bytes": 2 * MIB, "borrowed_bytes": 2 * MIB}
    ledger.lend_to_self(FREE)  # freed records are reused first
    with pytest.raises(RuntimeError, match=r"block ledger full \(8 records\)"):
        ledger.lend_to_self(FREE)
    assert ledger.totals()["lent_bytes"] == 108 * MIB  # nothing of the refused call was recorded
    assert ledger.release_blocks([b.address for b in FREE]) == []


def test_private_ledger_leaves_no_name_even_while_open():
    led = BlockLedger(capacity=8, private=True)
    try:
        assert not os.path.exists("/dev/shm" + led.name) and not os.path.exists("/dev/shm/sem." + led.name[1:])
        led.yield_blocks([Block(0x1000, 4 * MIB)], 8 * MIB)  # the mapping and the lock still work
        assert led.borrow_block(MIB) is not None
    finally:
        led.close()
