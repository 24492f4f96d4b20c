"""The allocator bridge's block ledger: which GPU blocks PyTorch has lent to DALI, in POSIX shared
memory so that a lender and a borrower in another process could see one truth. The bridge
(accel/bridge/memory_bridge.py) keeps its ledger private (`private=True`: names unlinked at creation, since lender
and DALI live in one process), so no other process reads it; the named mode serves the tests and a
future cross-process borrower.

Each record: state, device, size, address, a 64-byte CUDA IPC handle (for a borrower in another
process), lender pid, borrower pid. Protocol, one training step at a time:

  PyTorch side (owner)   yield_blocks(free_blocks, budget)  lend free cached blocks, largest first,
                                                            up to `budget` bytes  -> LENT
  DALI side              borrow_block(size)                 best fit among LENT   -> BORROWED
                         release_block(address)             BORROWED              -> LENT
  PyTorch side           reclaim(timeout)                   before the next step: wait until nothing
                                                            is BORROWED (a dead borrower's blocks are
                                                            taken back), then every record -> FREE
                         take_back_released()               or, not waiting: LENT -> FREE now, what
                                                            is still BORROWED stays lent

The ledger is bookkeeping only: what a block *is* (from torch's caching allocator, an IPC handle)
is the torch/DALI sides' business (fusionflow/accel/bridge/, kernels/). One posix_ipc segment and one
semaphore (the lock), both named ``/ffl_<random>`` and created 0600; the owner unlinks both.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import posix_ipc

from fusionflow.runtime.procs import pid_alive

FREE, LENT, BORROWED = 0, 1, 2
LOCK_TIMEOUT_S = 5.0
_HEADER = struct.Struct("<II")  # capacity, records in use (high-water mark)
_RECORD = struct.Struct("<BxxxiQQ64sii")  # state, device, size, address, ipc handle, lender, borrower


@dataclass(frozen=True)
class Block:
    address: int
    size: int
    device: int = 0
    handle: bytes = b""  # CUDA IPC handle (64 bytes) when the borrower is another process


def select_blocks(free: list[Block], budget: int) -> list[Block]:
    """Largest first, each whole, until the next would exceed `budget` bytes (pure)."""
    chosen, total = [], 0
    for block in sorted(free, key=lambda b: (-b.size, b.address)):
        if total + block.size <= budget:
            chosen.append(block)
            total += block.size
    return chosen


class BlockLedger:
    def __init__(self, capacity: int = 1024, name: str | None = None, private: bool = False):
        """Create (name None) or attach to (`name`) a ledger. `private`: the creator unlinks both names
        at once -- nothing to leave behind if the process is SIGKILLed -- and no other process can
        attach (the bridge: lender and DALI borrower live in one process)."""
        self.owner = name is None
        self.name = name or "/ffl_" + secrets.token_hex(12)
        size = _HEADER.size + capacity * _RECORD.size
        if self.owner:
            seg = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600, size=size)
            self._lock = posix_ipc.Semaphore(self.name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
        else:
            seg = posix_ipc.SharedMemory(self.name)
            self._lock = posix_ipc.Semaphore(self.name)
        try:
            self._map = mmap.mmap(seg.fd, seg.size)
        finally:
            seg.close_fd()
        if self.owner:
            _HEADER.pack_into(self._map, 0, capacity, 0)
            if private:
                self._unlink_names()
        self.capacity = _HEADER.unpack_from(self._map, 0)[0]

    # ------------------------------------------------------------ records (lock held)
    def _read(self, i: int):
        return list(_RECORD.unpack_from(self._map, _HEADER.size + i * _RECORD.size))

    def _write(self, i: int, rec) -> None:
        _RECORD.pack_into(self._map, _HEADER.size + i * _RECORD.size, *rec)

    def _used(self) -> int:
        return _HEADER.unpack_from(self._map, 0)[1]

    def _records(self):
        return [(i, self._read(i)) for i in range(self._used())]

    def __enter__(self):
        try:
            self._lock.acquire(LOCK_TIMEOUT_S)  # held for microseconds; a long wait means a holder died in it
        except posix_ipc.BusyError:
            raise RuntimeError(
                f"block ledger {self.name} lock not acquired within {LOCK_TIMEOUT_S} s: a process "
                "probably died while holding it; restart the job"
            ) from None
        return self

    def __exit__(self, *exc):
        self._lock.release()

    # ------------------------------------------------------------ PyTorch side
    def yield_blocks(self, free: list[Block], budget: int) -> list[Block]:
        """Lend free blocks, largest first, up to `budget` bytes; returns what was lent."""
        lent = select_blocks(free, budget)
        self._put(lent, LENT, 0)
        return lent

    def lend_to_self(self, blocks: list[Block]) -> None:
        """Record `blocks` as lent and borrowed by this process, in one pass: the in-process bridge,
        whose lender hands its blocks straight to its own DALI (one `borrow_block` per block would
        scan the ledger once per block)."""
        self._put(blocks, BORROWED, os.getpid())

    def _put(self, blocks: list[Block], state: int, borrower: int) -> None:
        if not blocks:
            return
        me = os.getpid()
        with self:
            used = self._used()
            free = [i for i, r in self._records() if r[0] == FREE]
            if len(blocks) > len(free) + self.capacity - used:  # all or nothing
                raise RuntimeError(f"block ledger full ({self.capacity} records)")
            slots = iter(free)
            for block in blocks:
                i = next(slots, None)
                if i is None:
                    i, used = used, used + 1
                self._write(
                    i, [state, block.device, block.size, block.address, block.handle.ljust(64, b"\0"), me, borrower]
                )
            _HEADER.pack_into(self._map, 0, self.capacity, used)

    def reclaim(self, timeout: float = 5.0, poll: float = 0.001) -> list[Block]:
        """Take every lent block back; waits for borrowers to release (a dead borrower's blocks
        are taken at once). Raises TimeoutError naming the holders if a live one does not."""
        deadline = time.monotonic() + timeout
        while True:
            with self:
                held = [(i, r) for i, r in self._records() if r[0] == BORROWED and pid_alive(r[6])]
                if not held:
                    back = [Block(r[3], r[2], r[1], r[4].rstrip(b"\0")) for _, r in self._records() if r[0] != FREE]
                    for i, r in self._records():
                        r[0], r[6] = FREE, 0
                        self._write(i, r)
                    _HEADER.pack_into(self._map, 0, self.capacity, 0)
                    return back
            if time.monotonic() > deadline:
                who = sorted({r[6] for _, r in held})
                raise TimeoutError(f"{len(held)} lent GPU blocks still borrowed by pid(s) {who} after {timeout} s")
            time.sleep(poll)

    def take_back_released(self) -> list[Block]:
        """Take back, without waiting, every lent block no borrower holds (a dead borrower's
        included); blocks still borrowed stay lent. The in-process bridge's close: DALI keeps the
        blocks it still uses, the rest go back to PyTorch now."""
        with self:
            back = []
            for i, r in self._records():
                if r[0] == LENT or (r[0] == BORROWED and not pid_alive(r[6])):
                    back.append(Block(r[3], r[2], r[1], r[4].rstrip(b"\0")))
                    r[0], r[6] = FREE, 0
                    self._write(i, r)
            return back

    # ------------------------------------------------------------ DALI side
    def borrow_block(self, size: int) -> Block | None:
        """The smallest lent block of at least `size` bytes, now borrowed by this process."""
        with self:
            fits = [(r[2], r[3], i, r) for i, r in self._records() if r[0] == LENT and r[2] >= size]
            if not fits:
                return None
            _, _, i, r = min(fits)
            r[0], r[6] = BORROWED, os.getpid()
            self._write(i, r)
            return Block(r[3], r[2], r[1], r[4].rstrip(b"\0"))

    def release_blocks(self, addresses) -> list[int]:
        """Release every block of `addresses` this process borrowed, in one pass; returns the
        addresses that were not borrowed (by anyone)."""
        wanted = set(addresses)
        with self:
            for i, r in self._records():
                if r[0] == BORROWED and r[3] in wanted:
                    wanted.discard(r[3])
                    r[0], r[6] = LENT, 0
                    self._write(i, r)
        return sorted(wanted)

    def release_block(self, address: int) -> None:
        with self:
            for i, r in self._records():
                if r[0] == BORROWED and r[3] == address:
                    r[0], r[6] = LENT, 0
                    self._write(i, r)
                    return
        raise KeyError(f"block at {address:#x} is not borrowed")

    # ------------------------------------------------------------ accounting and lifetime
    def totals(self) -> dict:
        with self:
            recs = [r for _, r in self._records()]
        return {
            "lent_bytes": sum(r[2] for r in recs if r[0] in (LENT, BORROWED)),
            "borrowed_bytes": sum(r[2] for r in recs if r[0] == BORROWED),
        }

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment and the semaphore."""
        if self._map is not None:
            self._map.close()
            self._map = None
        self._lock.close()
        if self.owner:
            self._unlink_names()

    def _unlink_names(self) -> None:
        for unlink in (posix_ipc.unlink_shared_memory, posix_ipc.unlink_semaphore):
            try:
                unlink(self.name)
            except posix_ipc.ExistentialError:
                pass
