"""How much memory DALI takes per sample of a run, for the allocator bridge's arena (issue 41's memory line).

The bridge lends DALI one arena sized by `arena_bytes` (fusionflow/accel/bridge/memory_bridge.py): the runs
in flight x the samples a run holds x (WORKING_IMAGES uint8 images of the output's size + the output), an
estimate. This measures what FusionFlow's RandAugment graph (`DaliPolicyPipeline`, the accelerator's) really
takes: for each run size, in a fresh process, the pipeline is built, then `--runs` runs of that many JPEGs
(200-1000 px, experiments/harness.py `mixed_jpegs`) are made, `--depth` in flight as the accelerator keeps
them; what grew from the built pipeline to the end is recorded:
  cpu   DALI's CPU backend: the process's peak resident memory (VmHWM): DALI's host buffers, and what the
        C allocator keeps of them
  cuda  the GPU (decoding on the mixed decoder): device memory in use (cudaMemGetInfo), which DALI's own pool
        keeps once grown (run it with memory_bridge off: nothing else in the process allocates)
The per-sample figure is the least-squares slope of the growth over the run sizes (the fixed part, the
graph's own buffers, is the intercept), per run in flight (over `--depth`), against the arena's estimate per
sample of a run.

    .venv/bin/python -m experiments.dali_memory [--run-sizes 32,64,128,256] [--device cpu|cuda] [--depth 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from experiments.harness import ROOT, mixed_jpegs, module_command, provenance, result_path, write_json

OUTPUT_SHAPE = (3, 224, 224)  # RandAugment's output (the policy's size), float32 after its normalisation


def in_use(device: str) -> int:
    """Bytes in use: the process's peak resident memory (cpu: VmHWM, this process's own -- getrusage's ru_maxrss
    starts from the parent's peak when a large process started it), or the device's memory in use (cuda)."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return total - free
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def one_size(run: int, runs: int, depth: int, device: str) -> dict:
    """In this process: build the pipeline for runs of `run` samples, then make `runs` runs, `depth` in flight."""
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    data = mixed_jpegs(run)
    if device == "cuda":
        import torch

        torch.cuda.init()
    before_build = in_use(device)
    pipe = DaliPolicyPipeline(
        "randaugment",
        batch_size=run,
        device="gpu" if device == "cuda" else "cpu",
        device_id=0 if device == "cuda" else None,
        num_threads=1,
        depth=depth,
    )
    built = in_use(device)
    indices = list(range(run))
    for r in range(runs):
        pipe.submit(data, indices, seed=0, epoch=r)
        if pipe.in_flight >= depth:
            pipe.collect()
    while pipe.in_flight:
        pipe.collect()
    grown = in_use(device) - built
    pipe.close()
    return {"run": run, "build_bytes": built - before_build, "run_growth_bytes": grown}


def slope(xs: list, ys: list) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return b, my - b * mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-sizes", default="32,64,128,256")
    ap.add_argument("--runs", type=int, default=6, help="runs made at each size")
    ap.add_argument("--depth", type=int, default=2, help="runs in flight")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one, args.runs, args.depth, args.device)), flush=True)
        return
    from fusionflow.accel.bridge.memory_bridge import arena_bytes

    rows = []
    for run in [int(x) for x in args.run_sizes.split(",")]:
        cmd = module_command("dali_memory") + ["--one", str(run), "--runs", str(args.runs), "--depth", str(args.depth)]
        proc = subprocess.run(cmd + ["--device", args.device], capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            sys.exit(f"run size {run} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(lines[-1]))
        built, grew = rows[-1]["build_bytes"] / 1e6, rows[-1]["run_growth_bytes"] / 1e6
        print(f"run {run}: build {built:.0f} MB, runs grew {grew:.0f} MB")
    per_sample, fixed = slope([r["run"] for r in rows], [r["run_growth_bytes"] for r in rows])
    estimate = arena_bytes(1, 1, OUTPUT_SHAPE, 4)  # per sample of one run in flight
    summary = {
        "per_sample_bytes": per_sample,
        "per_sample_per_run_in_flight_bytes": per_sample / args.depth,
        "fixed_bytes": fixed,
        "arena_estimate_per_sample_bytes": estimate,
        "measured_over_estimate": per_sample / args.depth / estimate,
    }
    print(
        f"{args.device}: {per_sample / 1e6:.2f} MB per sample of run size "
        f"({per_sample / args.depth / 1e6:.2f} per run in flight), fixed {fixed / 1e6:.0f} MB; "
        f"the arena's estimate {estimate / 1e6:.2f} MB a sample of a run "
        f"(measured / estimate {summary['measured_over_estimate']:.2f})"
    )
    result = {**provenance(), "args": vars(args), "rows": rows, "summary": summary}
    write_json(result, result_path(args.out, f"dali_memory_{args.device}.json"))


if __name__ == "__main__":
    main()
