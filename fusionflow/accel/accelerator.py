"""The accelerator worker: a thread in the training process feeding a prebuilt DALI pipeline the largest tiny-batches
of the local manager's queue, each output written to its mini-batch position. A worker kind (runtime/board.py).

A run takes a mini-batch's share (its G largest samples as whole tiny-batches: scheduling/split.py via share_feed.py)
and up to MERGE_SHARES - 1 next shares that fit (on a GPU taken ahead); up to `depth` runs are in flight, collected in
order; a mini-batch late on its CPU side when training waits gets a tail run of its largest unstarted tiny-batches.
Helper processes read and draw the runs (input_helpers.py, helper_reads.py; else run_read.py), the bytes fed uncopied.
`device="gpu"`: into a device ring merged at delivery; "cpu": DALI's CPU backend into the host ring. What DALI cannot
run (not encoded bytes, over decode.max_pixels, undecodable) goes back marked CPU-only. `temporal` sharing: one run
in flight, in the prep window only, after the training work queued before next(); `spatial`: concurrently. A failed
run drops the pipeline (rebuilt next run) and gives the runs in flight to the CPU workers; MAX_FAILURES in a row, an
unbuildable pipeline or a stalled run retire it. CPU time: `accelerator_feed_cpu_seconds` (`..._land_...` of it).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time

import numpy as np

from fusionflow.accel.at_exit import keep_or_close
from fusionflow.accel.config import RUNS_IN_FLIGHT_CPU
from fusionflow.accel.input_helpers import RunSource
from fusionflow.accel.run_ledger import RunLedger
from fusionflow.accel.share_feed import ShareFeed
from fusionflow.accel.step_clock import StepClock
from fusionflow.errors import AcceleratorError, DecodeError, DeviceOutOfMemory
from fusionflow.runtime import liveness, targets

log = logging.getLogger(__name__)
MERGE_SHARES = 2  # mini-batch shares one run may hold (not gated): its fixed cost paid once for them
_COPIES = operator.attrgetter("copies")  # a Work's copies, as one C-level call


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
        hw_decoder_load: float | None = None,
        device_ring=None,
        sharing: str = "spatial",
        counters=None,
        bridge=None,
        split=None,
        cpu_workers: int = 1,
        tiny_batch_size: int = 1,
        inputs=None,
        depth: int = RUNS_IN_FLIGHT_CPU,  # DALI runs in flight (not gated): the loader passes runs_in_flight
        pipeline=None,  # a DaliPolicyPipeline of this kind left idle by an earlier accelerator: run, not built again
        keep_pipeline=None,  # stop() hands it the pipeline when it can run again (GpuSession: for the next epoch)
    ):
        from fusionflow.accel.dali_graph import DaliPolicyPipeline
        from fusionflow.policy import load_policy

        self.board, self.seed = board, seed
        self.counters = counters if counters is not None else board.counters
        self.largest_first, self.sharing, self.device_ring = largest_first, sharing, device_ring
        self._make = lambda: DaliPolicyPipeline(
            policy,
            max_images,
            device=device,
            device_id=device_id,
            num_threads=num_threads,
            depth=depth,
            hw_decoder_load=hw_decoder_load,
        )
        self.max_images, self.depth = max_images, depth  # a run's samples (<= MERGE_SHARES shares); runs in flight
        # the runs' samples and host inputs: the input helpers (`inputs`, owned from here) while they answer, else here
        self.source = RunSource(inputs, dataset, load_policy(policy).max_pixels, seed, self.counters)
        built = aot and pipeline is None  # aot: nothing built on the hot path
        t0, self.pipeline = time.perf_counter(), self._make() if built else pipeline
        self.build_seconds = time.perf_counter() - t0 if built else 0.0
        self.counters.accelerator_builds += int(built)
        self.keep_pipeline = keep_pipeline
        self.step_event = None  # temporal sharing: the training work queued before next() ends with it (GpuSession)
        self.bridge = bridge  # MemoryBridge (memory_bridge on); dropped if lending fails; paused around a rebuild
        if self.pipeline is not None:
            self.pipeline.build_guard = self._rebuilding
        # the split rule's feed (accel/share_feed.py); None: the ablations (one tiny-batch at a time)
        batch = board.ring.layout.batch_size  # (a short last mini-batch does not set the share)
        self.shares = ShareFeed(split, board, tiny_batch_size, cpu_workers, batch) if split is not None else None
        self.borrow = split is not None and split.shares_device  # shares taken ahead on a GPU (a run's fixed cost)
        self._active: list = []  # the groups of tiny-batches of the DALI runs in flight, oldest first
        self.ledger = RunLedger(board, self.counters, self._active)  # their outcomes, failures, the retirement
        self._last_done = 0.0  # when the last run completed (its completion interval)
        self._run_seconds = 0.0  # running mean of a run's time from take to completion (the stall bound's)
        self._writing = self._stop = False  # writing a collected run's outputs (`watch` leaves it be); stopping
        self._collecting: float | None = None  # when the run the thread waits for in DALI was taken (`_stop_wait`)
        self._stopped = self._ended = False  # stop() is past its wait; the thread is past its loop (`_thread_main`)
        self.window_open = False  # the loader's prep window (GpuSession; consulted while gated)
        self._thread = threading.Thread(target=self._thread_main, name="fusionflow-accelerator", daemon=True)

    def start(self) -> None:  # after the board's `add_worker_kind`
        self._thread.start()

    @property
    def in_flight(self) -> int:  # DALI runs taken and not yet accounted
        return len(self._active)

    def holding(self, key, now: float) -> list:  # under board.cond: its runs holding mini-batch `key`'s samples
        runs = [(g, t) for g, t, *_ in self._active if any((w.generation, w.seq) == key for w in g)]
        return [(f"the DALI accelerator (a run of {sum(len(w.indices) for w in g)} samples)", now - t) for g, t in runs]

    def busy_with_stale(self, generation: int) -> bool:
        return any(group[0].generation != generation for group, *_ in self._active)  # a run is one iterator's

    @property
    def gated(self) -> bool:
        """Works only inside the prep window: temporal sharing of a GPU (on DALI's CPU backend with a bridge: tests)."""
        return self.sharing == "temporal" and (self.device_ring is not None or self.bridge is not None)

    def open_window(self) -> None:
        """The loader waits for a mini-batch: a gated accelerator may run now."""
        with self.board.cond:
            self.window_open = True
            self.board.cond.notify_all()

    def close_window(self) -> None:
        """The mini-batch is ready: the run in flight finishes, none starts until the next window (if one is open)."""
        if not self.window_open:
            return
        with self.board.cond:
            self.window_open = False
            deadline = time.monotonic() + 30.0  # the run in flight finishes
            while self._active and self._thread.is_alive() and time.monotonic() < deadline:
                self.board.cond.wait(0.05)

    def stop(self) -> None:
        """Idempotent: the tiny-batch in flight finishes, the thread ends, the pipeline closes, the helpers end."""
        with self.board.cond:
            self._stop = True
            self.board.cond.notify_all()
        self.source.interrupt()  # a run's read or inputs awaited from the helpers: given up within a slice
        other = self._thread is not threading.current_thread()
        try:  # the input helpers end even if this raised (a Ctrl-C in DALI's shutdown left them running)
            if self._thread.is_alive() and other:
                self._thread.join(timeout=(bound := self._stop_wait()))
            with self.board.cond:  # the pipeline is released by the later of this and the thread's end
                self._stopped, mine = True, self._ended or not self._thread.is_alive()
                pipeline, self.pipeline = (self.pipeline, None) if mine else (None, self.pipeline)
            if not mine and other:  # in DALI still: it keeps or closes the pipeline when the run returns
                log.warning(
                    "the accelerator thread is still in a run (its read or DALI) after %.0f s; it is left to end", bound
                )
            if pipeline is not None:
                self._release(pipeline)
        finally:
            self.source.close()

    def _stop_wait(self) -> float:
        """stop()'s wait: 10 s for the runs in flight to be collected (the pipeline kept), 1 s once the oldest is
        overdue, taken over 2 s and 4 mean runs ago (hung: timeout= raised, the epoch ends, and costs no more), or
        once the accelerator retired (a run stuck past the stall bound, given to the CPU workers: the thread is
        still in it, in DALI or a read, with nothing in flight to wait for)."""
        with self.board.cond:
            since = self._collecting if self._collecting is not None else self._active[0][1] if self._active else None
            retired = self.ledger.retired is not None
        overdue = since is not None and time.monotonic() - since > max(2.0, 4 * self._run_seconds)
        return 1.0 if overdue or retired else 10.0

    def _release(self, pipeline) -> None:  # the stopped thread's pipeline: kept for the next epoch, or closed
        keep_or_close(pipeline, self.keep_pipeline, self.retired)

    @contextlib.contextmanager
    def _rebuilding(self):  # around the pipeline's rebuild after a failed run (in its submit): the bridge paused
        with self.bridge.paused() if self.bridge is not None else contextlib.nullcontext():
            yield
        self.counters.accelerator_builds += 1

    @property
    def retired(self) -> str | None:  # why the accelerator stopped taking work, once it has
        return self.ledger.retired

    def watch(self, now: float, lost: float = 0.0) -> None:
        """Under board.cond, from the manager thread each turn: the oldest run in flight past the stall bound
        (the CPU workers' stuck bound, runtime/liveness.py, over the mean run time from take to outputs:
        DALI hung, or a read that never returns, and this thread blocked) retires the accelerator and
        gives every run in flight to the CPU workers; outputs that come later are dropped. `lost`: seconds this
        process did not run (the whole job stopped, runtime/stuck.py): the runs' clocks skip them, so a pause
        neither retires it nor reads as a slow run to the split."""
        if lost:
            self._active[:] = [(g, t + lost, tail, p and (*p[:2], p[2] + lost)) for g, t, tail, p in self._active]
            self._last_done += lost if self._last_done else 0.0
            self._collecting = None if self._collecting is None else self._collecting + lost
        waited = now - self._active[0][1] if self._active else 0.0
        if self.retired or self._writing or waited <= liveness.stuck_bound(self._run_seconds):
            return
        first = list(self._active[0][0][0].indices)
        self.ledger.retire(f"a DALI run (samples {first}, ...) made no progress for {waited:.0f} s")
        self.ledger.lose_all()

    def _thread_main(self) -> None:  # `_run`; a failure outside a DALI step (a bug) retires the accelerator
        try:
            self._run()
        except BaseException as exc:  # a thread ended silently with work taken would leave training waiting
            log.exception("the accelerator thread failed")
            with self.board.cond:
                self.ledger.lose_all()
                self.ledger.retire(f"its thread failed: {exc!r}")
        finally:
            with self.board.cond:  # stop() gave up waiting for this thread: the pipeline's release is its own
                self._ended = True
                pipeline, self.pipeline = (self.pipeline, None) if self._stopped else (None, self.pipeline)
            try:
                if pipeline is not None:
                    self._release(pipeline)
            except Exception:
                log.exception("closing the DALI pipeline of a stopped accelerator failed")

    def _run(self) -> None:
        """Take a run, prepare and submit it, and collect the oldest when `depth` are in flight (one while gated: the
        window must close on a finished run) or nothing else is to be had, also while awaiting the oldest's due."""
        board, inflight = self.board, self._active
        while True:
            cpu0 = time.thread_time()  # the whole loop's CPU: take attempts and wake-ups too (waits sleep)
            with board.cond:
                group, due = None, 0.0
                while not self._stop and not self.retired:
                    room = len(inflight) < (1 if self.gated else self.depth)
                    if room and not (board.draining() or (self.gated and not self.window_open)):
                        merge = 1 if self.gated else MERGE_SHARES
                        tail = self.shares.tail(len(inflight)) if self.shares is not None else None
                        group = board.take_accel(self.largest_first, self.max_images, tail, merge, self.borrow)
                        if group:  # (tiny-batches, taken at, a tail run, what DALI was given): held nowhere else
                            inflight.append((group, time.monotonic(), board.took_tail, None))
                            break
                    if inflight and not (due := self._due(due)):
                        break
                    board.cond.wait(due - time.monotonic() if inflight else 0.5)
                if ended := self._stop or self.retired:
                    lost, inflight[:] = list(inflight), []
                    self._collecting = min((t for _, t, *_ in lost), default=None)  # `_drain` collects them
                    board.requeue([w for g, *_ in lost for w in g])
                    board.cond.notify_all()
            if ended:
                return self._drain()
            if group:
                self._guarded(self._submit, group)
            else:
                self._guarded(self._collect, None)
            with board.cond:
                self.counters.accelerator_feed_cpu_seconds += time.thread_time() - cpu0
            board.wake()

    def _due(self, due: float) -> float:  # when to collect the oldest run in flight (ShareFeed.due); 0: now
        return 0.0 if self.shares is None or self.gated else self.shares.due(self._active, self._last_done, due)

    def _drain(self) -> None:
        """Stopping: collect and drop the runs DALI still holds, so its pipeline is kept idle for the next epoch."""
        ring = self.device_ring  # on a GPU: ordered on the ring's stream and waited for asleep, not spun on
        try:
            while self.keep_pipeline is not None and not self.retired and getattr(self.pipeline, "in_flight", 0):
                self.pipeline.collect(ring.stream if ring is not None else None)
                if ring is not None:
                    ring.wait_for_outputs()
        except Exception:  # a failed run: the pipeline is closed at release, not kept
            log.debug("draining the DALI runs in flight failed", exc_info=True)
        finally:
            self._collecting = None

    def _guarded(self, step, group) -> None:
        """Run `step` (submit or collect); an unexpected failure gives every run in flight back to the
        CPU workers (the pipeline is rebuilt on the next run), an AcceleratorError also retires (a pipeline that cannot
        be rebuilt, or run its sizing run: dali_graph.py `_sizing_run`)."""
        fatal = None
        try:
            step(group)
            return
        except (DeviceOutOfMemory, DecodeError) as exc:  # DALI discarded the pipeline, the runs in flight with it
            return self.ledger.failed_run(exc)
        except AcceleratorError as exc:  # the pipeline cannot be rebuilt (or is closed)
            log.error("accelerator failed: %s", exc)
            fatal = str(exc)
        except Exception:  # anything unexpected: the CPU workers take it over
            log.exception("accelerator failed; the CPU workers take its tiny-batches")
        if self.pipeline is not None:
            self.pipeline.close() if fatal else self.pipeline.reset()
        with self.board.cond:
            self.ledger.lose_all(fatal or "an unexpected error (logged)")
            if fatal is not None:
                self.ledger.retire(fatal)

    def _submit(self, group) -> None:
        """Prepare the group's samples and submit its DALI run; a tiny-batch not DALI's kind of sample (not encoded
        bytes, or over the policy's max_pixels: the CPU path refuses it by name) is given back, the rest run."""
        board = self.board
        clock = StepClock(board.trace)  # the loop's steps on the trace's own track (its wall and CPU time)
        r = self.source.read(group)
        runnable, given_back, samples, labels, sizes = r.runnable, r.given_back, r.samples, r.labels, r.sizes
        read_at = time.monotonic()  # a run that finds DALI idle is DALI's from here (ShareFeed.run_done)
        clock.mark("read", group[0].seq, len(samples))
        pipeline = self.pipeline
        if pipeline is None and runnable:  # the DALI-Naive ablation: build for every run, close after it
            pipeline = self._make()
            pipeline.full_first_run = False  # its one run: no decoder to size for later runs (the paper's DALI-Naive)
            self.counters.accelerator_builds += 1
        with board.cond:  # the run in flight becomes what DALI is given, unless `watch` gave it up during a long read
            entry = next((e for e in self._active if e[0] is group), None)  # (the CPU workers have it), or stopping
            if self._stop or entry is None:  # (`_run` gives back what is still in flight when it sees `_stop`)
                if pipeline is not self.pipeline:
                    pipeline.close()
                if r.keep is not None:  # the helpers' slot of its bytes: nobody will read them
                    r.keep.release()
                return
            if given_back:  # none read: a failed run
                self.ledger.account([], given_back, False if r.unreadable and not runnable else None, 0, r.unreadable)
            if not runnable:
                self._active.remove(entry)
                board.cond.notify_all()
                return
            self._active[self._active.index(entry)] = (runnable, entry[1], entry[2], (pipeline, labels, read_at))
        indices = [i for w in runnable for i in w.indices]
        any_copies = any(map(_COPIES, runnable))
        copies = [c for w in runnable for c in (w.copies or (0,) * len(w.indices))] if any_copies else None
        if self.sharing == "temporal" and self.step_event is not None:
            self.step_event.synchronize()  # training work queued before the last next() is done
        if self.bridge is not None:  # lends its arena once (a no-op before the loader armed it and after)
            try:
                self.bridge.lend(self.ledger.tiny_batches)
            except Exception:  # DALI still has its own pool: carry on without the bridge
                log.exception("allocator bridge failed to lend; continuing without it")
                self.bridge = None
        clock.mark("prepare", runnable[0].seq, len(indices))  # given back, gated waits, the naive ablation's build
        columns = r.columns if r.columns is not None else self.source.columns(indices, copies, sizes, runnable[0].epoch)
        clock.mark("inputs", runnable[0].seq, len(indices))
        pipeline.submit(samples, indices, self.seed, runnable[0].epoch, copies, sizes, columns, keep=r.keep)
        clock.mark("submit", runnable[0].seq, len(indices))
        if pipeline is not self.pipeline:  # DALI-Naive: collect at once, then close
            try:
                self._collect(None)
            finally:
                pipeline.close()

    def _collect(self, _unused) -> None:
        """Wait for the oldest run in flight, write its samples into their ring positions, account it."""
        with self.board.cond:
            if not self._active:  # given up by `watch` since `_run` chose to collect: nothing of ours to wait for
                return
            group, started, tail, (pipeline, labels, read_at) = self._active[0]
        indices, asked, clock = [i for w in group for i in w.indices], time.monotonic(), StepClock(self.board.trace)
        self._collecting = started  # the run collected was taken then (stop() reads it: one overdue is hung)
        try:
            out = pipeline.collect(self.device_ring.stream if self.device_ring is not None else None)
            if self.device_ring is not None:  # DALI's run on the device, waited for asleep and within `watch`'s bound
                self.device_ring.wait_for_outputs()
        finally:
            self._collecting = None
        waited = time.monotonic() - asked  # ~0: ready when asked for (ShareFeed.collected)
        clock.mark("outputs", group[0].seq, len(indices))
        slots = [w.slot for w in group for _ in w.positions]  # shares of up to MERGE_SHARES mini-batches
        positions = [p for w in group for p in w.positions]
        with self.board.cond:  # given up by `watch`, or stopping (stop() may have left the ring closed): not written
            if self._stop or not self._active or self._active[0][0] is not group:
                return
            self._writing, land = True, time.thread_time()
        try:
            if self.device_ring is not None:
                self.device_ring.write(slots, positions, out)
            else:
                self.board.ring.images[slots, positions] = np.asarray(out.as_tensor())
            done = targets.store_works(self.board.ring.labels, group, labels)  # [(work, targets not in the ring)]
        except BaseException:
            with self.board.cond:
                self._writing = False
            raise
        now, land = time.monotonic(), time.thread_time() - land
        clock.mark("land", group[0].seq, len(indices))
        with self.board.cond:  # `_writing` ends with the run accounted: `watch` must not give up a run that landed
            self._writing = False
            self.counters.accelerator_land_cpu_seconds += land
            started = self._active.pop(0)[1]  # (as `watch` moved it on past a pause of this process)
            took = now - started
            self._run_seconds = 0.8 * self._run_seconds + 0.2 * took if self._run_seconds else took
            if self.shares is not None:  # the completion interval: from the later of the last completion and its start
                timed = not self.gated and pipeline is self.pipeline and group[0].generation == self.board.generation
                # taken before the last run completed (or one run at a time, never queued): its interval is DALI's pace
                queued = started < self._last_done or self.gated or self.depth == 1
                begun = max(started, self._last_done) if queued else max(started, read_at)  # else from its read's end
                begun = max(begun, pipeline.sized_at)  # after a new pipeline's sizing run, which went first
                self.shares.run_done(now - begun, len(indices), tail, waited if timed else None, queued)
            self._last_done = now
            self.ledger.account(done, [], True, int(started * 1e9))
            self.counters.accelerator_samples += len(indices)
            self.board.cond.notify_all()
