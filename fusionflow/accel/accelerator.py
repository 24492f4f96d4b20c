"""The accelerator worker: a thread in the training process that feeds a prebuilt DALI pipeline
with the largest tiny-batches of the local manager's queue and writes each sample's output into
its position of the mini-batch.

One DALI run takes several tiny-batches of one mini-batch: its largest, up to TAAS's K (the ones
reserved for the accelerator) and `max_images` samples. A GPU pipeline's cost per run hardly
depends on its batch below a hundred images, so one tiny-batch per run (the first GPU run,
2026-11-24: 4 images, ~15 ms) left an H100 doing ~270 img/s while DALI alone did 6,800.

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
the device ring go on its own CUDA stream (accel/device_ring.py).

With the allocator bridge (`bridge`, temporal mode only) the prep window is also when PyTorch's free
blocks are lent to DALI; before its first tiny-batch of a window the thread asks the bridge to lend.
The loader closes a window only once the tiny-batch in flight is done (`wait_idle`).

It is a worker kind (runtime/board.py): registered with the board's `add_worker_kind`, it uses only
the board's interface (`cond`, `take_accel`, `complete`, `requeue`, `draining`, `wake`, `ring`,
`trace`, `sizes`, `drop_reservations`) and counts into the counters it is given (runtime/counters.py).

Failures: a tiny-batch DALI cannot run goes back to the CPU workers. DALI's pipeline is shut down
and rebuilt after a failed batch (never kept broken); out of device memory is logged as such (not
as a corrupt sample). After `MAX_FAILURES` failed DALI runs in a row, or a pipeline that cannot
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
from fusionflow.runtime.sample import split_item

log = logging.getLogger(__name__)
MAX_FAILURES = 4  # failed DALI runs in a row before the accelerator retires
PROFILE_BATCHES = 10  # gpu_sharing="auto": iterations timed per mode before choosing
RUN_IMAGES = 128  # samples per DALI run at most: on an H100 one run of 4 took ~15 ms (AoT bench, 2026-11-24)


class AcceleratorWorker:
    def __init__(
        self,
        board,
        dataset,
        policy,
        max_images: int,
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
        from fusionflow.accel.dali_graph import DaliPolicyPipeline
        from fusionflow.policy import load_policy

        self.board, self.dataset, self.seed = board, dataset, seed
        self.counters = counters if counters is not None else board.counters
        self.max_pixels = load_policy(policy).max_pixels
        self.largest_first, self.sharing, self.device_ring = largest_first, sharing, device_ring
        self._make = lambda: DaliPolicyPipeline(
            policy, max_images, device=device, device_id=device_id, num_threads=num_threads
        )
        self.max_images = max_images  # samples per DALI run: several tiny-batches of one mini-batch
        t0 = time.perf_counter()
        self.pipeline = self._make() if aot else None  # ahead of time: nothing is built on the hot path
        self.build_seconds = time.perf_counter() - t0 if aot else 0.0
        self.counters.accelerator_builds += 1 if aot else 0
        self.tiny_batches = 0  # done by this accelerator (the bridge lends after a warm-up count of them)
        self.failures_in_a_row = 0
        self.retired: str | None = None  # why the accelerator stopped taking work, once it has
        self.step_event = None  # the training work before the loader's last next() (mark_step)
        self.bridge = bridge  # MemoryBridge (memory_bridge on); dropped if lending fails
        self.window_open = False  # the loader's prep window (open_window / close_window; consulted while gated)
        self._active = None  # the tiny-batches of the DALI run in flight
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fusionflow-accelerator", daemon=True)

    def start(self) -> None:
        """Start the thread (after the board's `add_worker_kind`)."""
        self._thread.start()

    def busy_with_stale(self, generation: int) -> bool:
        group = self._active
        return group is not None and any(w.generation != generation for w in group)

    @property
    def gated(self) -> bool:
        """Works only inside the loader's prep window: temporal sharing of a GPU (with or without
        the bridge; with DALI's CPU backend only when a bridge stands in, as in the tests)."""
        return self.sharing == "temporal" and (self.device_ring is not None or self.bridge is not None)

    # ---------------------------------------------------------------- the loader's prep window (GpuSession)
    def mark_step(self, event) -> None:
        """Temporal sharing: the training work queued before the loader's next() ends with `event`;
        each DALI run waits for it first."""
        self.step_event = event

    def open_window(self, stream) -> None:
        """The loader waits for a mini-batch: a gated accelerator may run now (and borrow the blocks
        the bridge lends, armed on the training `stream`)."""
        with self.board.cond:
            if self.bridge is not None:
                self.bridge.arm(stream)
            self.window_open = True
            self.board.cond.notify_all()

    def close_window(self) -> bool:
        """The mini-batch is ready: the run in flight finishes, and no other starts until the next
        window. False when no window was open."""
        if not self.window_open:
            return False
        with self.board.cond:
            self.window_open = False
            self.wait_idle()
        return True

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
        self.board.drop_reservations()
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
                        or not (group := board.take_accel(self.largest_first, self.max_images))
                    )
                ):
                    board.cond.wait(0.5)
                if self._stop or self.retired:
                    return
                self._active = group
            fatal = None
            started = time.monotonic_ns()
            try:
                done, given_back, ok = self._process(group)
            except AcceleratorError as exc:  # the pipeline cannot be rebuilt (or is closed)
                log.error("accelerator failed on tiny-batches %s: %s", [w.indices for w in group], exc)
                done, given_back, ok, fatal = [], group, False, str(exc)
            except Exception:  # anything unexpected: the CPU workers take it over
                log.exception(
                    "accelerator failed on tiny-batches %s; the CPU workers take them", [w.indices for w in group]
                )
                done, given_back, ok = [], group, False
            with board.cond:
                self._active = None
                board.cond.notify_all()  # a loader closing its prep window waits for this
                self._account(done, given_back, ok, started)
                if fatal is not None:
                    self._retire(fatal)
                elif self.failures_in_a_row >= MAX_FAILURES:
                    self._retire(f"{self.failures_in_a_row} DALI runs in a row failed")
            board.wake()

    def _account(self, done, given_back, ok: bool | None, started: int) -> None:
        """Under board.cond: complete what DALI produced, give the rest back to the CPU workers (marked
        CPU-only); `ok` False counts a failed DALI run, None (not DALI's kind of sample) does not."""
        board = self.board
        for work, side in done:
            self.tiny_batches += 1
            self.counters.accelerator_tiny_batches += 1
            if board.trace is not None:
                board.trace.tiny_batch(None, work, started, time.monotonic_ns(), board.sizes)
            board.complete(work, [], on_accelerator=True, targets=side)
        if done:
            self.counters.accelerator_runs += 1
            self.failures_in_a_row = 0
        self.failures_in_a_row += ok is False
        for work in given_back:
            self.counters.accelerator_given_back += 1
            work.cpu_only = True
        if given_back:
            board.requeue(given_back)

    def _process(self, group) -> tuple[list, list, bool | None]:
        """One DALI run over the group's samples: ([(work, targets)] done, [work] given back, ok).
        A tiny-batch that is not DALI's kind of sample (not encoded bytes, or over the policy's
        max_pixels: the CPU path refuses it by name) is given back and the rest run."""
        runnable, samples, labels, given_back = [], [], [], []
        for work in group:
            items = [split_item(self.dataset[index], index) for index in work.indices]
            if all(
                isinstance(s, (bytes, bytearray, memoryview)) and within_pixel_limit(s, self.max_pixels)
                for s, _ in items
            ):
                runnable.append(work)
                samples += [s for s, _ in items]
                labels += [label for _, label in items]
            else:
                given_back.append(work)
        if not runnable:
            return [], given_back, None
        if self.pipeline is not None:
            ok = self._run_pipeline(self.pipeline, runnable, samples)
        else:
            pipeline = self._make()  # the DALI-Naive ablation: build for every run, close after it
            self.counters.accelerator_builds += 1
            try:
                ok = self._run_pipeline(pipeline, runnable, samples)
            finally:
                pipeline.close()
        if not ok:
            return [], given_back + runnable, False
        return self._store_targets(runnable, labels), given_back, True

    def _run_pipeline(self, pipeline, group, samples) -> bool:
        """Run DALI on the group's samples and write each into its ring position; False if DALI failed."""
        if self.sharing == "temporal" and self.step_event is not None:
            self.step_event.synchronize()  # training work queued before the last next() is done
        if self.gated and self.bridge is not None:
            try:
                self.bridge.lend(self.tiny_batches)
            except Exception:  # DALI still has its own pool: carry on without the bridge
                log.exception("allocator bridge failed to lend; continuing without it")
                self.bridge = None
        indices = [i for w in group for i in w.indices]
        try:
            copies = [c for w in group for c in (w.copies or (0,) * len(w.indices))]
            kw = {"copies": copies} if any(copies) else {}  # repeated augmentation's copy numbers
            out = pipeline.run(samples, indices, self.seed, group[0].epoch, **kw)
        except DeviceOutOfMemory as exc:
            self.counters.accelerator_out_of_memory += 1
            log.warning("accelerator out of memory on samples %s; the CPU workers take them: %s", indices, exc)
            return False
        except DecodeError as exc:
            log.info("accelerator could not decode %s: %s", indices, exc)
            return False
        positions = [p for w in group for p in w.positions]  # one mini-batch, one ring slot
        if self.device_ring is not None:
            self.device_ring.write(group[0].slot, positions, out)
        else:
            images = self.board.ring.images
            for k, pos in enumerate(positions):
                images[group[0].slot, pos] = np.asarray(out[k])
        return True

    def _store_targets(self, group, labels) -> list:
        """Each sample's target into the ring; [(work, targets that are not ints)] (runtime/targets.py)."""
        ring, done, k = self.board.ring, [], 0
        for work in group:
            side = {}
            for pos in work.positions:
                targets.store(ring.labels[work.slot], pos, labels[k], side)
                k += 1
            done.append((work, side))
        return done


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
