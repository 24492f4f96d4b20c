"""Per-core throughput of timm's training transform, timm vs FusionFlow on the same recipe.

For each recipe, one process and one thread each, in one run, candidates interleaved repeat by repeat:
  timm       timm.data.create_transform(224, is_training=True, **recipe) on PIL images
             (Image.open(...).convert("RGB"), then the transform: crop, flip, augmentation, ToTensor,
             Normalize, erasing when the recipe has it)
  ff_exact   FusionFlow's CPU pipeline on fusionflow.from_timm(same arguments), decode.mode exact
             (timm's pixels given the same draws: tests/test_timm.py)
  ff_fast    the same policy in the default fast mode
Medians over repeats; ratios against timm.

    .venv/bin/python -m experiments.bench_timm [--images 100] [--repeats 3] [--sizes imagenet]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import warnings

import numpy as np

from experiments.harness import RESULTS, interleaved_rates, provenance, write_json

RECIPES = {
    "rand-m9-mstd0.5-inc1": dict(auto_augment="rand-m9-mstd0.5-inc1", interpolation="random", re_prob=0.25),
    "augmix-m5-w4-d2": dict(auto_augment="augmix-m5-w4-d2"),
    "original-mstd0.5": dict(auto_augment="original-mstd0.5", re_prob=0.25, re_mode="pixel"),
    "jitter-0.4": dict(),  # timm's default train transform: no auto_augment, so ColorJitter(0.4, 0.4, 0.4)
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="imagenet", choices=["200-1000", "imagenet", "800-2000"])
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated keys of RECIPES")
    ap.add_argument("--out", default=os.path.join(RESULTS, "timm_pipeline.json"))
    args = ap.parse_args()

    import cv2
    import torch
    from PIL import Image
    from timm.data import create_transform

    import fusionflow
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.tools.synthetic import sample_set

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    data = sample_set(args.sizes, args.images, seed=11)
    print(f"{len(data)} JPEGs ({args.sizes}), {sum(map(len, data)) / len(data) / 1024:.0f} KiB average")
    results = {}
    for name in args.recipes.split(","):
        recipe = RECIPES[name]
        tf = create_transform(224, is_training=True, **recipe)
        policy = fusionflow.from_timm(224, is_training=True, **recipe)
        fast, exact = CpuPipeline(policy), CpuPipeline(dataclasses.replace(policy, fast_downscale=False))
        out = np.empty(policy.out_shape, np.float32)

        def run_timm(tf=tf):
            for d in data:
                tf(Image.open(io.BytesIO(d)).convert("RGB"))

        def run_ff(pipe):
            def go():
                for i, d in enumerate(data):
                    pipe(d, i, seed=0, epoch=0, out=out)

            return go

        candidates = {"timm": run_timm, "ff_exact": run_ff(exact), "ff_fast": run_ff(fast)}
        times, rate = interleaved_rates(candidates, len(data), args.repeats, label=f"{name} ")
        results[name] = {
            "recipe": recipe,
            "img_per_s": rate,
            "ratio_vs_timm": {c: rate[c] / rate["timm"] for c in ("ff_exact", "ff_fast")},
            "seconds": times,
        }
        print(f"{name}: " + ", ".join(f"{c} {rate[c]:.0f} img/s ({rate[c] / rate['timm']:.2f}x)" for c in rate))
    write_json({"provenance": provenance(), "images": len(data), "sizes": args.sizes, "results": results}, args.out)


if __name__ == "__main__":
    main()
