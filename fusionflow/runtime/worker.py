"""The CPU worker process: take tiny-batch tasks, decode + augment each sample straight into its
slot of the shared batch ring, report completion. Everything it touches is an argument.

Watchdog: the worker waits for tasks in `WATCHDOG_S` slices; when it finds itself orphaned (the
training process died without stopping it) it unlinks the ring segment and exits, so neither the
process nor /dev/shm outlives the job by more than a slice.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import traceback

from fusionflow.runtime import messages as m
from fusionflow.runtime.shm import BatchRing, RingLayout, unlink

WATCHDOG_S = 0.5


def describe(dataset, index: int) -> str:
    fn = getattr(dataset, "describe", None)
    if fn is not None:
        try:
            return f"sample {index} ({fn(index)})"
        except Exception:  # a describe() that fails must not hide the real error
            pass
    return f"sample {index}"


def split_item(item, index: int):
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(f"dataset[{index}] must return (sample, label), got {type(item).__name__}")
    sample, label = item
    return sample, int(label)


def worker_loop(worker_id: int, dataset, policy, ring_name: str, layout: RingLayout, conn, seed: int,
                base_seed: int, worker_init_fn, parent_pid: int, cpu: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    ring = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        random.seed(base_seed + worker_id)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed((base_seed + worker_id) % 2**32)
        if "torch" in sys.modules:
            torch = sys.modules["torch"]
            torch.set_num_threads(1)
            torch.manual_seed(base_seed + worker_id)
        from fusionflow.ops.pipeline import CpuPipeline
        pipe = CpuPipeline(policy)
        ring = BatchRing(layout, ring_name)
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
    except BaseException:
        conn.send_bytes(m.pack_fatal(worker_id, traceback.format_exc()))
        return
    conn.send_bytes(m.pack_ready(worker_id))
    try:
        while True:
            if not conn.poll(WATCHDOG_S):
                if os.getppid() != parent_pid:  # orphaned: clean up what the owner cannot
                    unlink(ring_name)
                    return
                continue
            msg = conn.recv_bytes()
            if m.kind_of(msg) == m.STOP:
                return
            task = m.unpack_task(msg)
            failures = []
            for pos, index in zip(task.positions, task.indices):
                try:
                    sample, label = split_item(dataset[index], index)
                    pipe(sample, index, seed, task.epoch, out=ring.images[task.slot, pos],
                         what=describe(dataset, index))
                    ring.labels[task.slot, pos] = label
                except Exception as exc:
                    failures.append(m.SampleFailure(pos, index, describe(dataset, index), type(exc).__name__,
                                                    str(exc), traceback.format_exc()))
            conn.send_bytes(m.pack_done(task.task_id, task.generation, failures))
    except (EOFError, OSError, BrokenPipeError):
        return  # the manager closed its end: nothing left to report to
    finally:
        if ring is not None:
            ring.close()
