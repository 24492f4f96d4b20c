"""Who should read a DALI run's samples on DALI's CPU backend: the input helpers (the default since session 32) or
the accelerator thread in the training process (before)? Issue 41's X (bench_cooperation: CPU workers +
accelerator="dali-cpu"), both ways in one process, rounds interleaved with the order alternating, medians.

The thread-reads candidate is the same loader whose helpers were started without the dataset (`start_helper`'s
`reads` dropped): they make the draws only and the accelerator thread reads its runs, as before session 32.
Across processes (paired_trees) this benchmark's X spreads 10-20% on the 2-core VM; here both loaders live in
one process and share every round's conditions.

    .venv/bin/python -m experiments.ab_helper_reads [--rounds 6] [--batch-size 256] [--images 2048]
"""

from __future__ import annotations

import argparse
import statistics

import fusionflow.accel.input_helpers as input_helpers
from experiments import bench_cooperation
from experiments.gpu_bench import endless, ff_loader
from experiments.harness import mixed_jpegs, provenance, result_path, settle, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start_helper, reads = input_helpers.start_helper, {"on": True}

    def start_as_asked(policy, ctx=None, processes=1, read=None):
        return start_helper(policy, ctx, processes, read if reads["on"] else None)

    input_helpers.start_helper = start_as_asked  # looked up at each accelerator start (accel/session.py)
    data, batches = mixed_jpegs(args.images), max(4, args.images // args.batch_size)
    loaders, streams = {}, {}
    try:
        for name, on in (("helpers_read", True), ("thread_reads", False)):
            reads["on"] = on
            loaders[name] = ff_loader(
                data, 1000 * batches, args.batch_size, args.workers, "cpu", accelerator=bench_cooperation.dali_cpu(1)
            )
            streams[name] = endless(loaders[name])
            next(streams[name])  # the accelerator and its helper start now, in this mode
        rates = {name: [] for name in loaders}
        for r in range(args.rounds):
            for name in list(loaders) if r % 2 == 0 else list(loaders)[::-1]:
                settle()
                images, seconds = bench_cooperation.take(streams[name], batches, 0.0, loaders[name].prefetch_factor)
                rates[name].append(images / seconds)
                print(f"round {r + 1}/{args.rounds}: {name} {rates[name][-1]:.0f} img/s", flush=True)
        stats = {name: dict(vars(ld.stats)) for name, ld in loaders.items()}
    finally:
        input_helpers.start_helper = start_helper
        for ld in loaders.values():
            ld.close()
    med = {name: statistics.median(v) for name, v in rates.items()}
    paired = statistics.median(a / b for a, b in zip(rates["helpers_read"], rates["thread_reads"]))
    feed = {
        name: 1e6 * s["accelerator_feed_cpu_seconds"] / max(1, s["accelerator_samples"]) for name, s in stats.items()
    }
    result = {
        **provenance(),
        "args": vars(args),
        "rates": rates,
        "median": med,
        "ratio": med["helpers_read"] / med["thread_reads"],
        "ratio_paired": paired,
        "feed_us_per_sample": feed,
    }
    print(
        f"X: helpers read {med['helpers_read']:.0f}, thread reads {med['thread_reads']:.0f} img/s: "
        f"{result['ratio']:.3f} (per round {paired:.3f}); feeding thread {feed['helpers_read']:.0f} vs "
        f"{feed['thread_reads']:.0f} us a sample",
        flush=True,
    )
    write_json(result, result_path(args.out, f"ab_helper_reads_{args.batch_size}.json"))


if __name__ == "__main__":
    main()
