"""Writes fusionflow/configs/deepaa.yaml from the Deep AutoAugment authors' learned ImageNet policy.

Input: `policy_port/policy_DeepAA_imagenet_1.npz` of github.com/AIoT-MLSys-Lab/DeepAA (the repository's
file at commit e77688de44d90417c759764b3bb1b5451892195a; `git show <commit>:policy_port/...` from a
clone). The npz holds `policy_probs` (5 layers x 139 probabilities), `ops` and `mags` (each of the 139
entries' op index and magnitude bin), `op_names` ('Name:(lo,,hi)', 18 ops), `l_mags` (13 bins). The
numbers are carried over as data, float32 as stored (each printed as the shortest decimal that reads
back as the same float32); the op semantics are FusionFlow's own (fusionflow/policy/deepaa.py).

    .venv/bin/python -m experiments.port_deepaa_policy PATH/TO/policy_DeepAA_imagenet_1.npz
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np

from experiments.harness import ROOT

OUT = os.path.join(ROOT, "fusionflow", "configs", "deepaa.yaml")
REPO, FILE_COMMIT = "github.com/AIoT-MLSys-Lab/DeepAA", "e77688de44d90417c759764b3bb1b5451892195a"

HEADER = """\
# Deep AutoAugment's learned ImageNet policy (DeepAA; Zheng, Zhang, Yan, Zhang, "Deep AutoAugment",
# ICLR 2022, arXiv:2203.06172), the numbers of the authors' policy file carried over as data:
#   repository  {repo}
#   file        policy_port/policy_DeepAA_imagenet_1.npz at commit {commit}
#   sha256      {sha}
# written by experiments/port_deepaa_policy.py. Five layers; each draws one (op, magnitude bin) pair
# per sample from its distribution over the 139 pairs below (18 ops, 13 bins: level = bin / 12, the
# value lo + level * (hi - lo) in the op's range; ShearX/Y, TranslateX/Y and Rotate negated with
# p = 0.5). RandResizeCrop (RandomResizedCrop 224, bicubic) and RandFlip are ops of the policy, so a
# sample may be cropped twice or not at all; a sample no layer cropped is the centre 224 x 224 of the
# image at its own resolution, as the authors' evaluation code does.
# RandCutout: the authors' ImageNet search code's 60-px square (its RandCutout60: centre uniform in
# the image's central 256 x 256 box, sides clipped, filled with (125, 123, 114)). Their evaluation
# code maps the policy's name 'RandCutout' to a 16-px cutout that asserts a 32 x 32 (CIFAR) image and
# so cannot run on ImageNet; the search code is what the policy was learned with.
# How FusionFlow's pipeline differs from theirs (it crops first, then runs the layers' other ops at
# 224 x 224) and how close it is: docs/deepaa.md. Semantics: fusionflow/policy/deepaa.py.
"""


def shortest32(v) -> str:
    return np.format_float_positional(np.float32(v), unique=True, trim="-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("npz")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    raw = open(args.npz, "rb").read()
    d = np.load(args.npz)
    names = [str(n).split(":")[0] for n in d["op_names"]]
    ranges = [str(n).split(":")[1].strip("()").split(",,") for n in d["op_names"]]
    ops = [int(v) for v in np.ravel(d["ops"])]
    mags = [int(v) for v in np.ravel(d["mags"])]
    probs = d["policy_probs"]
    assert probs.shape == (5, len(ops)) and len(names) == 18 and int(d["l_mags"]) == 13
    lines = [HEADER.format(repo=REPO, commit=FILE_COMMIT, sha=hashlib.sha256(raw).hexdigest())]
    lines += [
        "output:",
        "  size: 224",
        "crop:",
        "  scale: [0.08, 1.0]",
        "  ratio: [0.75, 1.3333333333333333]",
        "  interpolation: bicubic",
        "augment:",
        "  type: deepaa",
        "  magnitude_bins: 13",
        "  interpolation: nearest",
        "  fill: 0",
        "  cutout: {side: 60, fill: [125, 123, 114]}",
        "  ops:  # the authors' names and ranges, in their index order (no range: no magnitude)",
    ]
    for name, (lo, hi) in zip(names, ranges):
        has_range = name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Solarize", "Posterize")
        has_range = has_range or name in ("Contrast", "Color", "Brightness", "Sharpness")
        lines.append(f"    {name}: [{float(lo)}, {float(hi)}]" if has_range else f"    {name}: null")
    lines.append("  pairs:  # [op, magnitude bin] of each probability's position")
    lines += [f"    - [{names[o]}, {m}]" for o, m in zip(ops, mags)]
    lines.append("  layers:  # per layer, the probability of each pair")
    for layer in probs:
        lines.append("    - [" + ", ".join(shortest32(p) for p in layer) + "]")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {len(ops)} pairs, {probs.shape[0]} layers, ops {names}")


if __name__ == "__main__":
    main()
