"""The loader's side of the accelerator and the GPU: starting the DALI worker kind (and the
allocator bridge before any DALI pipeline exists), TAAS's K search fed by completed mini-batches,
temporal sharing's prep windows around each wait, and delivery of mini-batches made partly on the
GPU. A mixin of FusionFlowLoader (fusionflow/loader.py), which holds the attributes it reads
(`accelerator`, `device`, `_bridge`, `_device_ring`, `_profiler`, `stats`, ...)."""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fusionflow.runtime.local_manager import LocalManager

log = logging.getLogger("fusionflow.loader")


class AcceleratorControl:
    def _start_accelerator(self, mgr: LocalManager) -> None:
        from fusionflow.runtime.accelerator import AcceleratorWorker
        from fusionflow.scheduling.taas import KSearch

        on_gpu = self.accelerator == "dali-gpu"
        if on_gpu and self._bridge_why_off is None and self._bridge is None:
            self._start_bridge()  # before any DALI pipeline exists, so all of DALI's memory passes through it
        device_ring = None
        if on_gpu:
            from fusionflow.runtime.device_ring import DeviceRing
            device_ring = DeviceRing(mgr.layout, self.device, self._alloc_device)
        sharing = "temporal" if self.gpu_sharing == "auto" else self.gpu_sharing  # auto starts by profiling
        accel = AcceleratorWorker(mgr.board, self.dataset, self.policy, self.tiny_batch_size, self.seed,
                                  device="gpu" if on_gpu else "cpu",
                                  device_id=self.device.index if on_gpu else None, aot=self.aot,
                                  largest_first=self.taas, device_ring=device_ring, sharing=sharing,
                                  counters=self.stats, bridge=self._bridge)
        mgr.board.add_worker_kind(accel)  # at once: the manager's shutdown stops it (and closes its pipeline)
        # if anything below, or start(), raises
        self._accel = self._box[2] = accel  # the loader's reference (the finalizer's box holds it too)
        search = KSearch(k_max=-(-self.capacity // self.tiny_batch_size))
        self.stats.accelerator_build_seconds = accel.build_seconds
        # The callbacks live on the manager: they must not refer to the loader (it would then live as
        # long as its manager, i.e. until close(), and never be collected) nor strongly to the manager.
        mgr.attach(on_batch_done=(functools.partial(_taas_feedback, weakref.ref(mgr.board), weakref.ref(accel),
                                                    search, self.stats.taas_k)
                                  if self.taas and self.taas_last_k else None),
                   on_capacity_change=lambda n: search.restart())  # the CPU side's speed changed: search K again
        self._device_ring = device_ring
        if on_gpu and self.gpu_sharing == "auto":
            from fusionflow.runtime.accelerator import SharingProfiler
            self._profiler = SharingProfiler(accel)
        accel.start()

    def _start_bridge(self) -> None:
        from fusionflow.memory.native import BridgeError
        try:
            from fusionflow.memory.bridge import MemoryBridge  # posix_ipc, ctypes, the native build
            self._bridge = MemoryBridge(self.device)
        except Exception as exc:  # not built, not importable, or CUDA/DALI refused the install
            if self.memory_bridge == "on":
                if isinstance(exc, BridgeError):
                    raise
                raise BridgeError(f"memory_bridge='on': the allocator bridge could not start: {exc!r}") from exc
            log.warning("memory_bridge='auto': the allocator bridge is off, DALI keeps its own GPU pool (%s)", exc)
            self._bridge_why_off = str(exc)  # not retried at every epoch
            self.stats.memory_bridge = f"off: {exc}"
            return
        self._box[1] = self._bridge
        self.stats.memory_bridge = "on"

    def _open_window(self, mgr: LocalManager) -> None:
        """Temporal sharing on the GPU: the accelerator may work (and, with the bridge, borrow) from now on."""
        accel = self._accel
        if self._bridge is not None and (accel is None or accel.bridge is None or accel.sharing != "temporal"):
            close_bridge_window(self._bridge)  # no windows now (spatial, lending failed): what DALI let go goes back
        if accel is None or not accel.gated:
            return
        with mgr.board.cond:
            if accel.bridge is not None:
                accel.bridge.arm(torch.cuda.current_stream(self.device))
            accel.window_open = True
            mgr.board.cond.notify_all()

    def _close_window(self, mgr: LocalManager) -> None:
        """The mini-batch is ready: let the tiny-batch in flight finish, then PyTorch takes its blocks back."""
        accel = self._accel
        if accel is None or not accel.window_open:
            return
        with mgr.board.cond:
            accel.window_open = False
            accel.wait_idle()
        close_bridge_window(self._bridge)

    def _sync_bridge(self) -> None:
        """The allocator bridge's own counters into loader.stats (the manager's parts count there directly)."""
        copy_bridge_stats(self._bridge, self.stats)

    def _mark_step(self, mgr: LocalManager) -> None:
        """Temporal GPU sharing: the accelerator waits for the training work queued so far."""
        accel = self._accel
        if self._profiler is not None:
            self._profiler.tick()
            self.stats.gpu_sharing = self._profiler.chosen
        if accel is not None and accel.device_ring is not None and accel.sharing == "temporal":
            with torch.cuda.device(self.device.index):
                event = torch.cuda.Event(blocking=True)
                event.record(torch.cuda.current_stream(self.device))
            accel.step_event = event

    def _deliver_merged(self, mgr: LocalManager, state, keep):
        """CUDA delivery of a mini-batch produced partly on the GPU: the host ring's positions are
        copied over, the accelerator's come from the device ring (slices of consecutive positions:
        no index tensor, so no host-to-device copy of indices)."""
        from fusionflow.runtime.device_ring import accel_runs
        n, slot, pinned = state.size, state.slot, mgr.cuda_registered
        with torch.cuda.device(self.device.index):
            stream = torch.cuda.current_stream(self.device)
            self._device_ring.wait_slot(slot, stream)  # after the accelerator's copies into this slot
            out = torch.from_numpy(mgr.board.ring.images[slot, :n]).to(self._alloc_device, non_blocking=pinned)
            for start, stop in accel_runs(state.accel_positions):
                out[start:stop] = self._device_ring.images[slot, start:stop]
            host_labels = mgr.board.ring.labels[slot, :n]
            labels = torch.from_numpy(host_labels if pinned else host_labels.copy()).to(self._alloc_device,
                                                                                        non_blocking=pinned)
            if keep is not None:  # on_error='skip' dropped samples (rare): gather what is kept
                keep_t = torch.as_tensor(keep).to(self._alloc_device)
                out, labels = out[keep_t], labels[keep_t]
            return out, labels, self._copied(stream)


def _taas_feedback(board_ref, accel_ref, search, history, state) -> None:
    """The board's on_batch_done (under its lock, once per completed mini-batch): TAAS's K search."""
    board, accel = board_ref(), accel_ref()
    if board is None or (accel is not None and accel.retired):
        return
    cpu_last = state.cpu_done_at >= state.accel_done_at
    board.reserved = search.observe(cpu_last, time.monotonic() - state.submitted_at)
    history.append(board.reserved)


def close_bridge_window(bridge) -> None:
    if bridge is None:
        return
    try:
        bridge.close()
    except Exception:  # training goes on; what could not be returned stays lent (stats: bridge_pinned_bytes)
        log.exception("allocator bridge: closing the prep window failed")


# loader.stats field <- MemoryBridge.stats field (the bridge's lent/borrowed bytes are maxima over windows)
BRIDGE_STATS = (("bridge_windows", "windows"), ("bridge_max_lent_bytes", "lent_bytes"),
                ("bridge_max_borrowed_bytes", "borrowed_bytes"), ("bridge_fallback_bytes", "fallback_bytes"),
                ("bridge_pinned_bytes", "pinned_bytes"), ("bridge_seconds", "seconds"))


def copy_bridge_stats(bridge, stats) -> None:
    if bridge is not None:
        for ours, theirs in BRIDGE_STATS:
            setattr(stats, ours, getattr(bridge.stats, theirs))
