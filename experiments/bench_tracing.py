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
is `experiments/bench_loader.py --modes loader --observability`.

    .venv/bin/python experiments/bench_tracing.py [--samples 64] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import RESULTS, provenance, write_json  # noqa: E402


class _Work:
    seq, generation = 3, 1
    indices = (1, 2, 3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.samples < 1 or args.repeats < 1:
        ap.error("--samples and --repeats must be >= 1")

    import numpy as np

    from fusionflow.loader.trace import TraceRecorder
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.ops.stages import StageClock, stage_names
    from fusionflow.policy import load_policy
    from fusionflow.runtime import messages as m
    from fusionflow.tools.synthetic import make_jpegs

    policy = load_policy(args.policy)
    pipe = CpuPipeline(policy)
    data = make_jpegs(args.samples, 200, 1000, seed=1)
    out = np.empty(policy.out_shape, policy.out_dtype)
    clock = StageClock(stage_names(policy))

    def run(tick):
        t0 = time.perf_counter()
        for i, d in enumerate(data):
            if tick is not None:
                tick.start()
            pipe(d, i, 0, 0, out=out, tick=tick)
        return (time.perf_counter() - t0) / len(data)

    run(None)  # warm caches
    off, on = [], []
    for r in range(args.repeats):  # alternate which goes first
        if r % 2:
            on.append(run(clock))
            off.append(run(None))
        else:
            off.append(run(None))
            on.append(run(clock))
    per_sample_off, per_sample_on = statistics.median(off), statistics.median(on)

    n = 20000
    ticks = []  # one StageClock tick, and how many a sample takes (start + read + decode + flip + ops + write)
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            clock("flip")
        ticks.append((time.perf_counter_ns() - t0) / n)
    ticks_per_sample = 5 + policy.augment.max_ops
    stamps = []
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            time.monotonic_ns()
            time.monotonic_ns()
        stamps.append((time.perf_counter_ns() - t0) / n)
    msg_old, msg_new = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            m.unpack_done(m.pack_done(1, 2, []))
        msg_old.append((time.perf_counter_ns() - t0) / n)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            msg = m.pack_done(1, 2, [], 5, 6)
            m.unpack_done(msg)
            m.unpack_done_times(msg)
        msg_new.append((time.perf_counter_ns() - t0) / n)

    span, write = [], []
    for _ in range(args.repeats):
        rec = TraceRecorder()
        work = _Work()
        t0 = time.perf_counter_ns()
        for k in range(n):
            rec.tiny_batch(k % 4, work, k, k + 10)
        span.append((time.perf_counter_ns() - t0) / n)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter_ns()
            rec.write(os.path.join(d, "t.json"))
            write.append((time.perf_counter_ns() - t0) / n)

    tiny_batch_ms = 4 * per_sample_off * 1e3  # tiny_batch_size=4
    res = {
        "pipeline_ms_per_sample_stage_times_off": 1e3 * per_sample_off,
        "pipeline_ms_per_sample_stage_times_on": 1e3 * per_sample_on,
        "stage_times_overhead_measured": per_sample_on / per_sample_off - 1,
        "stage_clock_tick_ns": statistics.median(ticks),
        "stage_times_overhead_computed": ticks_per_sample * statistics.median(ticks) / (per_sample_off * 1e9),
        "two_monotonic_ns_stamps_ns": statistics.median(stamps),
        "done_message_pack_unpack_ns_without_times": statistics.median(msg_old),
        "done_message_pack_unpack_ns_with_times": statistics.median(msg_new),
        "tiny_batch_of_4_ms": tiny_batch_ms,
        "trace_off_overhead_per_tiny_batch": (
            statistics.median(stamps) + statistics.median(msg_new) - statistics.median(msg_old)
        )
        / (tiny_batch_ms * 1e6),
        "trace_on_span_ns": statistics.median(span),
        "trace_write_ns_per_span": statistics.median(write),
    }
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
        args.out or os.path.join(RESULTS, f"tracing_{args.policy}.json"),
    )


if __name__ == "__main__":
    main()
