"""Per-core throughput of the whole CPU augmentation pipeline, FusionFlow vs torchvision.

decode + RandomResizedCrop(224) + flip + RandAugment(N=2, M=9) on JPEGs of mixed sizes (sides drawn
from 200..1000 px), one process, one thread each, in one run:
  torchvision      torchvision.transforms.v2 on PIL images (Image.open(...).convert("RGB"))
  ff_exact         FusionFlow CpuPipeline, exact path (bit-identical to torchvision's output)
  ff_fast          FusionFlow CpuPipeline as shipped (JPEG DCT-domain downscaling when the crop allows)
  dali_cpu         FusionFlow's DALI pipeline on DALI's CPU backend (batch 8, 1 thread)
Candidates are interleaved repeat by repeat; medians over repeats; ratios against torchvision.
Fidelity of ff_fast: PSNR against ff_exact on the same draws.

    .venv/bin/python experiments/bench_cpu_pipeline.py [--images 200] [--repeats 5] [--policy randaugment]
        [--min-side 200 --max-side 1000]
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import RESULTS, provenance, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default="randaugment", choices=["randaugment", "trivialaugment", "autoaugment"])
    ap.add_argument("--min-side", type=int, default=200)
    ap.add_argument("--max-side", type=int, default=1000)
    ap.add_argument("--no-dali", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default experiments/results/cpu_pipeline_<policy>.json)")
    args = ap.parse_args()

    import torch
    import torchvision
    import torchvision.transforms.v2 as T
    from PIL import Image

    from fusionflow import load_policy
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.synthetic import make_jpegs

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    data = make_jpegs(args.images, args.min_side, args.max_side, seed=11)
    print(f"{len(data)} JPEGs, {sum(map(len, data)) / len(data) / 1024:.0f} KiB average, policy {args.policy}")

    tv_aug = {"randaugment": T.RandAugment(num_ops=2, magnitude=9),
              "trivialaugment": T.TrivialAugmentWide(),
              "autoaugment": T.AutoAugment()}[args.policy]
    tv = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(), tv_aug, T.PILToTensor()])
    policy = load_policy(args.policy)
    exact = CpuPipeline(dataclasses.replace(policy, fast_downscale=False))
    fast = CpuPipeline(policy)
    out = np.empty((3, 224, 224), np.uint8)

    def run_tv():
        for d in data:
            tv(Image.open(io.BytesIO(d)).convert("RGB"))

    def run_ff(pipe):
        def go():
            for i, d in enumerate(data):
                pipe(d, i, seed=0, epoch=0, out=out)
        return go

    candidates = {"torchvision": run_tv, "ff_exact": run_ff(exact), "ff_fast": run_ff(fast)}
    dali_build = None
    if not args.no_dali:
        from fusionflow.ops.dali_pipeline import DaliPolicyPipeline
        dp = DaliPolicyPipeline(policy, batch_size=8, device="cpu", num_threads=1)
        dali_build = dp.build_seconds

        def run_dali():
            for s in range(0, len(data), 8):
                idx = list(range(s, min(s + 8, len(data))))
                dp.run([data[i] for i in idx], idx)
        candidates["dali_cpu"] = run_dali

    for go in candidates.values():  # warm-up: caches, lazy imports, first-call costs
        go()
    times = {name: [] for name in candidates}
    for r in range(args.repeats):
        for name, go in candidates.items():
            t0 = time.perf_counter()
            go()
            times[name].append(time.perf_counter() - t0)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {len(data) / t[-1]:.0f} img/s" for n, t in times.items()))

    rate = {n: len(data) / statistics.median(t) for n, t in times.items()}
    def fidelity(fast_pipe, exact_pipe) -> dict:
        scores = []
        for i, d in enumerate(data):
            a, b = fast_pipe(d, i).astype(np.float64), exact_pipe(d, i).astype(np.float64)
            mse = np.mean((a - b) ** 2)
            scores.append(float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse))
        finite = [p for p in scores if np.isfinite(p)]
        return {"identical_samples": len(scores) - len(finite), "samples": len(scores),
                "median": statistics.median(finite) if finite else None,
                "min": min(finite) if finite else None}

    crop_only = load_policy("default")
    psnr = {"policy": fidelity(fast, exact),
            "crop_only": fidelity(CpuPipeline(crop_only), CpuPipeline(dataclasses.replace(crop_only, fast_downscale=False)))}
    result = {
        "benchmark": "cpu_pipeline", "policy": args.policy, "images": len(data), "repeats": args.repeats,
        "image_sides": [args.min_side, args.max_side],
        **provenance(),
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "pillow": Image.__version__, "numpy": np.__version__},
        "img_per_s_median": rate,
        "seconds_per_repeat": times,
        "ratio_vs_torchvision": {n: rate[n] / rate["torchvision"] for n in rate if n != "torchvision"},
        "fast_downscale_psnr_db": psnr,
        "dali_build_seconds": dali_build,
    }
    if dali_build is not None:
        import nvidia.dali
        result["versions"]["dali"] = nvidia.dali.__version__
    print("\nmedian img/s per core: " + ", ".join(f"{n} {v:.0f}" for n, v in rate.items()))
    print("ratio vs torchvision: " + ", ".join(f"{n} {v:.2f}x" for n, v in result["ratio_vs_torchvision"].items()))
    for what, p in psnr.items():
        med = "n/a" if p["median"] is None else f"{p['median']:.1f} dB"
        low = "n/a" if p["min"] is None else f"{p['min']:.1f} dB"
        print(f"fast_downscale vs exact ({what}): {p['identical_samples']} of {p['samples']} identical, "
              f"PSNR of the others median {med}, min {low}")
    write_json(result, args.out or os.path.join(RESULTS, f"cpu_pipeline_{args.policy}_{args.min_side}-{args.max_side}px.json"))


if __name__ == "__main__":
    main()
