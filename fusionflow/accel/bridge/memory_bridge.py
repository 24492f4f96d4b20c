"""The allocator bridge: PyTorch lends its free cached GPU blocks to DALI for the prep window of
each iteration and takes them back before the training step needs them (temporal GPU sharing).

Route (see issue 6): DALI runs in the training process (the accelerator thread), so the bridge is
a DALI device memory resource (kernels/dali_bridge_resource.cc, installed with the stock
libdali_core's SetDefaultDeviceResource) that serves DALI's allocations from the lent blocks and
passes the rest to DALI's own pool. The blocks DALI holds are also recorded in a `BlockLedger`,
private to this process: its shared-memory names are unlinked at creation, so nothing outlives a
SIGKILL and no other process can attach or read it. Nothing reads it today (the bridge's stats come
from its own bookkeeping); it is kept as the protocol a borrower in another process would use
(`BlockLedger(name=...)`, tests/test_ledger.py), the one the bridge would switch to for such a
borrower. There is no command that shows it.

One window, driven by the loader at every next() in temporal mode:
  arm(stream)     the training thread has queued its step; `stream` is its current CUDA stream
  lend()          (accelerator thread, before its first tiny-batch of the window) PyTorch's free
                  blocks -> the native resource -> an event on PyTorch's stream that DALI's
                  streams wait for; the ledger records them BORROWED by this process
  close()         (training thread, once the mini-batch is ready, before anything is allocated
                  for it) the native resource stops serving, PyTorch's stream is ordered after
                  DALI's streams, every block DALI no longer uses goes back to PyTorch; a block
                  DALI still holds stays lent ("pinned") and goes back at a later close
  shutdown()      after the DALI pipelines are gone: a last close, then the ledger is unmapped (its
                  names were unlinked at creation)

One MemoryBridge per CUDA device and process at a time (the native resource is per device): a
second loader asking for one gets a BridgeError ("auto": it runs with the bridge off, saying why).

Release path for lent blocks: close() (every window; every next() while there are no windows) and
shutdown(); a block pinned at shutdown stays allocated inside PyTorch's allocator (never freed
under DALI), is reported, and goes back through the next bridge on that device.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass

from fusionflow import native
from fusionflow.accel.bridge.ledger import Block, BlockLedger

log = logging.getLogger(__name__)
WARMUP_TINY_BATCHES = 2  # DALI's lasting buffers (decoder state, ...) go to its own pool first
_IN_USE: set[int] = set()  # devices whose native resource a live MemoryBridge drives (one per process)
# Blocks lent to the native resource and not yet given back, per device. Process-wide like the
# resource itself: a block still pinned when a bridge shuts down is returned by the next one.
_HELD: dict[int, dict[int, Block]] = {}


@dataclass
class BridgeStats:
    windows: int = 0  # prep windows in which blocks were lent
    lent_bytes: int = 0  # most bytes lent in one window
    borrowed_bytes: int = 0  # most bytes DALI had allocated from lent blocks at once
    fallback_bytes: int = 0  # bytes DALI took from its own pool during windows (lent blocks did not fit)
    pinned_bytes: int = 0  # lent bytes DALI still held at the last close
    seconds: float = 0.0  # time spent lending and taking back, all windows
    refused: int = 0  # lends undone because PyTorch would have had to reserve more


class MemoryBridge:
    def __init__(self, device, budget: int | None = None, warmup: int = WARMUP_TINY_BATCHES):
        import torch

        from fusionflow.accel.bridge.torch_side import TorchLender

        self.torch = torch
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if self.index in _IN_USE:  # the native resource is per device and process: one driver of its windows
            raise native.BridgeError(
                f"another loader in this process already lends PyTorch's blocks to DALI on "
                f"cuda:{self.index}; this one does not lend (its DALI may still use blocks "
                "the other lends, inside that loader's windows); close the other first to "
                "give the bridge to this one"
            )
        self.lib = native.load_bridge()
        native.call(self.lib.ff_bridge_install, self.index)
        self.lender = TorchLender(self.device)
        self.ledger = BlockLedger(capacity=4096, private=True)  # one process: no name to outlive a kill
        self.budget, self.warmup = budget, warmup
        self.stats = BridgeStats()
        self._lock = threading.Lock()
        self._stream = None  # the training stream of the armed window
        self._lent_now = False
        self._held = _HELD.setdefault(self.index, {})  # address -> block lent and not yet taken back
        self._ledger_add(list(self._held.values()))  # pinned blocks a previous bridge left
        _IN_USE.add(self.index)

    # ------------------------------------------------------------ window
    def arm(self, stream) -> None:
        with self._lock:
            self._stream = stream

    def lend(self, tiny_batches_done: int) -> None:
        """Lend for the armed window, once; a no-op during warm-up or when nothing is armed. On any
        failure nothing stays half-lent: the window is closed and every block goes back."""
        with self._lock:
            if self._stream is None or self._lent_now or tiny_batches_done < self.warmup:
                return
            t0 = time.perf_counter()
            self._lent_now = True  # from here on, close() has something to undo
            blocks = self.lender.lend(self.budget, self._stream)
            self.stats.refused = self.lender.refused
            handed = []
            try:
                for b in blocks:
                    native.call(self.lib.ff_bridge_lend, self.index, b.address, b.size)
                    self._held[b.address] = b
                    handed.append(b)
                # the event goes on PyTorch's stream after the blocks were taken: DALI orders after both
                native.call(self.lib.ff_bridge_open, self.index, self._stream.cuda_stream)
            except BaseException:
                self.lender.take_back(blocks[len(handed) :])
                self._close_locked(self._stream)
                raise
            self._ledger_add(handed)
            if self._held:
                self.stats.windows += 1
                self.stats.lent_bytes = max(self.stats.lent_bytes, sum(b.size for b in self._held.values()))
            self.stats.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """End the window: give PyTorch back every block DALI is done with."""
        with self._lock:
            stream, self._stream = self._stream, None
            if not self._lent_now and not self._held:
                return
            t0 = time.perf_counter()
            self._close_locked(stream)
            self.stats.seconds += time.perf_counter() - t0

    def _close_locked(self, stream) -> None:
        self._lent_now = False
        if stream is None:
            stream = self.torch.cuda.current_stream(self.index)
        cap = max(len(self._held), 1)
        bases, sizes = (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
        back = native.call(self.lib.ff_bridge_close, self.index, stream.cuda_stream, bases, sizes, cap)
        returned = [self._held.pop(bases[i]) for i in range(back)]
        self.lender.take_back(returned)
        self._ledger_remove(returned)
        out = (ctypes.c_uint64 * 7)()
        native.call(self.lib.ff_bridge_stats, self.index, out)
        self.stats.borrowed_bytes = max(self.stats.borrowed_bytes, out[2])
        self.stats.fallback_bytes = out[6]
        self.stats.pinned_bytes = sum(b.size for b in self._held.values())

    # The private ledger mirrors what DALI holds (`BORROWED` by this process); see the module docstring.
    # Bookkeeping only: a ledger fault is logged and never stops the bridge.
    def _ledger_add(self, blocks) -> None:
        try:
            if blocks and self.ledger is not None:
                self.ledger.lend_to_self(blocks)  # one pass over the ledger, whatever the block count
        except RuntimeError:
            log.exception("allocator bridge: ledger bookkeeping failed")

    def _ledger_remove(self, blocks) -> None:
        try:
            if self.ledger is None or not blocks:
                return
            self.ledger.release_blocks([b.address for b in blocks])  # some were lent under a previous ledger
            self.ledger.take_back_released()
        except RuntimeError:
            log.exception("allocator bridge: ledger bookkeeping failed")

    def shutdown(self) -> None:
        """Call after the DALI pipelines are destroyed: return everything, close the ledger."""
        if self.ledger is None:
            return
        self.close()
        _IN_USE.discard(self.index)
        if self._held:
            log.warning(
                "allocator bridge: %d bytes lent to DALI are still in use at shutdown; the next bridge "
                "on this device (or the process's end) takes them back",
                self.stats.pinned_bytes,
            )
        self.ledger.close()
        self.ledger = None  # shut down: a second call does nothing
