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

`--mode loader`: the loaders a timm train.py builds, alternated pass by pass in one run -- timm's own
`timm.data.create_loader` (DataLoader workers, its prefetcher normalising and erasing in the training
process) vs `fusionflow.timm.create_loader` with the same arguments -- over timm's `create_dataset` of an
ImageFolder of the chosen sizes, `--workers` workers each, the training loop doing nothing but touch the
batch; img/s over each pass after its first batch, medians over repeats, the ratio. `--mixup 0.2` adds
timm's FastCollateMixup as collate_fn (train.py's --mixup with the prefetcher).

    .venv/bin/python -m experiments.bench_timm --mode loader --images 512 --workers 2 --repeats 3

`--eval` (loader mode): the evaluation loaders instead (is_training=False: resize, centre crop), where
FusionFlow decodes exactly by default (timm's pixels); `fusionflow_fast` is the same with decode="fast".
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import time
import warnings

import numpy as np

from experiments.harness import RESULTS, interleaved_rates, provenance, write_json

RECIPES = {
    "rand-m9-mstd0.5-inc1": dict(auto_augment="rand-m9-mstd0.5-inc1", interpolation="random", re_prob=0.25),
    "augmix-m5-w4-d2": dict(auto_augment="augmix-m5-w4-d2"),
    "original-mstd0.5": dict(auto_augment="original-mstd0.5", re_prob=0.25, re_mode="pixel"),
    "jitter-0.4": dict(),  # timm's default train transform: no auto_augment, so ColorJitter(0.4, 0.4, 0.4)
    # the loader mode's default: train.py's example flags (--aa rand-m9-mstd0.5-inc1 --reprob 0.25 --remode
    # pixel; its --train-interpolation default is random)
    "train-py-example": dict(
        auto_augment="rand-m9-mstd0.5-inc1", interpolation="random", re_prob=0.25, re_mode="pixel"
    ),
}
LOADER_RECIPE = "train-py-example"


def keep_timm_running_on_pillow_13() -> None:
    """timm 1.0.31's Posterize ops keep 0 bits at level 10 (a magnitude-noise draw reaches it), which
    Pillow 13 refuses with a ValueError that ends timm's run; keep 1 bit there instead (the same cost)."""
    from PIL import ImageOps
    from timm.data import auto_augment as aa

    def posterize(img, bits_to_keep, **__):
        return img if bits_to_keep >= 8 else ImageOps.posterize(img, max(1, bits_to_keep))

    aa.NAME_TO_OP.update({k: posterize for k, v in aa.NAME_TO_OP.items() if v is aa.posterize})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="pipeline", choices=["pipeline", "loader"])
    ap.add_argument("--workers", type=int, default=2, help="loader mode: workers per loader")
    ap.add_argument("--batch-size", type=int, default=64, help="loader mode")
    ap.add_argument(
        "--device", default="cpu", help="loader mode: both loaders' device= (cuda: timm's prefetcher on the GPU)"
    )
    ap.add_argument("--mixup", type=float, default=0.0, help="loader mode: FastCollateMixup's mixup_alpha")
    ap.add_argument("--eval", action="store_true", help="loader mode: the evaluation loaders (is_training=False)")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="imagenet", choices=["200-1000", "imagenet", "800-2000"])
    ap.add_argument(
        "--recipes", default=None, help=f"comma-separated keys of RECIPES (default: all; loader mode: {LOADER_RECIPE})"
    )
    ap.add_argument("--out", default=None, help="default: results/timm_pipeline.json or timm_loader.json")
    args = ap.parse_args()
    if args.mode == "loader":
        return loader_main(args)
    args.out = args.out or os.path.join(RESULTS, "timm_pipeline.json")
    keep_timm_running_on_pillow_13()

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
    for name in (args.recipes or ",".join(k for k in RECIPES if k != LOADER_RECIPE)).split(","):
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


def loader_main(args) -> None:
    import statistics

    import torch
    from timm.data import FastCollateMixup, create_dataset
    from timm.data import create_loader as timm_create_loader

    from experiments.harness import data_path, rounds
    from fusionflow.timm import create_loader as ff_create_loader

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    keep_timm_running_on_pillow_13()  # (DataLoader's forked workers inherit the patch)
    root = _folder(data_path(f"timm_{args.sizes}_{args.images}"), args.sizes, args.images)
    recipes = (args.recipes or LOADER_RECIPE).split(",")
    results = {}
    for name in recipes:
        training = not args.eval
        recipe = dict(RECIPES[name], is_training=training, num_workers=args.workers, device=torch.device(args.device))
        if args.eval:  # timm's evaluation: its default filter (it has no random one), the recipe's augmentation unused
            recipe["interpolation"] = "bilinear"

        def build(make, **more):
            ds = create_dataset("", root=root, split="train", is_training=training)
            collate = FastCollateMixup(mixup_alpha=args.mixup, num_classes=4) if args.mixup else None
            return make(ds, (3, 224, 224), args.batch_size, collate_fn=collate, **recipe, **more)

        loaders = {"timm": build(timm_create_loader), "fusionflow": build(ff_create_loader)}
        if args.eval:
            loaders["fusionflow_fast"] = build(ff_create_loader, decode="fast")

        def one_pass(loader):
            def go() -> float:
                t0, n = None, 0
                for x, _ in loader:
                    float(x[:, 0, 0, 0].sum())  # touch the batch
                    if t0 is None:
                        t0 = time.perf_counter()
                        continue
                    n += len(x)
                return (time.perf_counter() - t0) / n  # seconds per image

            return go

        try:
            secs = rounds({k: one_pass(v) for k, v in loaders.items()}, args.repeats, rotate=True, report=_report(name))
        finally:
            for k in ("fusionflow", "fusionflow_fast"):
                if k in loaders:
                    loaders[k].close()
        rate = {k: 1 / statistics.median(v) for k, v in secs.items()}
        results[name] = {
            "recipe": {k: v for k, v in recipe.items() if k in RECIPES[name]},  # as run (--eval: bilinear)
            "img_per_s": rate,
            "ratio": rate["fusionflow"] / rate["timm"],
            "img_per_s_per_repeat": {k: [1 / s for s in v] for k, v in secs.items()},
            "ratio_per_repeat": [t / f for t, f in zip(secs["timm"], secs["fusionflow"])],
        }
        if "fusionflow_fast" in rate:
            results[name]["ratio_fast"] = rate["fusionflow_fast"] / rate["timm"]
        print(f"{name}: timm {rate['timm']:.0f} img/s, fusionflow {rate['fusionflow']:.0f} img/s, "
              f"{results[name]['ratio']:.2f}x")  # fmt: skip
    out = args.out or os.path.join(RESULTS, "timm_loader.json")
    keys = ("images", "sizes", "workers", "batch_size", "mixup", "repeats", "device", "eval")
    setup = {k: getattr(args, k) for k in keys}
    write_json({"provenance": provenance(), **setup, "results": results}, out)


def _report(name: str):
    def report(r: int, times: dict) -> None:
        print(f"{name} repeat {r + 1}: " + ", ".join(f"{k} {1 / t[-1]:.0f} img/s" for k, t in times.items()))

    return report


def _folder(root: str, sizes: str, images: int) -> str:
    """root/train/class_k/*.jpg: `images` JPEGs of the chosen sizes in 4 classes (kept once written)."""
    from fusionflow.tools.synthetic import sample_set

    train = os.path.join(root, "train")
    if not os.path.isdir(train):
        for i, data in enumerate(sample_set(sizes, images, seed=11)):
            os.makedirs(os.path.join(train, f"class_{i % 4}"), exist_ok=True)
            with open(os.path.join(train, f"class_{i % 4}", f"{i:05d}.jpg"), "wb") as f:
                f.write(data)
    return root


if __name__ == "__main__":
    main()
