"""Issue 6's evidence, one run on a GPU machine: how large a ResNet-18 batch trains with each input
pipeline before the GPU runs out of memory, the throughput at a fixed batch, and peak memory by
phase.

Pipelines (RandAugment N=2 M=9, 224 px, AMP bf16, channels_last; JPEGs of mixed sizes made here):
  dali             DALI alone: its auto_aug RandAugment pipeline on the GPU, batch = training batch
  ff_bridge_off    FusionFlowLoader, CPU workers + DALI accelerator (--gpu-sharing, spatial by default), DALI's
                   own pool
  ff_bridge_on     the same with the allocator bridge: DALI's memory one arena carved from PyTorch's allocator
  ff_async_pool    route (b): both libraries on CUDA's stream-ordered pool (PyTorch's cudaMallocAsync
                   backend, DALI_USE_CUDA_MALLOC_ASYNC=1), bridge off

Every trial runs in its own process (a fresh CUDA context; an out-of-memory error ends only that
trial). `--gpu-gb G` first fills the GPU down to G GiB with an untouched ballast so the search ends
at batch sizes a paper-era GPU would see (and in minutes); 0 uses the whole GPU. The largest batch is
found by doubling from --start, then bisecting to --step. Then each pipeline trains at --batch-size
for --iters timed iterations (median img/s, synchronised, after warm-up).

From the repository root (on the device machine: experiments/gpu_run.sh memory ARGS):

    export PYTHONPATH=/tmp/site; python3 -m experiments.gpu_memory --out $OUT/gpu_memory.json
    .venv/bin/python -m experiments.gpu_memory --cpu-smoke     # every code path, tiny, on the CPU (no search)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import tempfile
import time
import traceback
import warnings

from experiments.harness import RESULTS, ROOT, mixed_jpegs, module_command, provenance, result_path, write_json

PIPELINES = ("dali", "ff_bridge_off", "ff_bridge_on", "ff_async_pool")
GIB = 1 << 30


def trial_env(pipeline: str) -> dict:
    env = dict(os.environ)
    if pipeline == "ff_async_pool":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        env["DALI_USE_CUDA_MALLOC_ASYNC"] = "1"
    return env


def ff_outcome(stats: dict) -> dict:
    """A FusionFlow trial counts only if DALI really ran on the GPU: a trial whose accelerator ran out
    of memory, retired or never ran had the CPU workers do DALI's share, and is no measurement of
    the pipeline at that batch (an OOM in DALI is an OOM of the trial)."""
    oom, ran = stats["accelerator_out_of_memory"], stats["accelerator_tiny_batches"]
    retired = stats["accelerator_retired"]
    if ran and not oom and not retired:
        return {"ok": True}
    return {
        "ok": False,
        "oom": bool(oom),
        "fell_back": True,
        "error": f"DALI fell back to the CPU workers (tiny-batches on DALI {ran}, out of memory {oom}x, "
        f"retired={retired!r})",
    }


def run_trial(
    pipeline: str,
    batch: int,
    iters: int,
    warmup: int,
    data_path: str,
    workers: int,
    gpu_gb: float,
    smoke: bool,
    sharing: str = "spatial",
) -> dict:
    """One training run in this process; returns what happened (ok / oom / error) and the numbers."""
    import torch

    from experiments.gpu_bench import DALI_PREFETCH, dali_batches, drain_warmup, endless, ff_loader, train_rate

    with open(data_path, "rb") as f:
        data = pickle.load(f)
    device = torch.device("cpu" if smoke else "cuda:0")
    ballast = None
    if device.type == "cuda" and gpu_gb > 0:
        free, total = torch.cuda.mem_get_info()
        spare = int(free - gpu_gb * GIB)
        if spare > 0:
            ballast = torch.empty(spare, dtype=torch.uint8, device=device)  # never touched
        torch.cuda.reset_peak_memory_stats()
    out = {"pipeline": pipeline, "batch": batch}
    stats = {}
    try:
        if pipeline == "dali":
            warmup = drain_warmup(warmup, DALI_PREFETCH)
            rate = train_rate(
                lambda: dali_batches(data, batch, device, workers, iters + warmup + 1),
                "resnet18",
                device,
                iters,
                warmup,
                batch,
            )
        else:
            bridge = "on" if pipeline == "ff_bridge_on" else "off"
            accel = "dali-cpu" if smoke else "dali-gpu"
            warmup = drain_warmup(warmup, 2)  # FusionFlowLoader's prefetch_factor
            accel = dict(
                accelerator=accel,
                gpu_sharing="off" if smoke else sharing,
                memory_bridge="off" if smoke else bridge,
            )
            with ff_loader(data, warmup + iters + 1, batch, workers, device, **accel) as ff:
                rate = train_rate(lambda: endless(ff, ff.set_epoch), "resnet18", device, iters, warmup, batch)
                stats = ff.stats.summary()
        out.update(img_per_s=rate, **ff_outcome(stats) if pipeline != "dali" and not smoke else {"ok": True})
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))
        oom = (
            isinstance(exc, torch.OutOfMemoryError)
            or "out of memory" in text.lower()
            or "cudaErrorMemoryAllocation" in text
            or "Can't allocate" in text  # DALI's device allocation failure (seen on an H100)
        )
        out.update(ok=False, oom=oom, error=text[-1500:])
    if device.type == "cuda":  # the ballast is left out of every number
        held = ballast.numel() if ballast is not None else 0
        free, total = torch.cuda.mem_get_info()
        out["ballast_gib"] = held / GIB
        out["torch_peak_reserved_gib"] = (torch.cuda.max_memory_reserved() - held) / GIB
        out["torch_peak_allocated_gib"] = (torch.cuda.max_memory_allocated() - held) / GIB
        used = total - free - held
        out["device_used_at_end_gib"] = used / GIB  # training + DALI pools + CUDA contexts
        out["outside_torch_at_end_gib"] = (used - (torch.cuda.memory_reserved() - held)) / GIB  # DALI + contexts
    out["loader_stats"] = {k: v for k, v in stats.items() if k.startswith(("bridge", "memory_bridge", "accelerator"))}
    return out


def spawn(args, pipeline: str, batch: int, iters: int, warmup: int) -> dict:
    cmd = [
        *module_command("gpu_memory"),
        "--trial",
        pipeline,
        "--batch",
        str(batch),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        "--data",
        args.data,
        "--workers",
        str(args.workers),
        "--gpu-gb",
        str(args.gpu_gb),
        "--gpu-sharing",
        getattr(args, "gpu_sharing", "spatial"),
    ] + (["--cpu-smoke"] if args.cpu_smoke else [])
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=trial_env(pipeline), timeout=args.trial_timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired as exc:  # one hung trial must not lose the others' numbers
        tail = (exc.stderr or b"")[-1500:]
        res = {
            "pipeline": pipeline,
            "batch": batch,
            "ok": False,
            "oom": False,
            "timeout": True,
            "error": f"no result within --trial-timeout={args.trial_timeout} s: "
            f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}",
            "seconds": round(time.time() - t0, 1),
        }
        print(f"  {pipeline} batch {batch}: TIMEOUT ({res['seconds']} s)", flush=True)
        return res
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    res = (
        json.loads(lines[-1])
        if lines
        else {
            "pipeline": pipeline,
            "batch": batch,
            "ok": False,
            "oom": "out of memory" in proc.stderr.lower(),
            "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}",
        }
    )
    res["seconds"] = round(time.time() - t0, 1)
    print(
        f"  {pipeline} batch {batch}: {'ok' if res['ok'] else ('OOM' if res.get('oom') else 'ERROR')} "
        f"({res['seconds']} s)",
        flush=True,
    )
    return res


def largest_batch(args, pipeline: str) -> dict:
    trials, good, bad = [], 0, None
    b = args.start
    while bad is None and b <= args.max_batch:  # doubling
        r = spawn(args, pipeline, b, args.search_iters, 2)
        trials.append(r)
        if r["ok"]:
            good, b = b, b * 2
        elif r.get("oom"):
            bad = b
        else:
            return {"largest": None, "trials": trials, "error": r.get("error")}
    while bad is not None and bad - good > args.step:  # bisect
        mid = (good + bad) // 2 // args.step * args.step
        if mid <= good:
            break
        r = spawn(args, pipeline, mid, args.search_iters, 2)
        trials.append(r)
        if r["ok"]:
            good = mid
        elif r.get("oom"):
            bad = mid
        else:
            return {"largest": good or None, "trials": trials, "error": r.get("error")}
    return {"largest": good or None, "first_oom": bad, "trials": trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gpu-gb", type=float, default=16.0)
    ap.add_argument("--start", type=int, default=128)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4096)
    ap.add_argument("--search-iters", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256, help="fixed batch of the throughput comparison")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trial-timeout", type=int, default=300)
    ap.add_argument("--gpu-sharing", default="spatial", choices=("spatial", "temporal"), help="the FusionFlow trials'")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trial", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    if args.trial:
        res = run_trial(
            args.trial,
            args.batch,
            args.iters,
            args.warmup,
            args.data,
            args.workers,
            args.gpu_gb,
            args.cpu_smoke,
            args.gpu_sharing,
        )
        print(json.dumps(res), flush=True)
        return

    import torch

    if args.cpu_smoke:
        args.images, args.workers, args.batch_size, args.iters, args.warmup = 32, 1, 8, 2, 1
    elif not torch.cuda.is_available():
        raise SystemExit("experiments.gpu_memory needs a CUDA GPU (use --cpu-smoke to check the script here)")
    data = mixed_jpegs(args.images)
    fd, args.data = tempfile.mkstemp(prefix="ff_gpu_memory_", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(data, f)
    pipelines = args.pipelines.split(",")
    if args.cpu_smoke:
        pipelines = [p for p in pipelines if p != "ff_async_pool"]  # the same code path as ff_bridge_off on a CPU
    result = {
        "benchmark": "gpu_memory",
        **provenance(),
        "model": "resnet18",
        "amp": "bf16",
        "image": 224,
        "policy": "randaugment",
        "workers": args.workers,
        "gpu_gb": args.gpu_gb,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)",
        "torch": torch.__version__,
        "largest_batch": {},
        "fixed_batch": {"batch": args.batch_size},
    }
    name = "gpu_memory.json" if torch.cuda.is_available() else "gpu_memory_cpu_smoke.json"
    path = result_path(args.out, name, os.environ.get("OUT", RESULTS))
    try:  # the JSON rewritten after each trial: a call stopped at its time limit keeps what it measured
        for p in pipelines:
            print(f"{p}: throughput at batch {args.batch_size}", flush=True)
            result["fixed_batch"][p] = spawn(args, p, args.batch_size, args.iters, args.warmup)
            print(f"  {p}: {result['fixed_batch'][p].get('img_per_s')} img/s", flush=True)
            write_json(summarised(result, pipelines), path)
        if not args.cpu_smoke:
            for p in pipelines:
                print(f"{p}: largest batch", flush=True)
                result["largest_batch"][p] = largest_batch(args, p)
                write_json(summarised(result, pipelines), path)
    finally:
        os.unlink(args.data)
    print(json.dumps(result["summary"], indent=1))


def summarised(result: dict, pipelines: list) -> dict:
    """`result` with its summary: each pipeline's largest batch and rate, against DALI's batch and the bridge-off
    rate where both are measured."""
    lb, fb = result["largest_batch"], result["fixed_batch"]
    summary = {}
    for p in pipelines:
        summary[p] = {"largest_batch": (lb.get(p) or {}).get("largest"), "img_per_s": fb.get(p, {}).get("img_per_s")}
    for p in pipelines:
        if p != "dali" and summary.get("dali", {}).get("largest_batch") and summary[p]["largest_batch"]:
            summary[p]["batch_vs_dali"] = summary[p]["largest_batch"] / summary["dali"]["largest_batch"]
        if summary.get("ff_bridge_off", {}).get("img_per_s") and summary[p]["img_per_s"]:
            summary[p]["speed_vs_ff_bridge_off"] = summary[p]["img_per_s"] / summary["ff_bridge_off"]["img_per_s"]
    result["summary"] = summary
    return result


if __name__ == "__main__":
    main()
