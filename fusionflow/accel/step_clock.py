"""The accelerator thread's steps timed one after another for the loader's trace (its "accelerator thread:
steps" track, fusionflow/loader/trace.py `TraceRecorder.accel_step`): each step's wall time and the thread's
CPU time in it, so a step whose wall time is far above its CPU time shows the thread waiting -- on DALI, the
input helpers or the GIL. Not tracing, it records nothing (two clock reads a clock made, none a step)."""

from __future__ import annotations

import time


class StepClock:
    """`mark(step, ...)` records the span from the last mark (or the clock's making) to now on `recorder`
    (anything with `accel_step`, or None: nothing recorded)."""

    def __init__(self, recorder):
        self.recorder, self.wall, self.cpu = recorder, time.monotonic_ns(), time.thread_time_ns()

    def mark(self, step: str, seq: int, samples: int) -> None:
        if self.recorder is not None:
            wall, cpu = time.monotonic_ns(), time.thread_time_ns()
            self.recorder.accel_step(step, self.wall, wall, seq, samples, cpu - self.cpu)
            self.wall, self.cpu = wall, cpu
