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
  * the accelerator (DALI) thread: a span per tiny-batch it ran;
  * each borrowed worker (another rank's worker lent to this loader): its tiny-batches.

Clock: `time.monotonic_ns()` everywhere -- CLOCK_MONOTONIC on Linux, one clock for every process of
the machine, so a worker's span (timed in the worker, sent in its DONE message) and the training
loop's waits share an axis. Timestamps in the file are microseconds since the recorder started.

Memory: the recorder keeps at most `max_events` spans (a ring: the oldest go first; the file's
otherData.dropped_events says how many). Off (no recorder), each hook is one `is None` test.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque

DEFAULT_MAX_EVENTS = 200_000  # ~ 60 MB of Python tuples at worst; a few hundred epochs of a small run
TID_TRAINING, TID_ACCEL, TID_SLOT, TID_CPU, TID_GUEST = 1, 2, 10, 100, 1000
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
        self._lent_since: dict[int, int] = {}

    # ---------------------------------------------------------------- hooks
    def _span(self, tid: int, name: str, start_ns: int, end_ns: int, args: dict) -> None:
        self._appended = next(self._count) + 1
        self._events.append((tid, name, start_ns, end_ns, args))

    def wait(self, start_ns: int, end_ns: int, batch: int, samples: int) -> None:
        """The training loop blocked in next() for mini-batch `batch`."""
        self._span(TID_TRAINING, f"wait mb{batch}", start_ns, end_ns, {"mini_batch": batch, "samples": samples})

    def mini_batch(self, slot: int, seq: int, size: int, submitted_ns: int, ready_ns: int) -> None:
        tid = TID_SLOT + slot
        self._tracks.setdefault(tid, f"ring slot {slot}: mini-batches")
        self._span(tid, f"mb{seq}", submitted_ns, ready_ns, {"mini_batch": seq, "samples": size})

    def tiny_batch(self, worker, work, start_ns: int, end_ns: int, sizes=None) -> None:
        """`worker`: an own CPU worker's id (int), a borrowed worker's label (str), or None: the accelerator."""
        if worker is None:
            tid = TID_ACCEL
            self._tracks.setdefault(tid, "accelerator (DALI)")
        elif isinstance(worker, int):
            tid = TID_CPU + worker
            self._tracks.setdefault(tid, f"CPU worker {worker}")
        else:
            tid = self._guests.get(worker)
            if tid is None:
                tid = self._guests[worker] = TID_GUEST + len(self._guests)
                self._tracks[tid] = f"borrowed worker {worker}"
        args = {"mini_batch": work.seq, "samples": len(work.indices), "indices": list(work.indices)}
        if sizes is not None:
            args["bytes"] = int(sum(sizes[i] for i in work.indices))
        self._span(tid, f"mb{work.seq}", start_ns, end_ns, args)

    def lent(self, worker: int, peer) -> None:
        self._lent_since[worker] = time.monotonic_ns()

    def home(self, worker: int, tasks: int) -> None:
        start = self._lent_since.pop(worker, None)
        if start is not None:
            tid = TID_CPU + worker
            self._tracks.setdefault(tid, f"CPU worker {worker}")
            self._span(tid, "lent", start, time.monotonic_ns(), {"tiny_batches": tasks, "lent": True})

    # ---------------------------------------------------------------- output
    @property
    def dropped(self) -> int:
        """Spans the ring let go of (the oldest first)."""
        return self._appended - len(self._events)

    def to_dict(self) -> dict:
        """The trace-event document (JSON object format)."""
        o = self.origin_ns
        events = [{"ph": "M", "pid": PID, "tid": 0, "ts": 0, "name": "process_name",
                   "args": {"name": "fusionflow loader"}}]
        for tid, label in sorted(self._tracks.items()):
            events.append({"ph": "M", "pid": PID, "tid": tid, "ts": 0, "name": "thread_name", "args": {"name": label}})
            events.append({"ph": "M", "pid": PID, "tid": tid, "ts": 0, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
        for tid, name, start, end, args in list(self._events):
            events.append({"ph": "X", "pid": PID, "tid": tid, "name": name, "cat": _category(tid, args),
                           "ts": (start - o) / 1e3, "dur": max(0, end - start) / 1e3, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"clock": "CLOCK_MONOTONIC (time.monotonic_ns), microseconds since origin",
                              "origin_monotonic_ns": o, "max_events": self.max_events,
                              "dropped_events": self.dropped}}

    def write(self, path) -> None:
        """Write the trace (atomically: a reader never sees half a file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))
        os.replace(tmp, path)


def _category(tid: int, args: dict) -> str:
    if tid == TID_TRAINING:
        return "wait"
    if TID_SLOT <= tid < TID_CPU:
        return "mini-batch"
    if args.get("lent"):
        return "lent"
    return "tiny-batch"


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)
