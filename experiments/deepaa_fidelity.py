"""How close FusionFlow's DeepAA (crop first, the other ops at the output size) is to the authors' order
(experiments/deepaa_reference.py: every op on the full image until a layer crops), given the same draws.

Per sample class -- by what the authors' order runs before the first crop -- the share of draws and the
PSNR of FusionFlow's exact and fast samples against the authors' order on synthetic ImageNet-sized JPEGs:
  crop_first        the first non-identity step crops: the same order (differences: resampling only)
  point_ops_first   only per-pixel ops (Invert, Solarize, Posterize, Brightness, Color) or flips come
                    before the crop: they commute with it up to the crop's resampling
  other_ops_first   a geometric op (shear, translate, rotate), a statistics op (AutoContrast, Equalize,
                    Contrast), Sharpness or the cutout before the crop: applied to the crop instead
  uncropped         no layer crops: theirs runs every op on the full image, then takes the centre 224
and the same for `order="authors"` (fusionflow/ops/deepaa_order.py: the authors' order itself, so 99 dB: equal),
with each pipeline's time per image in this process (one core): what following their order costs.

    .venv/bin/python -m experiments.deepaa_fidelity [--draws 20000] [--images 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from experiments.deepaa_reference import authors_sample
from experiments.harness import RESULTS, provenance, write_json

POINT = {"Invert", "Solarize", "Posterize", "Brightness", "Color", "RandFlip", "Identity"}


def sample_class(d) -> str:
    ops = [s.op for s in d.steps]
    first = next((k for k, op in enumerate(ops) if op == "RandResizeCrop_imagenet"), None)
    if first is None:
        return "uncropped"
    before = [op for op in ops[:first] if op != "Identity"]
    if not before:
        return "crop_first"
    return "point_ops_first" if all(op in POINT for op in before) else "other_ops_first"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--images", type=int, default=200)
    args = ap.parse_args()
    from fusionflow import load_policy
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.policy import draw
    from fusionflow.tools.synthetic import sample_set

    policy = load_policy("deepaa")
    classes = [sample_class(draw(policy, 0, 0, i)) for i in range(args.draws)]
    share = {c: classes.count(c) / len(classes) for c in sorted(set(classes))}
    pipes = {
        "exact": CpuPipeline(dataclasses.replace(policy, fast_downscale=False)),
        "fast": CpuPipeline(policy),
        "authors": CpuPipeline(load_policy("deepaa", order="authors")),
    }
    scores: dict[str, dict[str, list[float]]] = {c: {m: [] for m in pipes} for c in share}
    seconds: dict[str, list[float]] = {m: [] for m in pipes}
    for i, jpeg in enumerate(sample_set("imagenet", args.images, seed=5)):
        d = draw(policy, 0, 0, i)
        ref = np.asarray(authors_sample(policy, jpeg, d)).transpose(2, 0, 1)
        for m, pipe in pipes.items():
            t0 = time.perf_counter()
            out = pipe(jpeg, i)
            seconds[m].append(time.perf_counter() - t0)
            scores[sample_class(d)][m].append(psnr(out, ref))
    summary = {
        c: {
            "share_of_draws": share[c],
            "images": len(s["exact"]),
            **{f"{m}_psnr_median_db": float(np.median(s[m])) if s[m] else None for m in pipes},
            **{f"{m}_psnr_p10_db": float(np.percentile(s[m], 10)) if s[m] else None for m in pipes},
        }
        for c, s in scores.items()
    }
    for c, v in summary.items():
        print(
            f"{c:16s} {v['share_of_draws']:6.1%} of draws; {v['images']} images: PSNR vs the authors' order "
            f"exact median {v['exact_psnr_median_db']:.1f} dB (p10 {v['exact_psnr_p10_db']:.1f}), "
            f"fast median {v['fast_psnr_median_db']:.1f} dB, authors' order {v['authors_psnr_median_db']:.1f} dB"
        )
    per_core = {m: 1.0 / float(np.median(t)) for m, t in seconds.items()}
    print("img/s on one core (median time per image): " + ", ".join(f"{m} {v:.0f}" for m, v in per_core.items()))
    write_json(
        {
            "benchmark": "deepaa_fidelity",
            "draws": args.draws,
            "images": args.images,
            **provenance(),
            "classes": summary,
            "img_per_s_one_core": per_core,
        },
        os.path.join(RESULTS, "deepaa_fidelity.json"),
    )


if __name__ == "__main__":
    main()
