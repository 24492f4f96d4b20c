"""GpuSession: the loader's side of the accelerator and the GPU -- starting the DALI worker kind (and
the allocator bridge before any DALI pipeline exists), TAAS's K search fed by completed mini-batches,
temporal sharing's prep windows around each wait, and delivery of mini-batches made partly on the
GPU. One per loader built with an accelerator; it owns the bridge, the device ring, the sharing
profiler, the loader's reference to the accelerator it started (never the loader or its manager:
the manager is passed to each call) and the DALI pipeline an ended runtime's accelerator left idle,
which the next one runs (an epoch without persistent workers does not build the graph again)."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import TYPE_CHECKING

import torch

from fusionflow.accel import at_exit
from fusionflow.accel.at_exit import Spares, keep_idle, stop_at_exit
from fusionflow.accel.config import RUN_SAMPLES, RUNS_IN_FLIGHT_CPU
from fusionflow.runtime.counters import append_bounded

if TYPE_CHECKING:
    from fusionflow.runtime.local_manager import LocalManager

log = logging.getLogger("fusionflow.loader")


class GpuSession:
    def __init__(
        self,
        stats,
        *,
        accelerator: str,
        device: torch.device,
        gpu_sharing: str,
        aot: bool,
        taas: bool,
        taas_last_k: bool,
        memory_bridge: str,
        bridge_why_off: str | None,
        threads: int = 1,
        run_samples: int = RUN_SAMPLES,
        runs_in_flight: int = RUNS_IN_FLIGHT_CPU,
        hw_decoder_load: float | None = None,
    ):
        self.stats = stats
        self.accelerator, self.device, self.gpu_sharing = accelerator, device, gpu_sharing
        self.aot, self.taas, self.taas_last_k, self.memory_bridge = aot, taas, taas_last_k, memory_bridge
        self.threads = threads  # DALI's CPU threads
        self.run_samples, self.runs_in_flight = run_samples, runs_in_flight  # a DALI run's most samples; runs at once
        self.hw_decoder_load = hw_decoder_load  # DALI's decoder's (None: DALI's default)
        self.bridge = None  # the MemoryBridge, while it runs (kept across managers until close())
        self.bridge_why_off = bridge_why_off  # None: start the bridge with the accelerator (again after close())
        self.accel = None  # the accelerator worker kind this session started, while its manager runs
        self.retired: str | None = None  # why an accelerator retired: none starts again in this loader's run
        self.started = False  # an accelerator started once: a later build that fails retires, not raises
        self.device_ring = None
        self.profiler = None  # gpu_sharing="auto" on a GPU
        # the DALI pipeline an accelerator left idle when its manager stopped (an epoch without persistent workers):
        # the next manager's accelerator runs it rather than building the graph again (seconds on a GPU)
        self._spares = Spares()  # the pipelines kept for the next manager (accel/at_exit.py)
        self._spares_pid = os.getpid()  # the process whose DALI threads they are

    @classmethod
    def for_config(cls, stats, cfg) -> GpuSession:
        """The session a loader's resolved configuration (LoaderConfig) asks for."""
        return cls(
            stats,
            accelerator=cfg.accelerator,
            device=cfg.device,
            gpu_sharing=cfg.gpu_sharing,
            aot=cfg.aot,
            taas=cfg.taas,
            taas_last_k=cfg.taas_last_k,
            memory_bridge=cfg.memory_bridge,
            bridge_why_off=cfg.bridge_why_off,
            threads=cfg.dali_threads,
            run_samples=cfg.dali_run_samples,
            runs_in_flight=cfg.dali_runs_in_flight,
            hw_decoder_load=cfg.dali_hw_decoder_load,
        )

    def start(
        self,
        mgr: LocalManager,
        dataset,
        alloc_device: torch.device,
    ) -> None:
        """Start the accelerator as a worker kind on `mgr` (the bridge first, on the GPU), with the
        policy, seed and sizes of the manager's RuntimeSpec; none once one retired (an epoch without persistent
        workers started it anew: its failed runs, or its stall bound's wait, came again every epoch)."""
        if self.retired is not None:
            return
        if not self.started:  # (the first start, or the first after close(): a retirement before it is over)
            from fusionflow.accel.run_ledger import unretired

            unretired(self.stats)
        self._spares.shut = False  # (closed with the loader: started again)
        capacity = mgr.spec.layout.batch_size
        on_gpu = self.accelerator == "dali-gpu"
        if on_gpu and self.bridge_why_off is None and self.bridge is None:
            self._start_bridge(mgr.spec)  # before any DALI pipeline exists, so all of DALI's memory passes through it
        if self.bridge is not None:
            self.bridge.arm(torch.cuda.current_stream(self.device))  # the training thread's: the arena is carved there
        device_ring = None
        if on_gpu:
            from fusionflow.accel.device_ring import DeviceRing

            device_ring = DeviceRing(mgr.spec.layout, self.device, alloc_device)
        try:
            accel = self._accelerator(mgr, dataset, on_gpu, device_ring)
        except Exception as exc:  # a later epoch's build (out of memory beside training): the CPU workers take all
            if not self.started:
                raise
            from fusionflow.accel.run_ledger import retired

            self.retired = retired(self.stats, f"starting it failed (its DALI pipeline or input helpers): {exc!r}")
            return
        self.started = True
        mgr.board.add_worker_kind(accel)  # at once: the manager's shutdown stops it (and closes its pipeline) if
        # anything below, or start(), raises
        stop_at_exit(accel)
        self.accel, self.device_ring, self.alloc_device = accel, device_ring, alloc_device
        if accel.build_seconds or self.stats.accelerator_build_seconds is None:  # not for a pipeline run again
            self.stats.accelerator_build_seconds = accel.build_seconds
        # The callbacks live on the manager: they must not refer to the loader or this session (they
        # would live as long as the manager) nor strongly to the manager or the accelerator.
        accel_ref = weakref.ref(accel)
        if accel.shares is not None:
            with mgr.board.cond:  # the first mini-batches' share, until rates are measured
                accel.shares.reserve(capacity)
        mgr.attach(
            on_batch_done=(
                functools.partial(_split_feedback, weakref.ref(mgr), accel_ref, self.stats)
                if accel.shares is not None
                else None
            ),
            on_capacity_change=functools.partial(_capacity, accel_ref),
        )
        if on_gpu and self.gpu_sharing == "auto":
            from fusionflow.accel.sharing_profiler import SharingProfiler

            self.profiler = SharingProfiler(accel)
        accel.start()

    def _accelerator(self, mgr: LocalManager, dataset, on_gpu: bool, device_ring):
        """The AcceleratorWorker for `mgr`'s spec, given its input helper (closed here if it fails to start)."""
        from fusionflow.accel.accelerator import AcceleratorWorker
        from fusionflow.accel.input_helpers import helper_processes, start_helper
        from fusionflow.runtime.cores import rank_cores
        from fusionflow.scheduling.split import ShareController

        spec = mgr.spec
        policy, seed, tiny_batch_size = spec.policy, spec.seed, spec.tiny_batch_size
        sharing = "temporal" if self.gpu_sharing == "auto" else self.gpu_sharing  # auto starts by profiling
        helpers = helper_processes(on_gpu, rank_cores(len(os.sched_getaffinity(0))), spec.num_workers, self.threads)
        run_samples = self._run_samples(spec)  # the helpers read the runs too (accel/helper_reads.py)
        inputs = start_helper(policy, spec.mp_context, helpers, (dataset, run_samples, self.runs_in_flight, seed))
        spare = self._take_spare(run_samples)
        try:
            accel = AcceleratorWorker(
                mgr.board,
                dataset,
                policy,
                run_samples,
                seed,
                device="gpu" if on_gpu else "cpu",
                device_id=self.device.index if on_gpu else None,
                aot=self.aot,
                largest_first=self.taas,
                device_ring=device_ring,
                sharing=sharing,
                counters=self.stats,
                bridge=self.bridge,
                num_threads=self.threads,
                hw_decoder_load=self.hw_decoder_load,
                split=ShareController(shares_device=on_gpu, step=tiny_batch_size) if self.taas_last_k else None,
                cpu_workers=spec.num_workers,
                inputs=inputs,
                tiny_batch_size=tiny_batch_size,
                depth=self.runs_in_flight,
                pipeline=spare,
                keep_pipeline=functools.partial(keep_idle, self._spares) if self.aot else None,
            )
        except BaseException:
            if inputs is not None:  # the accelerator would have owned it
                inputs.close()
            if spare is not None:
                spare.close()
            raise
        return accel

    def _take_spare(self, run_samples: int):
        """The pipeline the last accelerator left idle, if it can run this one's runs (its policy, threads and device
        are this loader's): None in a process forked from the one that built it (its DALI threads are the parent's:
        dropped, not closed), if it is no longer idle, or if built for another run size or depth (closed)."""
        if self._spares_pid != os.getpid():
            self._spares[:] = []
            self._spares_pid = os.getpid()
        spare = self._spares.pop() if self._spares else None
        if spare is None:
            return None
        at_exit.IDLE.discard(spare)  # in use again: the exit hook stops its accelerator instead
        if spare.idle and (spare.batch_size, spare.depth) == (run_samples, self.runs_in_flight):
            return spare
        spare.close()  # (never so for one loader today: a safety net)
        return None

    def _run_samples(self, spec) -> int:
        """The most samples one DALI run holds: run_samples, within MERGE_SHARES mini-batches (one under temporal
        sharing, whose runs hold one share) and one tiny-batch at least."""
        from fusionflow.accel.accelerator import MERGE_SHARES

        shares = 1 if self.gpu_sharing == "temporal" else MERGE_SHARES
        return min(spec.layout.batch_size * shares, max(spec.tiny_batch_size, self.run_samples))

    def _start_bridge(self, spec) -> None:
        import numpy as np

        from fusionflow.native import BridgeError

        try:
            from fusionflow.accel.bridge.memory_bridge import MemoryBridge, arena_bytes  # posix_ipc, the native build

            # the arena: DALI's runs in flight at their most samples ("auto" sharing may go spatial; temporal: one)
            layout, runs = spec.layout, 1 if self.gpu_sharing == "temporal" else self.runs_in_flight
            size = arena_bytes(self._run_samples(spec), runs, layout.sample_shape, np.dtype(layout.dtype).itemsize)
            self.bridge = MemoryBridge(self.device, size)
        except Exception as exc:  # not built, not importable, or CUDA/DALI refused the install
            if self.memory_bridge == "on":
                if isinstance(exc, BridgeError):
                    raise
                raise BridgeError(f"memory_bridge='on': the allocator bridge could not start: {exc!r}") from exc
            log.warning("memory_bridge='auto': the allocator bridge is off, DALI keeps its own GPU pool (%s)", exc)
            self.bridge_why_off = str(exc)  # not retried at every epoch
            self.stats.memory_bridge = f"off: {exc}"
            return
        self.stats.memory_bridge = "on"

    # ---------------------------------------------------------------- around each wait at next()
    def mark_step(self) -> None:
        """Temporal GPU sharing: the accelerator waits for the training work queued so far."""
        accel = self.accel
        if self.profiler is not None:
            self.profiler.tick()
            self.stats.gpu_sharing = self.profiler.chosen
        if accel is not None and accel.device_ring is not None and accel.sharing == "temporal":
            with torch.cuda.device(self.device.index):
                event = torch.cuda.Event(blocking=True)
                event.record(torch.cuda.current_stream(self.device))
            accel.step_event = event  # each run waits for the training work queued before next()

    def open_window(self, mgr: LocalManager) -> None:
        """At next(): the bridge learns the training stream (its arena is carved there); under temporal sharing
        on the GPU the accelerator may work from now on."""
        accel = self.accel
        if accel is None:
            return
        if self.bridge is not None:
            self.bridge.arm(torch.cuda.current_stream(self.device))
        if accel.gated:
            accel.open_window()

    def close_window(self, mgr: LocalManager) -> None:
        """The mini-batch is ready: under temporal sharing, the DALI run in flight finishes before training goes on."""
        if self.accel is not None:
            self.accel.close_window()

    def sync_stats(self) -> None:
        """The allocator bridge's own counters into loader.stats (the manager's parts count there directly;
        the bridge reads DALI's in the accelerator thread, before each run)."""
        copy_bridge_stats(self.bridge, self.stats)

    def deliver_merged(self, mgr: LocalManager, state, keep):
        """CUDA delivery of a mini-batch produced partly on the GPU (None when it was not: the caller
        delivers from the host ring): the host ring's positions are copied over, the accelerator's
        come from the device ring (slices of consecutive positions: no index tensor, so no
        host-to-device copy of indices). Returns (images, labels, the event after the copies)."""
        if self.device_ring is None or not state.accel_positions:
            return None
        from fusionflow.accel.device_ring import accel_runs
        from fusionflow.runtime.cuda_host import record_copies

        n, slot, pinned, dev = state.size, state.slot, mgr.cuda_registered, self.alloc_device
        with torch.cuda.device(self.device.index):
            stream = torch.cuda.current_stream(self.device)
            self.device_ring.wait_slot(slot, stream)  # after the accelerator's copies into this slot
            out = torch.from_numpy(mgr.board.ring.images[slot, :n]).to(dev, non_blocking=pinned)
            for start, stop in accel_runs(state.accel_positions):
                out[start:stop] = self.device_ring.images[slot, start:stop]
            host_labels = mgr.board.ring.labels[slot, :n]
            labels = torch.from_numpy(host_labels if pinned else host_labels.copy()).to(dev, non_blocking=pinned)
            if keep is not None:  # on_error='skip' dropped samples (rare): gather what is kept
                keep_t = torch.as_tensor(keep).to(dev)
                out, labels = out[keep_t], labels[keep_t]
            return out, labels, record_copies(stream, mgr)

    # ---------------------------------------------------------------- the shutdown procedure's GPU steps
    def end_window_now(self, mgr: LocalManager) -> None:
        """Shutdown, before the manager's: close an open prep window (the DALI run in flight finishes first)."""
        if self.accel is not None:
            self.accel.close_window()

    def manager_stopped(self, stats=None, keep: bool = False) -> None:
        """Shutdown, after the manager's: unless `keep` (another manager follows), close the pipeline the
        accelerator left idle; once no DALI pipeline is left, take back the arena they used; copy the bridge's
        counters into `stats`, forget the accelerator and what belonged to it."""
        if not keep:
            self.close_spares()
        if self.accel is not None and self.accel.retired:
            self.retired = self.accel.retired
        # the arena goes back either way: what a kept pipeline's buffers hold of it stays pinned (MemoryBridge lends
        # it again first at the next start), and DALI allocating meanwhile -- a validation loader's pipeline -- does
        # so from its own pool, not from this loader's arena
        close_bridge(self.bridge)
        if stats is not None:
            copy_bridge_stats(self.bridge, stats)
        self.accel = self.device_ring = self.profiler = None

    def close_spares(self, shut: bool = False) -> None:
        """Close the DALI pipeline kept for the next manager, if any (in a forked copy: forget it); `shut` (the
        loader closes): one kept later is closed too, until the next start."""
        with self._spares.lock:
            spares, self._spares[:] = list(self._spares), []
            self._spares.shut = shut
        for pipeline in spares if self._spares_pid == os.getpid() else ():
            pipeline.close()

    def shutdown_bridge(self) -> None:
        """No DALI pipeline stays (the kept one is closed), every lent block goes back and the ledger is
        unlinked; a later start builds a new bridge."""
        self.close_spares(shut=True)
        self.retired, self.started = None, False  # the loader may start again: afresh (a first build failing raises)
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            bridge.shutdown()
            copy_bridge_stats(bridge, self.stats)  # what a kept pipeline held in the arena, given back only now


def _split_feedback(mgr_ref, accel_ref, stats, state) -> None:
    """The board's on_batch_done (under its lock, once per completed mini-batch): the split rule's
    observations, and the next share (scheduling/split.py), recorded in `stats.taas_k` (looked up each
    time: `stats.reset()` gives it a new list)."""
    mgr, accel = mgr_ref(), accel_ref()
    if mgr is None or accel is None or accel.retired:
        return
    board = mgr.board
    awaited = board.queue.awaited == (board.generation, state.seq)
    done_at = max(state.cpu_done_at, state.accel_done_at)  # the completing call's one clock reading
    accel.shares.batch_done(state, mgr.pool.task_seconds if mgr.pool is not None else 0.0, awaited, done_at)
    append_bounded(stats.taas_k, board.reserved)


def _capacity(accel_ref, workers: int) -> None:
    """The manager's on_capacity_change (under the board's lock): the CPU workers now live."""
    accel = accel_ref()
    if accel is not None and accel.shares is not None:
        accel.shares.capacity(workers)


def close_bridge(bridge) -> None:
    if bridge is None:
        return
    try:
        bridge.close()
    except Exception:  # the loader goes on; what could not be returned stays lent (stats: bridge_pinned_bytes)
        log.exception("allocator bridge: giving the arena back failed")


# loader.stats field <- MemoryBridge.stats field (the lent/borrowed bytes are maxima over arenas)
BRIDGE_STATS = (
    ("bridge_lends", "lends"),
    ("bridge_max_lent_bytes", "lent_bytes"),
    ("bridge_max_borrowed_bytes", "borrowed_bytes"),
    ("bridge_fallback_bytes", "fallback_bytes"),
    ("bridge_pinned_bytes", "pinned_bytes"),
    ("bridge_seconds", "seconds"),
)


def copy_bridge_stats(bridge, stats) -> None:
    if bridge is not None:
        for ours, theirs in BRIDGE_STATS:
            setattr(stats, ours, getattr(bridge.stats, theirs))
