"""`python -m fusionflow profile --data DIR`: where the time goes on your data.

Runs FusionFlowLoader on an ImageFolder for a number of mini-batches (optionally with a simulated
training step) with tracing and stage timing on, and writes to --out:
  trace.json    Chrome/Perfetto trace events (open at https://ui.perfetto.dev)
  timeline.png  workers x time, tiny-batches coloured by mini-batch, waits at next() in black,
                and each worker's stage shares
  summary.txt   throughput, wait mean/p95, stage shares, idle share per worker (also printed)
"""

from __future__ import annotations

import math
import os
import sys
import time

from fusionflow.tools.cli import add_on_error, check_out_dir


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="ImageFolder root (class folders of images)")
    p.add_argument("--policy", default="randaugment", help="a shipped policy name or a YAML path")
    p.add_argument("--workers", type=int, default=min(4, len(os.sched_getaffinity(0))))
    p.add_argument("--batches", type=int, default=40, help="mini-batches to run (epochs repeat if needed)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tiny-batch-size", type=int, default=4)
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulated training step per mini-batch (sleep), to see prefetch at work",
    )
    p.add_argument("--out", default="fusionflow-profile", help="directory for trace.json, timeline.png, summary.txt")
    add_on_error(p)


def check_arguments(p, args) -> None:
    for name in ("workers", "batches", "batch_size", "tiny_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.step_ms < math.inf:
        p.error(f"--step-ms must be a number of milliseconds >= 0, got {args.step_ms}")
    if not os.path.isdir(args.data):
        p.error(f"--data {args.data!r} is not a directory (an ImageFolder root: one folder per class)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out!r} is a file: name a directory (trace.json, timeline.png and summary.txt go there)")
    check_out_dir(p, "--out", args.out)


def stage_seconds_by_track(stats) -> dict:
    """loader.stats' per-worker stage seconds, keyed by the trace's track names."""
    out = {}
    for worker in list(stats.stage_ns):
        name = (
            f"CPU worker {worker}"
            if isinstance(worker, int)
            else "in-process"
            if worker == "inline"
            else f"borrowed worker {worker}"
        )
        out[name] = stats.stage_seconds(worker)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("CPU"), len(kv[0]), kv[0])))


def run(args, parser=None) -> int:
    """Profile as `args` say; the dataset's or the policy's error is `parser`'s usage error (exit 2) when given."""
    from tqdm import tqdm

    from fusionflow.loader.trace import load
    from fusionflow.tools.timeline import format_summary, plot_timeline, summarize

    ds, policy = _dataset(args, parser)
    os.makedirs(args.out, exist_ok=True)
    trace_path = os.path.join(args.out, "trace.json")
    png_path = os.path.join(args.out, "timeline.png")
    batch_size = min(args.batch_size, len(ds))
    print(
        f"{len(ds)} images in {args.data}, policy {args.policy}, batch {batch_size}, "
        f"{args.workers} workers, {args.batches} mini-batches"
    )
    loader = _loader(args, ds, policy, batch_size)
    done, samples = 0, 0
    t_first = None
    try:
        with loader.trace(trace_path), tqdm(total=args.batches, desc="profile", unit="batch") as bar:
            while done < args.batches:
                for _x, y in loader:
                    if t_first is None:
                        t_first = time.perf_counter()  # worker start-up excluded from throughput
                    else:
                        samples += len(y)
                    if args.step_ms:
                        time.sleep(args.step_ms / 1e3)
                    done += 1
                    bar.update()
                    if done >= args.batches:
                        break
        seconds = time.perf_counter() - t_first
    finally:
        loader.close()
    trace = load(trace_path)
    by_track = stage_seconds_by_track(loader.stats)
    try:
        plot_timeline(trace, png_path, by_track)
    except ImportError as e:  # matplotlib is the `plot` extra's: the summary needs none
        print(f"no timeline: {e}", file=sys.stderr)
        png_path = None
    s = summarize(trace)
    text = format_summary(s, loader.stats.stage_shares(), {k: _shares(v) for k, v in by_track.items()})
    if samples:
        text = (
            f"throughput after the first mini-batch: {samples / seconds:.1f} samples/s "
            f"(start-up {loader.stats.startup_seconds:.2f} s)\n"
        ) + text
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"trace: {trace_path} (open at https://ui.perfetto.dev)" + (f"\ntimeline: {png_path}" if png_path else ""))
    return 0


def _loader(args, ds, policy, batch_size: int):
    """The loader profiled: shuffled, persistent workers, stage times on."""
    from fusionflow import FusionFlowLoader

    return FusionFlowLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        policy=policy,
        seed=0,
        tiny_batch_size=min(args.tiny_batch_size, batch_size),
        stage_times=True,
        on_error=args.on_error,
    )


def _dataset(args, parser):
    """(the ImageFolder at --data, the policy loaded): their errors are `parser`'s usage errors when given."""
    from fusionflow import ImageFolder
    from fusionflow.policy import load_policy

    try:
        ds, policy = ImageFolder(args.data), load_policy(args.policy)  # told before anything starts
    except (OSError, ValueError, TypeError) as e:
        if parser is None:
            raise
        parser.error(str(e))
    return ds, policy


def _shares(seconds: dict) -> dict:
    from fusionflow.ops.stages import shares

    return shares(seconds)
