"""A timeline of a loader's run as a Chrome / Perfetto trace-event file (JSON).

    loader = FusionFlowLoader(ds, ..., trace="run.json")   # whole run, written at close()
    with loader.trace("epoch3.json"):                       # or a stretch of it
        for x, y in loader: ...

Open the file at https://ui.perfetto.dev or chrome://tracing. One process ("fusionflow loader"),
one track (thread) each for:
  * the training loop: a span per wait at next() (its duration is the one in stats.wait_seconds);
  * each ring slot: a span per mini-batch from submission to its last sample (ready);
  * each CPU worker: a span per tiny-batch it ran (args: mini-batch, samples, dataset indices,
    encoded bytes), and a "lent to LM n" span while the global manager had lent it out;
  * the accelerator (DALI) thread: a span per tiny-batch it ran (from the run's take to its landing), and on
    a track of its own each step of its loop (read, prepare, inputs, submit, outputs, land; args: the thread's CPU
    time in it, so a step whose wall time is far above its CPU time was waiting -- on DALI, the input
    helpers or the GIL);
  * each borrowed worker (another rank's worker lent to this loader): its tiny-batches.

Clock: `time.monotonic_ns()` everywhere -- CLOCK_MONOTONIC on Linux, one clock for every process of
the machine, so a worker's span (timed in the worker, sent in its DONE message) and the training
loop's waits share an axis. Timestamps in the file are microseconds since the recorder started.

Memory: the recorder keeps at most `max_events` spans (a ring: the oldest go first; the file's
otherData.dropped_events says how many). Off (no recorder), each hook is one `is None` test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
import warnings
from collections import deque

DEFAULT_MAX_EVENTS = 200_000  # ~ 60 MB of Python tuples at worst; a few hundred epochs of a small run
# track ids: ring slots from TID_SLOT, CPU workers from TID_CPU, guests from TID_GUEST (10 and 100 apart, slot 90 of
# prefetch_factor=100 was drawn on CPU worker 0's track)
TID_TRAINING, TID_ACCEL, TID_ACCEL_STEPS, TID_SLOT, TID_CPU, TID_GUEST = 1, 2, 3, 1_000, 1_000_000, 2_000_000
PID = 1


def check_path(path, name: str = "trace"):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}={path!r} must be a file path (str or os.PathLike) or None")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{name}='' : give a file name such as 'run.json'")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{name}={path!r}: directory {parent!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{name}={path!r} is a directory: give a file name in it, such as 'run.json'")
    return path


class TraceRecorder:
    """Collects spans from the training thread, the manager thread and the accelerator thread
    (deque appends are atomic), and writes them as trace-event JSON."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events={max_events!r} must be an integer >= 1")
        self.origin_ns = time.monotonic_ns()
        self.max_events = max_events
        self._events: deque = deque(maxlen=max_events)  # (tid, name, start_ns, end_ns, args)
        self._count = itertools.count()  # next() is atomic: several threads record
        self._appended = 0
        self._tracks: dict[int, str] = {TID_TRAINING: "training loop: wait at next()"}
        self._guests: dict[str, int] = {}
        self._lent_since: dict[int, tuple] = {}
        self._sizes = None

    # ---------------------------------------------------------------- hooks
    # A span is a flat tuple (tid, kind, start_ns, end_ns, mini-batch, samples, detail): no dict or
    # string per span on the hot path; a tiny-batch's detail is its work's own indices tuple (shared).
    def _span(self, tid: int, kind: str, start_ns: int, end_ns: int, seq: int, samples: int, detail=None) -> None:
        self._appended = next(self._count) + 1
        self._events.append((tid, kind, start_ns, end_ns, seq, samples, detail))

    def wait(self, start_ns: int, end_ns: int, batch: int, samples: int) -> None:
        """The training loop blocked in next() for mini-batch `batch`."""
        self._span(TID_TRAINING, "wait", start_ns, end_ns, batch, samples)

    def mini_batch(self, slot: int, seq: int, size: int, submitted_ns: int, ready_ns: int) -> None:
        tid = TID_SLOT + slot
        if tid not in self._tracks:
            self._tracks[tid] = f"ring slot {slot}: mini-batches"
        self._span(tid, "mini-batch", submitted_ns, ready_ns, seq, size)

    def tiny_batch(self, worker, work, start_ns: int, end_ns: int, sizes=None) -> None:
        """`worker`: an own CPU worker's id (int), a borrowed worker's label (str), or None: the accelerator.
        `sizes`: the dataset's encoded sizes (for each span's bytes), or None."""
        if worker is None:
            tid = TID_ACCEL
        elif isinstance(worker, int):
            tid = TID_CPU + worker
        else:
            tid = self._guests.get(worker)
            if tid is None:
                tid = self._guests[worker] = TID_GUEST + len(self._guests)
        if tid not in self._tracks:
            self._tracks[tid] = (
                "accelerator (DALI)"
                if worker is None
                else f"CPU worker {worker}"
                if isinstance(worker, int)
                else f"remote worker {worker} (Ray)"
                if worker.startswith("ray")
                else f"borrowed worker {worker}"
            )
        self._sizes = sizes
        self._span(tid, "tiny-batch", start_ns, end_ns, work.seq, len(work.indices), work.indices)

    def accel_step(self, step: str, start_ns: int, end_ns: int, seq: int, samples: int, cpu_ns: int) -> None:
        """One step of the accelerator thread's loop for a run of `samples` (mini-batch `seq` first), and the
        thread's CPU time in it."""
        self._tracks.setdefault(TID_ACCEL_STEPS, "accelerator thread: steps")
        self._span(TID_ACCEL_STEPS, "step", start_ns, end_ns, seq, samples, (step, cpu_ns))

    def discarded(self, worker: int, work, start_ns: int, end_ns: int) -> None:
        """Own CPU worker `worker`'s copy of a tiny-batch that ran twice (runtime/reruns.py), stopped
        because the other copy finished first."""
        tid = TID_CPU + worker
        self._tracks.setdefault(tid, f"CPU worker {worker}")
        self._span(tid, "discarded", start_ns, end_ns, work.seq, len(work.indices), work.indices)

    def lent(self, worker: int, peer) -> None:
        self._lent_since[worker] = (time.monotonic_ns(), peer)

    def home(self, worker: int, tasks: int) -> None:
        since = self._lent_since.pop(worker, None)
        if since is not None:
            tid = TID_CPU + worker
            self._tracks.setdefault(tid, f"CPU worker {worker}")
            self._span(tid, "lent", since[0], time.monotonic_ns(), -1, tasks, since[1])

    # ---------------------------------------------------------------- output
    @property
    def dropped(self) -> int:
        """Spans the ring let go of (the oldest first)."""
        return self._appended - len(self._events)

    def to_dict(self) -> dict:
        """The trace-event document (JSON object format)."""
        o, sizes = self.origin_ns, self._sizes
        spans = list(self._events)  # first: a track a span names is in _tracks by then
        events = [
            {"ph": "M", "pid": PID, "tid": 0, "ts": 0, "name": "process_name", "args": {"name": "fusionflow loader"}}
        ]
        for tid, label in sorted(self._tracks.items()):
            events.append({"ph": "M", "pid": PID, "tid": tid, "ts": 0, "name": "thread_name", "args": {"name": label}})
            events.append(
                {"ph": "M", "pid": PID, "tid": tid, "ts": 0, "name": "thread_sort_index", "args": {"sort_index": tid}}
            )
        for tid, kind, start, end, seq, samples, detail in spans:
            if kind == "lent":
                name, args = f"lent to LM {detail}", {"tiny_batches": samples, "borrower": detail}
            elif kind == "step":
                name, args = detail[0], {"mini_batch": seq, "samples": samples, "thread_cpu_us": detail[1] / 1e3}
            else:
                name = f"wait mb{seq}" if kind == "wait" else f"mb{seq}"
                name += " (discarded: its other copy finished first)" if kind == "discarded" else ""
                args = {"mini_batch": seq, "samples": samples}
                if kind in ("tiny-batch", "discarded"):
                    args["indices"] = list(detail)
                    if sizes is not None:
                        args["bytes"] = int(sum(sizes[i] for i in detail if i < len(sizes)))  # a grown dataset
            events.append(
                {
                    "ph": "X",
                    "pid": PID,
                    "tid": tid,
                    "name": name,
                    "cat": kind,
                    "ts": max(0, start - o) / 1e3,  # begun before the recorder: drawn from its start
                    "dur": max(0, end - max(start, o)) / 1e3,
                    "args": args if start >= o else {**args, "started_before_trace_us": (o - start) / 1e3},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "clock": "CLOCK_MONOTONIC (time.monotonic_ns), microseconds since origin",
                "origin_monotonic_ns": o,
                "max_events": self.max_events,
                "dropped_events": self.dropped,
            },
        }

    def write(self, path) -> None:
        """Write the trace (atomically: a reader never sees half a file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        text = json.dumps(self.to_dict(), separators=(",", ":"))  # dumps: C encoder (dump's is Python)
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def write_or_warn(self, path) -> None:
        """`write`, a failure (the directory gone, the disk full) a warning: a trace is a diagnostic, never the
        reason a training loop stops or raises something other than its own error."""
        try:
            self.write(path)
        except OSError as exc:
            warnings.warn(
                f"fusionflow: the trace could not be written to {path!r}: {exc}", RuntimeWarning, stacklevel=3
            )


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


class Tracing:
    """A loader's tracing: the recorder in use -- the whole run's (`trace=path`, rewritten at each
    iteration's end and at close()), or a `loader.trace(path)` block's -- and the hook that installs
    a new recorder into a running runtime (`on_change`, set by the loader's `LoaderRuntime`)."""

    def __init__(self, path=None):
        self.path = path  # the trace= file, or None
        self.recorder = None if path is None else TraceRecorder()
        self.on_change = None  # callback(recorder or None) when the recorder changes
        self._block_path = None  # the file a running `block` writes

    @contextlib.contextmanager
    def block(self, path, max_events: int | None = None):
        """Record a timeline of what runs inside the block and write it to `path` (trace-event JSON)
        at its end. Yields the recorder."""
        path = check_path(path, "path")
        if self.recorder is not None:
            raise ValueError(
                f"loader.trace({path!r}): this loader already traces (to {self._block_path or self.path!r}); "
                "one trace at a time"
            )
        recorder = TraceRecorder(DEFAULT_MAX_EVENTS if max_events is None else max_events)
        self._set(recorder)
        self._block_path = path
        try:
            yield recorder
        finally:
            self._block_path = None
            self._set(None)
            recorder.write_or_warn(path)

    def _set(self, recorder) -> None:
        self.recorder = recorder
        if self.on_change is not None:
            self.on_change(recorder)

    def wait(self, wait: float, seq: int, samples: int, end: int | None = None) -> None:
        """The training loop's wait, ending at `end` (monotonic ns; default now: pass the moment the batch was
        ready, before it was copied out); its span lasts exactly `wait` (as in stats.wait_seconds)."""
        if self.recorder is not None:
            end = time.monotonic_ns() if end is None else end
            self.recorder.wait(end - round(wait * 1e9), end, seq, samples)

    def flush(self) -> None:
        """Rewrite the trace= file with what was recorded so far."""
        if self.path is not None and self.recorder is not None:
            self.recorder.write_or_warn(self.path)
