"""DDP with and without the global manager's worker lending, side by side in one run.

R ranks under torchrun (gloo, CPU), W CPU workers per rank, RandAugment, a small CNN trained with
DDP (1 thread per rank) -- or, with --step-ms, a stand-in for a GPU training step: the rank sleeps
that long (its CPU is free, as when the GPU computes) and then all-reduces a small tensor (the
gradient synchronisation), so the CPU cores belong to the data workers as on a GPU node. Rank 0 is the straggler: its
images are larger (--heavy-side) than the
others' (--light-side), and optionally its policy heavier (--heavy-policy), so its data
preparation is slower. For each repeat both modes run, in
alternating order, on identical data:
  off   global_manager=None: every rank uses its own workers only
  on    global_manager="auto": idle workers of ranks that are ready are lent to ranks still working
Reported per mode (medians over repeats): the straggler gap per iteration -- max minus min over
ranks of the moment next() returned that iteration's batch --, throughput (images of all ranks per
second between two barriers, after a warm-up epoch), mean wait at next() per rank, and the lending
counters; then the ratios on/off: of the medians, and the median of each repeat's own on/off ratio
(the two runs of a repeat are back to back, so they share the machine's mood).

    .venv/bin/python -m experiments.bench_ddp [--ranks 2] [--workers 1] [--images 64] [--repeats 3]

Each rank runs this module with --rank-main (torchrun -m, from the repository root; torchrun sets RANK,
WORLD_SIZE, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from experiments.harness import ROOT, cached_pickle, data_path, provenance, result_path, rotation, write_json


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from fusionflow import FusionFlowLoader
    from fusionflow.tools.demo import small_cnn, train_step
    from fusionflow.tools.synthetic import EncodedImages

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    with open(args.data, "rb") as f:
        sets = pickle.load(f)
    ds = EncodedImages(sets["heavy" if rank == 0 else "light"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(small_cnn(10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    grads = torch.zeros(1 << 16)

    def step(x, y):
        if not args.step_ms:
            train_step(model, opt, loss_fn, x, y)
            return
        time.sleep(args.step_ms / 1e3)  # the GPU computes; this process's core is idle
        dist.all_reduce(grads)

    policy = args.heavy_policy if rank == 0 and args.heavy_policy else args.policy
    loader = FusionFlowLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        policy=policy,
        tiny_batch_size=args.tiny_batch_size,
        persistent_workers=True,
        global_manager="auto" if args.mode == "on" else None,
        seed=0,
    )
    ready, waits = [], []
    with loader:
        for epoch in range(args.epochs + 1):  # epoch 0 warms up (worker start, GM start, first lending)
            loader.set_epoch(epoch)
            dist.barrier()
            t0 = time.perf_counter()
            it = iter(loader)
            times = []
            while True:
                w0 = time.perf_counter()
                batch = next(it, None)
                if batch is None:
                    break
                times.append(time.monotonic())  # CLOCK_MONOTONIC: comparable across ranks on one node
                if epoch:
                    waits.append(time.perf_counter() - w0)
                step(*batch)
            dist.barrier()
            if epoch:
                ready.append(times)
                if epoch == 1:
                    start = t0
        end = time.perf_counter()
    out = {
        "rank": rank,
        "ready": ready,
        "seconds": end - start,
        "images": len(sampler) * args.epochs,
        "wait_mean_ms": 1e3 * statistics.fmean(waits),
        "stats": loader.stats.summary(),
    }
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(args, mode: str, data_file: str) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.ranks),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "experiments.bench_ddp",
            "--rank-main",
            "--mode",
            mode,
            "--data",
            data_file,
            "--out-dir",
            out_dir,
        ]
        for key in ("workers", "batch_size", "tiny_batch_size", "epochs", "policy", "heavy_policy", "step_ms"):
            if getattr(args, key) is not None:
                cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"torchrun failed ({mode}):\n{proc.stderr[-4000:]}")
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(args.ranks)]
    gaps = [
        max(r["ready"][e][i] for r in ranks) - min(r["ready"][e][i] for r in ranks)
        for e in range(args.epochs)
        for i in range(len(ranks[0]["ready"][e]))
    ]
    seconds = max(r["seconds"] for r in ranks)
    images = sum(r["images"] for r in ranks)
    return {
        "mode": mode,
        "img_per_s": images / seconds,
        "seconds": seconds,
        "gap_mean_ms": 1e3 * statistics.fmean(gaps),
        "gap_median_ms": 1e3 * statistics.median(gaps),
        "wait_mean_ms": [r["wait_mean_ms"] for r in ranks],
        "workers_lent": [r["stats"]["workers_lent"] for r in ranks],
        "borrowed_tiny_batches": [r["stats"]["borrowed_tiny_batches"] for r in ranks],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="CPU workers per rank")
    ap.add_argument("--images", type=int, default=64, help="images per rank and epoch")
    ap.add_argument("--heavy-side", type=int, nargs=2, default=[500, 900], help="rank 0's image sides (px)")
    ap.add_argument("--light-side", type=int, nargs=2, default=[200, 400], help="other ranks' image sides")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--tiny-batch-size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per run (after one warm-up epoch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--heavy-policy", default=None, help="rank 0's policy (default: --policy)")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0,
        help="simulated GPU step (sleep + all-reduce) instead of training the CNN on the CPU (0)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.ranks * args.workers > (os.cpu_count() or 1):
        print(f"note: {args.ranks} ranks x {args.workers} workers exceed {os.cpu_count()} cores; workers share cores")

    from fusionflow.tools.synthetic import make_jpegs

    n = args.images * args.ranks  # each rank's sampler takes 1/ranks of its own dataset
    name = f"ddp_{n}_{args.heavy_side}_{args.light_side}.pkl".replace(" ", "").replace("[", "").replace("]", "")
    data = cached_pickle(
        data_path(name.replace(",", "-")),
        lambda: {"heavy": make_jpegs(n, *args.heavy_side, seed=1), "light": make_jpegs(n, *args.light_side, seed=2)},
    )
    runs = {"off": [], "on": []}
    for rep in range(args.repeats):
        for mode in rotation(("off", "on"), rep):
            r = run_mode(args, mode, data)
            runs[mode].append(r)
            print(
                f"repeat {rep + 1}/{args.repeats} {mode:>3}: {r['img_per_s']:.1f} img/s, straggler gap "
                f"mean {r['gap_mean_ms']:.0f} ms (median {r['gap_median_ms']:.0f}), waits {r['wait_mean_ms']} ms, "
                f"lent {r['workers_lent']}, borrowed tiny-batches {r['borrowed_tiny_batches']}",
                flush=True,
            )
    med = {
        mode: {key: statistics.median(r[key] for r in rs) for key in ("img_per_s", "gap_mean_ms", "gap_median_ms")}
        for mode, rs in runs.items()
    }
    pairs = list(zip(runs["on"], runs["off"]))
    ratio = {
        "throughput_on_over_off": med["on"]["img_per_s"] / med["off"]["img_per_s"],
        "gap_on_over_off": med["on"]["gap_mean_ms"] / med["off"]["gap_mean_ms"],
        "throughput_paired_median": statistics.median(a["img_per_s"] / b["img_per_s"] for a, b in pairs),
        "throughput_paired": [a["img_per_s"] / b["img_per_s"] for a, b in pairs],
        "gap_paired_median": statistics.median(a["gap_mean_ms"] / b["gap_mean_ms"] for a, b in pairs),
    }
    print(
        f"median throughput: off {med['off']['img_per_s']:.1f} img/s, on {med['on']['img_per_s']:.1f} img/s "
        f"({ratio['throughput_on_over_off']:.3f}x); straggler gap: off {med['off']['gap_mean_ms']:.0f} ms, "
        f"on {med['on']['gap_mean_ms']:.0f} ms ({ratio['gap_on_over_off']:.2f}x); per-repeat on/off: throughput "
        f"median {ratio['throughput_paired_median']:.3f}x, gap median {ratio['gap_paired_median']:.2f}x"
    )
    result = {
        **provenance(),
        "args": {k: v for k, v in vars(args).items() if k not in ("rank_main", "mode", "data", "out_dir")},
        "median": med,
        "ratio": ratio,
        "runs": runs,
    }
    tag = (f"_{args.heavy_policy}" if args.heavy_policy else "") + (f"_step{args.step_ms:g}ms" if args.step_ms else "")
    write_json(result, result_path(args.out, f"ddp_r{args.ranks}_w{args.workers}{tag}.json"))


if __name__ == "__main__":
    main()
