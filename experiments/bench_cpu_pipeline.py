"""Per-core throughput of the whole CPU augmentation pipeline, FusionFlow vs torchvision.

decode + RandomResizedCrop(224) + flip + RandAugment(N=2, M=9) (or --policy's; eval: Resize(256) + CenterCrop(224))
on synthetic JPEGs
(quality 90), one process, one thread each, in one run:
  torchvision        torchvision.transforms.v2 on PIL images (Image.open(...).convert("RGB")); for
                     --policy augmix its AugMix; for --policy deepaa, which torchvision does not ship,
                     the authors' algorithm in their order on PIL images, given FusionFlow's draws
                     (experiments/deepaa_reference.py)
  ff_exact_pillow    FusionFlow exact mode decoding whole images with Pillow (the path before the
                     window decoder; what runs where libjpeg-turbo's headers are missing)
  ff_exact           FusionFlow exact mode: window decode + Pillow resize (bit-identical to torchvision)
  ff_fast_pillow     the previous fast mode: Pillow draft (DCT scaling of the whole image) + Pillow resize
  ff_fast            FusionFlow fast mode as shipped: window decode at the coarsest DCT scale that
                     covers the output + torch's SIMD uint8 antialiased resize
  dali_cpu           FusionFlow's DALI pipeline on DALI's CPU backend (batch 8, 1 thread); not for a
                     policy the DALI graph declines (augmix, deepaa)
  decode_only        the limit: ff_fast's crop windows (drawn beforehand) decoded at ff_fast's DCT
                     scales, nothing else (no draw, resize, ops or write)
Candidates are interleaved repeat by repeat; medians over repeats; ratios against torchvision, and
ff_fast's share of the decode-only rate.
Fidelity of ff_fast: PSNR against ff_exact on the same draws (median, 1st percentile, minimum),
with the policy's ops and crop + flip only.

The window decoder is the native one when it builds; FUSIONFLOW_JPEG_WINDOW=0 forces the
nvImageCodec fallback (recorded in the JSON as window_decoder).

Image sets: --sizes 200-1000 (sides uniform in 200..1000), imagenet (500x375 and 375x500, sides
jittered by up to 10%), 800-2000.

    .venv/bin/python -m experiments.bench_cpu_pipeline [--images 200] [--repeats 5] [--policy randaugment]
        [--sizes 200-1000 | imagenet | 800-2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
import warnings
from functools import partial

import numpy as np

from experiments.harness import interleaved_rates, provenance, result_path, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--policy",
        default="randaugment",
        choices=["randaugment", "trivialaugment", "autoaugment", "augmix", "deepaa", "eval"],
    )
    ap.add_argument("--sizes", default="200-1000", choices=["200-1000", "imagenet", "800-2000"])
    ap.add_argument("--no-dali", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default experiments/results/cpu_pipeline_<policy>.json)")
    args = ap.parse_args()

    import torch
    import torchvision
    import torchvision.transforms.v2 as T
    from PIL import Image

    from fusionflow import load_policy
    from fusionflow.ops import decode
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.policy import crop_window, draw
    from fusionflow.tools.synthetic import sample_set

    torch.set_num_threads(1)
    import cv2

    cv2.setNumThreads(1)  # per core: OpenCV on one thread, as in a worker process
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    data = sample_set(args.sizes, args.images, seed=11)
    print(
        f"{len(data)} JPEGs ({args.sizes}), {sum(map(len, data)) / len(data) / 1024:.0f} KiB average, "
        f"policy {args.policy}"
    )
    window_available = decode.jpeg.available()
    if not window_available:
        sys.exit(f"the JPEG window decoder is unavailable ({decode.jpeg.why_unavailable()}): nothing to compare")

    policy = load_policy(args.policy)
    exact = CpuPipeline(dataclasses.replace(policy, fast_downscale=False))
    fast = CpuPipeline(policy)
    out = np.empty((3, 224, 224), np.uint8)
    draws = [draw(policy, 0, 0, i) for i in range(len(data))]
    if args.policy == "deepaa":  # the authors' algorithm (their order, PIL) on the same draws
        from experiments.deepaa_reference import authors_sample

        def run_tv():
            for d, dr in zip(data, draws):
                T.functional.pil_to_tensor(authors_sample(policy, d, dr))

    elif args.policy == "eval":  # validation: Resize(256) + CenterCrop(224), exact mode to the bit
        tv = T.Compose([T.Resize(policy.center_resize, antialias=True), T.CenterCrop(224), T.PILToTensor()])

        def run_tv():
            for d in data:
                tv(Image.open(io.BytesIO(d)).convert("RGB"))

    else:
        tv_aug = {
            "randaugment": T.RandAugment(num_ops=2, magnitude=9),
            "trivialaugment": T.TrivialAugmentWide(),
            "autoaugment": T.AutoAugment(),
            "augmix": T.AugMix(),
        }[args.policy]
        tv = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(), tv_aug, T.PILToTensor()])

        def run_tv():
            for d in data:
                tv(Image.open(io.BytesIO(d)).convert("RGB"))

    def run_ff(pipe, window=True):
        def go():
            decode.jpeg.available = (lambda: True) if window else (lambda: False)
            try:
                for i, d in enumerate(data):
                    pipe(d, i, seed=0, epoch=0, out=out)
            finally:
                decode.jpeg.available = lambda: True

        return go

    def run_decode_only():
        for d, dr in zip(data, draws):
            decode.decode_fast_window(d, partial(crop_window, policy, dr), policy.size)

    candidates = {
        "decode_only": run_decode_only,
        "torchvision": run_tv,
        "ff_exact_pillow": run_ff(exact, window=False),
        "ff_exact": run_ff(exact),
        "ff_fast_pillow": run_ff(fast, window=False),
        "ff_fast": run_ff(fast),
    }
    dali_build = None
    from fusionflow.accel.declines import dali_declines

    if not args.no_dali and dali_declines(policy) is None:
        from fusionflow.accel.dali_graph import DaliPolicyPipeline

        dp = DaliPolicyPipeline(policy, batch_size=8, device="cpu", num_threads=1)
        dali_build = dp.build_seconds

        def run_dali():
            for s in range(0, len(data), 8):
                idx = list(range(s, min(s + 8, len(data))))
                dp.run([data[i] for i in idx], idx)

        candidates["dali_cpu"] = run_dali

    times, rate = interleaved_rates(candidates, len(data), args.repeats)

    def fidelity(fast_pipe, exact_pipe) -> dict:
        scores = []
        for i, d in enumerate(data):
            a, b = fast_pipe(d, i).astype(np.float64), exact_pipe(d, i).astype(np.float64)
            mse = np.mean((a - b) ** 2)
            scores.append(float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse))
        finite = [p for p in scores if np.isfinite(p)]
        return {
            "identical_samples": len(scores) - len(finite),
            "samples": len(scores),
            "median": float(np.median(scores)) if scores else None,
            "p1": float(np.percentile(scores, 1)) if scores else None,
            "min": min(scores) if scores else None,
        }

    crop_only = load_policy("default")
    psnr = {
        "policy": fidelity(fast, exact),
        "crop_only": fidelity(
            CpuPipeline(crop_only), CpuPipeline(dataclasses.replace(crop_only, fast_downscale=False))
        ),
    }
    result = {
        "benchmark": "cpu_pipeline",
        "policy": args.policy,
        "images": len(data),
        "repeats": args.repeats,
        "image_sizes": args.sizes,
        "window_decoder": decode.jpeg.backend(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("FUSIONFLOW_")},
        **provenance(),
        "versions": {
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "pillow": Image.__version__,
            "numpy": np.__version__,
        },
        "img_per_s_median": rate,
        "seconds_per_repeat": times,
        "ratio_vs_torchvision": {n: rate[n] / rate["torchvision"] for n in rate if n != "torchvision"},
        "share_of_decode_only": {n: rate[n] / rate["decode_only"] for n in rate if n != "decode_only"},
        "fast_downscale_psnr_db": psnr,
        "dali_build_seconds": dali_build,
    }
    if dali_build is not None:
        import nvidia.dali

        result["versions"]["dali"] = nvidia.dali.__version__
    print("\nmedian img/s per core: " + ", ".join(f"{n} {v:.0f}" for n, v in rate.items()))
    print("ratio vs torchvision: " + ", ".join(f"{n} {v:.2f}x" for n, v in result["ratio_vs_torchvision"].items()))
    print("share of decode-only: " + ", ".join(f"{n} {v:.0%}" for n, v in result["share_of_decode_only"].items()))
    for what, p in psnr.items():
        print(
            f"fast vs exact ({what}): {p['identical_samples']} of {p['samples']} identical; PSNR median "
            f"{p['median']:.1f} dB, 1st percentile {p['p1']:.1f} dB, min {p['min']:.1f} dB (identical = inf)"
        )
    write_json(result, result_path(args.out, f"cpu_pipeline_{args.policy}_{args.sizes}.json"))


if __name__ == "__main__":
    main()
