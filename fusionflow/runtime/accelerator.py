"""The accelerator worker: a thread in the training process that feeds a prebuilt DALI pipeline
with the largest tiny-batches of the local manager's queue and writes each sample's output into
its position of the mini-batch.

`device="gpu"`: DALI decodes with nvJPEG and augments on the GPU; outputs land in a device ring
(`DeviceRing`) that the loader merges with the CPU workers' positions at delivery. `device="cpu"`:
DALI's CPU backend stands in for the GPU (machines without one, and the tests): outputs land in
the shared host ring like a CPU worker's.

A tiny-batch it cannot run (a sample that is not encoded bytes, one whose header declares more
pixels than the policy's decode.max_pixels -- read on the host, DALI never sees it --, or one DALI
cannot decode) goes back to the queue marked CPU-only; the CPU workers then produce it or report
the precise sample (an over-limit one as ImageTooLargeError).

Sharing the GPU with training (device="gpu"): in `temporal` mode the thread works only inside the
loader's prep window -- from the start of next() until the mini-batch is ready -- and before a
tiny-batch waits (blocking CUDA event) for the training work queued before next() to finish, so
DALI never runs alongside a training step. In `spatial` mode it runs concurrently. Its copies into
the device ring go on its own CUDA stream (runtime/device_ring.py).

With the allocator bridge (`bridge`, temporal mode only) the prep window is also when PyTorch's free
blocks are lent to DALI; before its first tiny-batch of a window the thread asks the bridge to lend.
The loader closes a window only once the tiny-batch in flight is done (`wait_idle`).

It is a worker kind (runtime/board.py): registered with the board's `add_worker_kind`, it uses only
the board's interface (`cond`, `take_accel`, `complete`, `requeue`, `draining`, `wake`, `ring`,
`trace`, `sizes`, `reserved`) and counts into the counters it is given (runtime/counters.py).

Failures: a tiny-batch DALI cannot run goes back to the CPU workers. DALI's pipeline is shut down
and rebuilt after a failed batch (never kept broken); out of device memory is logged as such (not
as a corrupt sample). After `MAX_FAILURES` failed tiny-batches in a row, or a pipeline that cannot
be rebuilt, the accelerator retires: the CPU workers take everything from then on.

Pipelines are closed explicitly: at `stop()`, and (the DALI-Naive ablation, aot=False) after each
tiny-batch it built one for.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from fusionflow.errors import AcceleratorError, DecodeError, DeviceOutOfMemory
from fusionflow.ops.decode import within_pixel_limit
from fusionflow.runtime import targets
from fusionflow.sample import split_item

log = logging.getLogger(__name__)
MAX_FAILURES = 4  # failed tiny-batches in a row before the accelerator retires
PROFILE_BATCHES = 10  # gpu_sharing="auto": iterations timed per mode before choosing


class AcceleratorWorker:
    def __init__(
        self,
        board,
        dataset,
        policy,
        max_batch: int,
        seed: int,
        device: str = "cpu",
        device_id: int | None = None,
        aot: bool = True,
        largest_first: bool = True,
        num_threads: int = 1,
        device_ring=None,
        sharing: str = "spatial",
        counters=None,
        bridge=None,
    ):
        from fusionflow.ops.dali_pipeline import DaliPolicyPipeline
        from fusionflow.policy import load_policy

        self.board, self.dataset, self.seed = board, dataset, seed
        self.counters = counters if counters is not None else board.counters
        self.max_pixels = load_policy(policy).max_pixels
        self.largest_first, self.sharing, self.device_ring = largest_first, sharing, device_ring
        self._make = lambda: DaliPolicyPipeline(
            policy, max_batch, device=device, device_id=device_id, num_threads=num_threads
        )
        t0 = time.perf_counter()
        self.pipeline = self._make() if aot else None  # ahead of time: nothing is built on the hot path
        self.build_seconds = time.perf_counter() - t0 if aot else 0.0
        self.counters.accelerator_builds += 1 if aot else 0
        self.tiny_batches = 0  # done by this accelerator (the bridge lends after a warm-up count of them)
        self._side = {}  # the last tiny-batch's targets that are not ints
        self.failures_in_a_row = 0
        self.retired: str | None = None  # why the accelerator stopped taking work, once it has
        self.step_event = None  # set by the loader at each next() (temporal sharing)
        self.bridge = bridge  # MemoryBridge (memory_bridge on); dropped if lending fails
        self.window_open = False  # the loader's prep window (only consulted while gated)
        self._active = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fusionflow-accelerator", daemon=True)

    def start(self) -> None:
        """Start the thread (after the board's `add_worker_kind`)."""
        self._thread.start()

    def busy_with_stale(self, generation: int) -> bool:
        work = self._active
        return work is not None and work.generation != generation

    @property
    def gated(self) -> bool:
        """Works only inside the loader's prep window: temporal sharing of a GPU (with or without
        the bridge; with DALI's CPU backend only when a bridge stands in, as in the tests)."""
        return self.sharing == "temporal" and (self.device_ring is not None or self.bridge is not None)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Under board.cond: wait for the tiny-batch in flight (if any) to finish."""
        deadline = time.monotonic() + timeout
        while self._active is not None and self._thread.is_alive() and time.monotonic() < deadline:
            self.board.cond.wait(0.05)

    def stop(self) -> None:
        """Idempotent: the tiny-batch in flight finishes, the thread ends, the pipeline is closed."""
        with self.board.cond:
            self._stop = True
            self.board.cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            if self._thread.is_alive() and self._thread is not threading.current_thread():  # stuck in a tiny-batch
                log.warning(
                    "the accelerator thread did not stop within 10 s; its DALI pipeline is left to "
                    "the garbage collector"
                )
            else:
                pipeline.close()

    def _retire(self, why: str) -> None:
        """Under board.cond: take no more work; the CPU workers get everything, reservations included."""
        self.retired = self.counters.accelerator_retired = why
        self.board.reserved = 0
        self.board.cond.notify_all()
        log.warning(
            "the DALI accelerator is retired for the rest of this loader's run (%s); the CPU workers "
            "take every tiny-batch",
            why,
        )

    def _run(self) -> None:
        board = self.board
        while True:
            with board.cond:
                while (
                    not self._stop
                    and not self.retired
                    and (
                        board.draining()
                        or (self.gated and not self.window_open)
                        or (work := board.take_accel(self.largest_first)) is None
                    )
                ):
                    board.cond.wait(0.5)
                if self._stop or self.retired:
                    return
                self._active = work
            fatal = None
            started = time.monotonic_ns()
            try:
                ok = self._process(work)
            except AcceleratorError as exc:  # the pipeline cannot be rebuilt (or is closed)
                log.error("accelerator failed on tiny-batch %s: %s", work.indices, exc)
                ok, fatal = False, str(exc)
            except Exception:  # anything unexpected: the CPU workers take it over
                log.exception("accelerator failed on tiny-batch %s; handing it to the CPU workers", work.indices)
                ok = False
            with board.cond:
                self._active = None
                board.cond.notify_all()  # a loader closing its prep window waits for this
                if ok:
                    self.tiny_batches += 1
                    self.counters.accelerator_tiny_batches += 1
                    self.failures_in_a_row = 0
                    if board.trace is not None:
                        board.trace.tiny_batch(None, work, started, time.monotonic_ns(), board.sizes)
                    board.complete(work, [], on_accelerator=True, targets=self._side)
                else:
                    self.counters.accelerator_given_back += 1
                    self.failures_in_a_row += ok is False
                    work.cpu_only = True
                    board.requeue([work])
                    if fatal is not None:
                        self._retire(fatal)
                    elif self.failures_in_a_row >= MAX_FAILURES:
                        self._retire(f"{self.failures_in_a_row} tiny-batches in a row failed in DALI")
            board.wake()

    def _process(self, work) -> bool | None:
        """True: done; False: DALI failed on it; None: not DALI's kind of sample (no failure)."""
        samples, labels = [], []
        for index in work.indices:
            sample, label = split_item(self.dataset[index], index)
            if not isinstance(sample, (bytes, bytearray, memoryview)):
                return None  # DALI decodes encoded images only
            if not within_pixel_limit(sample, self.max_pixels):
                return None  # a possible decompression bomb: the CPU path refuses it by name
            samples.append(sample)
            labels.append(label)
        if self.pipeline is not None:
            return self._run_pipeline(self.pipeline, work, samples, labels)
        pipeline = self._make()  # the DALI-Naive ablation: build for every tiny-batch, close after it
        self.counters.accelerator_builds += 1
        try:
            return self._run_pipeline(pipeline, work, samples, labels)
        finally:
            pipeline.close()

    def _run_pipeline(self, pipeline, work, samples, labels) -> bool:
        if self.sharing == "temporal" and self.step_event is not None:
            self.step_event.synchronize()  # training work queued before the last next() is done
        if self.gated and self.bridge is not None:
            try:
                self.bridge.lend(self.tiny_batches)
            except Exception:  # DALI still has its own pool: carry on without the bridge
                log.exception("allocator bridge failed to lend; continuing without it")
                self.bridge = None
        try:
            copies = {"copies": work.copies} if work.copies else {}  # repeated augmentation's copy numbers
            out = pipeline.run(samples, list(work.indices), self.seed, work.epoch, **copies)
        except DeviceOutOfMemory as exc:
            self.counters.accelerator_out_of_memory += 1
            log.warning("accelerator out of memory on tiny-batch %s; the CPU workers take it: %s", work.indices, exc)
            return False
        except DecodeError as exc:
            log.info("accelerator could not decode %s: %s", work.indices, exc)
            return False
        ring = self.board.ring
        if self.device_ring is not None:
            self.device_ring.write(work.slot, work.positions, out)
        else:
            for k, pos in enumerate(work.positions):
                ring.images[work.slot, pos] = np.asarray(out[k])
        self._side = {}  # targets that are not ints: completed with the tiny-batch (runtime/targets.py)
        for pos, target in zip(work.positions, labels):
            targets.store(ring.labels[work.slot], pos, target, self._side)
        return True


class SharingProfiler:
    """`gpu_sharing="auto"`: time `batches` iterations in temporal mode, then `batches` in spatial
    mode (watching free GPU memory), then let `choose_sharing` pick for the rest of the run."""

    def __init__(self, accel: AcceleratorWorker, batches: int = PROFILE_BATCHES):
        self.accel, self.batches = accel, batches
        self.times = {"temporal": [], "spatial": []}
        self.min_free = None
        self.total = None
        self.last = None
        self.chosen = None
        accel.sharing = "temporal"

    def tick(self) -> None:
        """Call at every next(): one iteration of training plus loading has passed."""
        import torch

        from fusionflow.scheduling.sharing import choose_sharing

        if self.chosen is not None:
            return
        now = time.perf_counter()
        phase = self.accel.sharing
        if self.last is not None:
            self.times[phase].append(now - self.last)
        self.last = now
        if phase == "spatial":
            free, self.total = torch.cuda.mem_get_info(self.accel.device_ring.index)
            self.min_free = free if self.min_free is None else min(self.min_free, free)
        if len(self.times[phase]) >= self.batches:
            if phase == "temporal":
                self.accel.sharing = "spatial"
                self.last = None  # the switch itself is not an iteration
            else:
                self.chosen = choose_sharing(
                    self.times["temporal"], self.times["spatial"], self.min_free or 0, self.total or 1
                )
                self.accel.sharing = self.chosen
                log.info(
                    "gpu_sharing='auto' chose %s (median iteration temporal %.1f ms, spatial %.1f ms)",
                    self.chosen,
                    1e3 * sorted(self.times["temporal"])[len(self.times["temporal"]) // 2],
                    1e3 * sorted(self.times["spatial"])[len(self.times["spatial"]) // 2],
                )
