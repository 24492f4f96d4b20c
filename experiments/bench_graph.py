"""FusionFlow's DALI graph against DALI's own: what a run costs the accelerator, whatever its size.

The accelerator runs a policy as one prebuilt DALI pipeline whose op slots pick each sample's op by
per-sample conditionals (fusionflow/accel/dali_graph.py). DALI's `Run` walks every node of that graph
in the calling thread on every run, and every node is a task whose completion wakes the thread
waiting for the outputs; on a GPU each is a kernel launch too. So a run's fixed cost follows the
graph's node count: issue 41's feeder bar at runs of 32 is mostly this.

DALI's CPU backend (or the GPU with `--device cuda`: decoding on the mixed decoder, ops on the GPU),
`--threads` DALI threads, one process; per batch size, the two candidates interleaved over `--rounds`,
medians:
  dali  DALI alone: its own auto_aug RandAugment (n=2, m=9) pipeline (experiments/gpu_bench.py
        dali_batches: external source of the encoded bytes, random-crop decode, resize, flip),
        prefetch 2, `run()` per batch, its random draws made in the graph
  ours  FusionFlow's RandAugment graph (`DaliPolicyPipeline`, depth 2: a run submitted while the
        previous one is collected, as the accelerator runs it), its host inputs (the draws) made before
        the clock starts (in the loader a helper process makes them)
  ours_classic  with `--classic` (DALI's CPU backend only): ours on DALI's classic executor
        (exec_dynamic=False) instead of its dynamic one (exec2). exec2's outputs() sleeps on one condition
        variable its scheduler notifies at every finished task, so the caller wakes once per graph node;
        the classic executor wakes it once per run. Not an option on a GPU: there its outputs() takes no
        CUDA stream (it waits on the host, in a cudaEventSynchronize) and it reuses an output buffer once
        the next outputs() is called, with nothing ordering that after a copy queued on another stream
Both land each batch and its labels in torch tensors on the device the same way.
Each: img/s, the calling thread's CPU per sample (thread time: what the training process pays) and
the graph's nodes (ours: `DaliPolicyPipeline.graph_nodes`). With `--tiny` (32 px in, 16 px out)
little is computed per pixel and what is left is each graph's fixed cost per run.

    .venv/bin/python -m experiments.bench_graph [--batch-sizes 4,32,256] [--rounds 5] [--tiny] [--device cuda]
        [--classic]
"""

from __future__ import annotations

import argparse
import math
import statistics

from experiments.dali_dynamic import time_graph, timed_runs
from experiments.gpu_bench import host_columns, ours_batches
from experiments.harness import provenance, result_path, rotation, write_json


def time_ours(pipe, data: list, host: list, batch_size: int, batches: int, device: str) -> dict:
    """`batches` runs of `pipe` over `data`, two in flight, each landed as DALI alone's batches are
    (gpu_bench.ours_batches: the loop gpu_bench's `ours` variant trains on)."""

    def go():
        for _ in ours_batches(pipe, data, host, batch_size, batches, device):
            pass
        if device == "cuda":
            import torch

            torch.cuda.synchronize()

    return {**timed_runs(go, batch_size * batches), "graph_nodes": pipe.graph_nodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="4,32,256")
    ap.add_argument("--images", type=int, default=1024, help="samples timed per candidate, round and batch size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="32 px images, 16 px out: the graphs' fixed costs")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="DALI threads, both candidates")
    ap.add_argument("--classic", action="store_true", help="also ours on DALI's classic executor (CPU only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.classic and args.device == "cuda":
        ap.error("--classic runs on DALI's CPU backend only: the classic executor cannot order outputs on a stream")
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.policy import load_policy
    from fusionflow.tools.synthetic import make_jpegs, sample_set

    data = make_jpegs(64, 32, 33, seed=1) if args.tiny else sample_set("imagenet", 64)
    size = 16 if args.tiny else 224
    policy = load_policy("randaugment", size=size)
    result = {"args": vars(args), **provenance(), "batch_sizes": {}}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batches = max(8, math.ceil(args.images / bs))
        gpu = args.device == "cuda"
        where = dict(device="gpu" if gpu else "cpu", device_id=0 if gpu else None, num_threads=args.threads)
        pipes = {"ours": DaliPolicyPipeline(policy, bs, **where)}
        if args.classic:
            pipes["ours_classic"] = DaliPolicyPipeline(policy, bs, exec_dynamic=False, **where)
        host = host_columns(pipes["ours"], data, bs)
        for pipe in pipes.values():
            time_ours(pipe, data, host, bs, 3, args.device)  # warm: DALI's buffers sized
        runs: dict = {"dali": [], **{name: [] for name in pipes}}
        for r in range(args.rounds):
            for name in rotation(runs, r):
                if name == "dali":
                    got = time_graph(data, bs, batches, size, args.device, args.threads)
                else:
                    got = time_ours(pipes[name], data, host, bs, batches, args.device)
                runs[name].append(got)
                print(f"batch {bs}, round {r + 1}, {name}: {got}", flush=True)
        for pipe in pipes.values():
            pipe.close()
        med = {name: {k: statistics.median(g[k] for g in got) for k in got[0]} for name, got in runs.items()}
        med["ours_over_dali_img_per_s"] = med["ours"]["img_per_s"] / med["dali"]["img_per_s"]
        med["ours_over_dali_thread_cpu"] = (
            med["ours"]["thread_cpu_us_per_sample"] / med["dali"]["thread_cpu_us_per_sample"]
        )
        if args.classic:
            med["classic_over_ours_thread_cpu"] = (
                med["ours_classic"]["thread_cpu_us_per_sample"] / med["ours"]["thread_cpu_us_per_sample"]
            )
        result["batch_sizes"][bs] = {"runs": runs, "medians": med}
        print(f"batch {bs}: {med}", flush=True)
    name = "bench_graph" + ("_gpu" if args.device == "cuda" else "") + ("_tiny" if args.tiny else "")
    write_json(result, result_path(args.out, name + ".json"))


if __name__ == "__main__":
    main()
