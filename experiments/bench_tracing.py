"""What observability costs, off and on, measured where it is paid (one process, interleaved repeats,
medians), so the numbers do not drown in a shared machine's noise the way loader epochs do:

  pipeline   a sample through CpuPipeline with tick=None (stage timing off: what every worker runs)
             vs a StageClock (stage_times=True), per sample; the measured difference is within this
             machine's noise, so the cost is also computed: ticks per sample x one tick's time
  worker     what the off path adds to every tiny-batch: the two time.monotonic_ns() stamps and the
             longer DONE message (pack + unpack), vs the tiny-batch's own time
  recorder   one TraceRecorder.tiny_batch() span (trace on, manager thread) and writing the file,
             per span

The loader-level comparison (FusionFlowLoader with trace / stage_times off vs on, epochs interleaved)
is `python -m experiments.bench_loader --modes loader --observability`.

    .venv/bin/python -m experiments.bench_tracing [--samples 64] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from experiments.harness import provenance, result_path, rotation, write_json


class _Work:
    seq, generation = 3, 1
    indices = (1, 2, 3, 4)


N = 20000  # calls per timed loop of the per-piece measurements


def pipeline_seconds(policy, samples: int, repeats: int, clock) -> tuple[float, float]:
    """Median seconds per sample through CpuPipeline with stage timing off (tick=None) and on (`clock`),
    the two alternating which goes first."""
    import numpy as np

    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.tools.synthetic import make_jpegs

    pipe = CpuPipeline(policy)
    data = make_jpegs(samples, 200, 1000, seed=1)
    out = np.empty(policy.out_shape, policy.out_dtype)

    def run(tick):
        t0 = time.perf_counter()
        for i, d in enumerate(data):
            if tick is not None:
                tick.start()
            pipe(d, i, 0, 0, out=out, tick=tick)
        return (time.perf_counter() - t0) / len(data)

    run(None)  # warm caches
    tick_of = {"off": None, "on": clock}  # stage timing off / on
    per_sample = {"off": [], "on": []}
    for r in range(repeats):  # alternate which goes first
        for which in rotation(per_sample, r):
            per_sample[which].append(run(tick_of[which]))
    return statistics.median(per_sample["off"]), statistics.median(per_sample["on"])


def recorder_ns(repeats: int) -> tuple[float, float]:
    """Median ns per span: recording one TraceRecorder.tiny_batch() span, and writing the file."""
    from fusionflow.loader.trace import TraceRecorder

    span, write = [], []
    for _ in range(repeats):
        rec = TraceRecorder()
        work = _Work()
        t0 = time.perf_counter_ns()
        for k in range(N):
            rec.tiny_batch(k % 4, work, k, k + 10)
        span.append((time.perf_counter_ns() - t0) / N)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter_ns()
            rec.write(os.path.join(d, "t.json"))
            write.append((time.perf_counter_ns() - t0) / N)
    return statistics.median(span), statistics.median(write)


def worker_ns(clock, repeats: int) -> dict:
    """Median ns of what the off path adds per tiny-batch (two monotonic_ns() stamps, a DONE message
    with its times vs without), and of one StageClock tick; each timed in a loop of its own code."""
    from fusionflow.runtime import messages as m

    ticks, stamps, msg_old, msg_new = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(N):
            clock("flip")
        ticks.append((time.perf_counter_ns() - t0) / N)
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(N):
            time.monotonic_ns()
            time.monotonic_ns()
        stamps.append((time.perf_counter_ns() - t0) / N)
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(N):
            m.unpack_done(m.pack_done(1, 2, []))
        msg_old.append((time.perf_counter_ns() - t0) / N)
        t0 = time.perf_counter_ns()
        for _ in range(N):
            msg = m.pack_done(1, 2, [], 5, 6)
            m.unpack_done(msg)
            m.unpack_done_times(msg)
        msg_new.append((time.perf_counter_ns() - t0) / N)
    runs = {"tick": ticks, "stamps": stamps, "msg_old": msg_old, "msg_new": msg_new}
    return {k: statistics.median(v) for k, v in runs.items()}


def measure(policy, samples: int, repeats: int) -> dict:
    from fusionflow.ops.stages import StageClock, stage_names

    clock = StageClock(stage_names(policy))
    per_sample_off, per_sample_on = pipeline_seconds(policy, samples, repeats, clock)
    w = worker_ns(clock, repeats)
    ticks_per_sample = 5 + policy.augment.max_ops  # start + read + decode + flip + ops + write
    span, write = recorder_ns(repeats)
    tiny_batch_ms = 4 * per_sample_off * 1e3  # tiny_batch_size=4
    return {
        "pipeline_ms_per_sample_stage_times_off": 1e3 * per_sample_off,
        "pipeline_ms_per_sample_stage_times_on": 1e3 * per_sample_on,
        "stage_times_overhead_measured": per_sample_on / per_sample_off - 1,
        "stage_clock_tick_ns": w["tick"],
        "stage_times_overhead_computed": ticks_per_sample * w["tick"] / (per_sample_off * 1e9),
        "two_monotonic_ns_stamps_ns": w["stamps"],
        "done_message_pack_unpack_ns_without_times": w["msg_old"],
        "done_message_pack_unpack_ns_with_times": w["msg_new"],
        "tiny_batch_of_4_ms": tiny_batch_ms,
        "trace_off_overhead_per_tiny_batch": (w["stamps"] + w["msg_new"] - w["msg_old"]) / (tiny_batch_ms * 1e6),
        "trace_on_span_ns": span,
        "trace_write_ns_per_span": write,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.samples < 1 or args.repeats < 1:
        ap.error("--samples and --repeats must be >= 1")

    from fusionflow.policy import load_policy

    res = measure(load_policy(args.policy), args.samples, args.repeats)
    for k, v in res.items():
        print(f"{k}: {v:.6g}")
    write_json(
        {
            "benchmark": "tracing",
            "policy": args.policy,
            "samples": args.samples,
            "repeats": args.repeats,
            **provenance(),
            "results": res,
        },
        result_path(args.out, f"tracing_{args.policy}.json"),
    )


if __name__ == "__main__":
    main()
