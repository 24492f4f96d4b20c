"""The allocator bridge: DALI's GPU memory as one arena carved out of PyTorch's caching allocator, lent
once, before the accelerator's first run, and given back when its pipelines are gone.

Route (see issue 6, and issue 41's memory bar): DALI runs in the training process (the accelerator
thread), so the bridge is a DALI device memory resource (kernels/dali_bridge_resource.cc, installed with
the stock libdali_core's SetDefaultDeviceResource) that serves DALI's allocations from the lent arena and
passes the rest to DALI's own pool (`fallback_bytes`: what did not fit). The arena's size bounds DALI's
memory by design: the samples a run holds x the runs in flight x a per-sample estimate (`arena_bytes`).
The blocks DALI holds are also recorded in a `BlockLedger`, private to this process: its shared-memory
names are unlinked at creation, so nothing outlives a SIGKILL and no other process can attach or read
it. Nothing reads it today (the bridge's stats come from its own bookkeeping); it is kept as the
protocol a borrower in another process would use (`BlockLedger(name=...)`, tests/test_ledger.py).

Once per accelerator start, in either GPU sharing mode:
  arm(stream)     the training thread (as it starts the accelerator, and at next()): `stream` is its current
                  CUDA stream, the one the arena is carved on (until the arena is lent; later calls change nothing)
  lend()          (accelerator thread, before each run) the first: the arena out of PyTorch's allocator ->
                  the native resource -> an event on PyTorch's stream that DALI's streams wait for; the
                  ledger records it BORROWED by this process. Every later one reads DALI's counters into `stats`
                  (there, not in the training thread: the native lock may wait behind a DALI allocation).
  close()         (training thread, after the accelerator's pipelines are destroyed) PyTorch's stream is
                  ordered after DALI's streams, the arena goes back to PyTorch; a region DALI still holds
                  stays lent ("pinned"), is lent again by the next start instead of a new one, and goes back
                  at a later close -- always ordered on the stream it was carved on
  shutdown()      a last close, then the ledger is unmapped (its names were unlinked at creation)

What the arena serves: DALI's run-time allocations (its pipeline is built before the first run: what the build
allocates stays in DALI's own pool), and, as the native resource is the process's default DALI device resource,
any other DALI pipeline on that device while the arena is lent (a user's own validation pipeline too). PyTorch
counts the arena in `torch.cuda.memory_allocated`.

Until 2026-11-28 the bridge lent every free cached block for each temporal prep window and took them
back at its end (so it could not work under spatial sharing at all): on an H100 that cost ~54 ms a
window and 24% of the throughput at batch 256, while DALI borrowed at most 14 MB of the 3.7 GB lent.
Lending once costs nothing per step; what it gives up is DALI using, between steps, memory the training
step needs during them (which, measured there, gave no larger batch); and the arena is taken before training
reaches its own peak, so its whole size is memory training cannot have -- an estimate until a GPU measures
what DALI takes (`bridge_max_borrowed_bytes`).

One MemoryBridge per CUDA device and process at a time (the native resource is per device): a
second loader asking for one gets a BridgeError ("auto": it runs with the bridge off, saying why).
A region still pinned at shutdown stays allocated inside PyTorch's allocator (never freed under DALI),
is reported, and goes back through the next bridge on that device.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from dataclasses import dataclass

from fusionflow import native
from fusionflow.accel.bridge.ledger import Block, BlockLedger

log = logging.getLogger(__name__)
# tiny-batches DALI runs on its own pool before the arena is lent: none. DALI's lasting buffers (decoder state)
# pin nothing in an arena lent for the accelerator's life (the per-window lending this replaced waited for 2).
WARMUP_TINY_BATCHES = 0
# uint8 images of the output's size a sample holds in DALI's graph at once, besides its output: the decoded
# crop window (larger than the output where the crop is), resized, flipped, the op slots' outputs. An
# estimate, not yet measured on a GPU (loader.stats.bridge_max_borrowed_bytes is what DALI really took).
WORKING_IMAGES = 6
_IN_USE: set[int] = set()  # devices whose native resource a live MemoryBridge drives (one per process)
# Regions lent to the native resource and not yet given back, per device, and the stream they were carved on.
# Process-wide like the resource itself: a region still pinned when a bridge shuts down is reused and returned
# by the next one, ordered on its own stream.
_HELD: dict[int, dict[int, Block]] = {}
_HELD_STREAM: dict[int, object] = {}


def arena_bytes(run_samples: int, runs: int, sample_shape, itemsize: int) -> int:
    """The arena for `runs` DALI runs in flight of `run_samples` samples each, a sample `sample_shape` (the
    output's C, H, W) of `itemsize`-byte elements: WORKING_IMAGES uint8 images of that size plus the output."""
    pixels = 1
    for n in sample_shape:
        pixels *= int(n)
    return int(run_samples) * int(runs) * pixels * (WORKING_IMAGES + int(itemsize))


@dataclass
class BridgeStats:
    lends: int = 0  # arenas lent (one per accelerator start)
    lent_bytes: int = 0  # the largest arena lent
    borrowed_bytes: int = 0  # most bytes DALI had allocated from the arena at once
    fallback_bytes: int = 0  # bytes DALI allocated from its own pool while an arena was lent, in all (not a peak)
    pinned_bytes: int = 0  # lent bytes DALI still held at the last close
    seconds: float = 0.0  # time spent lending and taking back
    refused: int = 0  # arena requests PyTorch could not serve (each halved the next)


class MemoryBridge:
    def __init__(self, device, budget: int, warmup: int = WARMUP_TINY_BATCHES):
        """`budget`: the arena's bytes (`arena_bytes`)."""
        import torch

        from fusionflow.accel.bridge.torch_side import TorchLender

        self.torch = torch
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if self.index in _IN_USE:  # the native resource is per device and process: one driver of its arena
            raise native.BridgeError(
                f"another loader in this process already lends PyTorch's memory to DALI on "
                f"cuda:{self.index}; this one does not lend (its DALI may still use the arena "
                "the other lends); close the other first to give the bridge to this one"
            )
        self.lib = native.load_bridge()
        native.call(self.lib.ff_bridge_install, self.index)
        self.lender = TorchLender(self.device)
        self.ledger = BlockLedger(capacity=4096, private=True)  # one process: no name to outlive a kill
        self.budget, self.warmup = budget, warmup
        self.stats = BridgeStats()
        self._lock = threading.Lock()
        self._stream = None  # the training stream, armed: where an arena is carved
        self._lent_now = False  # an arena is lent (until close)
        self._held = _HELD.setdefault(self.index, {})  # address -> region lent and not yet taken back
        self._ledger_add(list(self._held.values()))  # pinned regions a previous bridge left
        _IN_USE.add(self.index)

    def arm(self, stream) -> None:
        """The training thread's current stream: where the arena will be carved (until it is lent)."""
        with self._lock:
            if not self._lent_now:
                self._stream = stream

    def lend(self, tiny_batches_done: int) -> None:
        """Before each DALI run (the accelerator thread): the first, once armed and past the warm-up, lends the
        arena; every later one reads DALI's counters into `stats`. Regions still pinned from an earlier arena
        are lent again first (on the stream they were carved on), so a pinned arena is reused, never doubled.
        On any failure nothing stays half-lent: every region goes back."""
        with self._lock:
            if self._lent_now:
                self._read_native_stats()
                return
            stream = _HELD_STREAM.get(self.index) if self._held else self._stream
            if stream is None or tiny_batches_done < self.warmup:
                return
            t0 = time.perf_counter()
            self._lent_now = True  # from here on, close() has something to undo (and nothing is tried again)
            held = sum(b.size for b in self._held.values())
            blocks = self.lender.carve(self.budget - held, stream) if self.budget > held else []
            if self.lender.refused > self.stats.refused:  # PyTorch had less: later starts ask for what it gave
                self.budget = held + sum(b.size for b in blocks)
            self.stats.refused = self.lender.refused
            try:
                for b in blocks:
                    native.call(self.lib.ff_bridge_lend, self.index, b.address, b.size)
                    self._held[b.address] = b
                if self._held:  # the event goes on PyTorch's stream after the arena was taken: DALI orders after both
                    _HELD_STREAM[self.index] = stream
                    native.call(self.lib.ff_bridge_open, self.index, stream.cuda_stream)
            except BaseException:
                self.lender.take_back([b for b in blocks if b.address not in self._held])
                self._close_locked()
                raise
            self._ledger_add(blocks)
            if self._held:
                self.stats.lends += 1
                self.stats.lent_bytes = max(self.stats.lent_bytes, sum(b.size for b in self._held.values()))
            else:
                log.warning("allocator bridge: PyTorch had no memory for DALI's arena; DALI keeps its own pool")
            self.stats.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def paused(self):
        """DALI allocates from its own pool meanwhile (the arena stays lent): around a DALI pipeline's rebuild after
        a failed run, whose lasting buffers would otherwise sit in the arena sized for the runs until it closes. A
        native failure is logged: a rebuild never fails for the bridge."""
        paused = False
        try:
            with self._lock:
                if self._lent_now:
                    native.call(self.lib.ff_bridge_pause, self.index, 1)
                    paused = True
        except Exception:
            log.exception("allocator bridge: pausing the arena failed; the rebuild allocates from it")
        try:
            yield
        finally:
            if paused:
                try:
                    with self._lock:
                        native.call(self.lib.ff_bridge_pause, self.index, 0)
                except Exception:
                    log.exception("allocator bridge: resuming the arena failed; DALI keeps its own pool")

    def close(self) -> None:
        """Give PyTorch back every region DALI is done with; call once DALI's pipelines are gone. A later
        `lend` (the accelerator's next start) lends again."""
        with self._lock:
            self._stream = None
            if not self._lent_now and not self._held:
                return
            t0 = time.perf_counter()
            self._close_locked()
            self.stats.seconds += time.perf_counter() - t0

    def _close_locked(self) -> None:
        """Order the stream the regions were carved on after DALI's frees, and give back what DALI let go."""
        self._lent_now = False
        stream = _HELD_STREAM.get(self.index) or self.torch.cuda.current_stream(self.index)
        cap = max(len(self._held), 1)
        bases, sizes = (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
        back = native.call(self.lib.ff_bridge_close, self.index, stream.cuda_stream, bases, sizes, cap)
        returned = [self._held.pop(bases[i]) for i in range(back)]
        self.lender.take_back(returned)
        self._ledger_remove(returned)
        if not self._held:
            _HELD_STREAM.pop(self.index, None)
        self._read_native_stats()
        self.stats.pinned_bytes = sum(b.size for b in self._held.values())

    def _read_native_stats(self) -> None:
        out = (ctypes.c_uint64 * 7)()  # lent, live, peak live, served, allocations, regions, fallback
        native.call(self.lib.ff_bridge_stats, self.index, out)
        self.stats.borrowed_bytes = max(self.stats.borrowed_bytes, out[2])
        self.stats.fallback_bytes = out[6]

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
        try:
            self.close()
        except Exception:  # a CUDA fault at the end: what DALI held stays pinned, the ledger still goes
            log.exception("allocator bridge: giving the arena back failed at shutdown")
            self.stats.pinned_bytes = sum(b.size for b in self._held.values())
        _IN_USE.discard(self.index)
        if self._held:
            log.warning(
                "allocator bridge: %d bytes lent to DALI are still in use at shutdown; the next bridge "
                "on this device (or the process's end) takes them back",
                self.stats.pinned_bytes,
            )
        self.ledger.close()
        self.ledger = None  # shut down: a second call does nothing
