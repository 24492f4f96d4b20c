"""Where a CPU worker's time goes per sample: the fast pipeline taken apart stage by stage.

Runs the same steps as `CpuPipeline` (fast mode on arrays, JPEG window decoder) one at a time with
a clock between them -- draw, header + crop window, window decode at its DCT scale, resize (OpenCV /
torch, or Pillow's box resample from a DCT-scaled window), flip, the FAST kernels, CHW write --
and, in the same run, the whole pipeline and torchvision.transforms.v2 for scale. Medians over
repeats of the per-stage mean.

    .venv/bin/python -m experiments.cpu_stages [--images 200] [--repeats 5] [--sizes imagenet]
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import numpy as np

from experiments.harness import medians, provenance, result_path, rounds, write_json

STAGES = ("draw", "header_and_window", "decode", "resize", "flip", "ops", "write")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--sizes", default="imagenet", help="imagenet, or min-max side in px")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import torchvision.transforms.v2 as T
    from PIL import Image

    from fusionflow import load_policy
    from fusionflow.ops import decode, fast, jpeg, resample
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.policy import crop_window, draw
    from fusionflow.tools.synthetic import sample_set

    torch.set_num_threads(1)
    import cv2

    cv2.setNumThreads(1)  # per core: OpenCV on one thread, as in a worker process
    if not jpeg.available():
        sys.exit(f"the JPEG window decoder is unavailable: {jpeg.why_unavailable()}")
    data = sample_set(args.sizes, args.images, seed=11)
    policy = load_policy(args.policy)
    pipe = CpuPipeline(policy)
    oh, ow = policy.size
    out = np.empty(pipe.out_shape, np.uint8)
    tv = T.Compose(
        [
            T.RandomResizedCrop(224, antialias=True),
            T.RandomHorizontalFlip(),
            T.RandAugment(num_ops=2, magnitude=9),
            T.PILToTensor(),
        ]
    )

    def staged() -> dict:
        acc = dict.fromkeys(STAGES, 0.0)
        for i, d in enumerate(data):
            t0 = time.perf_counter()
            dr = draw(policy, 0, 0, i)
            t1 = time.perf_counter()
            H, W, _ = jpeg.info(d)
            window = crop_window(policy, dr, H, W)
            t2 = time.perf_counter()
            arr, box = decode.decode_fast_window(d, lambda *_: window, (oh, ow))  # reads the header again (~1 us)
            t3 = time.perf_counter()
            arr = resample.resize_window(arr, oh, ow) if box is None else resample.resample_box(arr, box, oh, ow)
            t4 = time.perf_counter()
            if dr.flip:
                arr = fast.flip(arr)
            t5 = time.perf_counter()
            for op in dr.ops:
                arr = fast.FAST[op.name](arr, op.value, op.params(oh, ow), pipe.style)
            t6 = time.perf_counter()
            fast.write_planes(arr, out)
            t7 = time.perf_counter()
            for k, a, b in zip(STAGES, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
                acc[k] += b - a
        return {k: v / len(data) for k, v in acc.items()}

    def whole() -> float:
        t = time.perf_counter()
        for i, d in enumerate(data):
            pipe(d, i, out=out)
        return (time.perf_counter() - t) / len(data)

    def torchvision() -> float:
        t = time.perf_counter()
        for d in data:
            tv(Image.open(io.BytesIO(d)).convert("RGB"))
        return (time.perf_counter() - t) / len(data)

    values = rounds(
        {"staged": staged, "whole_pipeline": whole, "torchvision": torchvision},
        args.repeats,
        report=lambda r, _: print(f"repeat {r + 1}/{args.repeats}"),
    )
    runs = {k: [per_stage[k] for per_stage in values.pop("staged")] for k in STAGES} | values
    us = {k: 1e6 * v for k, v in medians(runs).items()}
    total = sum(us[k] for k in STAGES)
    for k in STAGES:
        print(f"{k:18s} {us[k]:7.0f} us  {100 * us[k] / total:4.1f}%")
    print(
        f"{'sum of stages':18s} {total:7.0f} us; whole pipeline {us['whole_pipeline']:.0f} us; "
        f"torchvision {us['torchvision']:.0f} us ({us['torchvision'] / us['whole_pipeline']:.2f}x)"
    )
    write_json(
        {
            "benchmark": "cpu_stages",
            "policy": args.policy,
            "sizes": args.sizes,
            "images": len(data),
            "repeats": args.repeats,
            **provenance(),
            "us_per_sample_median": us,
            "share_of_stages": {k: us[k] / total for k in STAGES},
        },
        result_path(args.out, f"cpu_stages_{args.policy}_{args.sizes}.json"),
    )


if __name__ == "__main__":
    main()
