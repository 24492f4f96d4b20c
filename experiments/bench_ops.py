"""Per-op kernel table for the CPU pipeline: every op of every shipped policy at 224x224, and the
other per-sample stages (resize of the decoded window, flip, CHW write, the draw), timed per
candidate library on one core. The product's `fast` kernel per op (fusionflow/ops/fast.py FAST)
is the fastest candidate within its fidelity bound; this script is the measurement behind that
choice.

Candidates per op:
  pillow        fusionflow.ops.exact on a PIL image (the pipeline before arrays; = torchvision's PIL path)
  exact         fast.EXACT on an HWC array (bit-identical to pillow; checked here too)
  fast          fast.FAST (OpenCV where it won)
  torchvision   torchvision.transforms.v2.functional on a uint8 CHW tensor (the other library a
                user would reach for)
Each op runs at the magnitude RandAugment's default draws (bin 9 of 31) on real decoded windows
(synthetic JPEGs, resized to 224x224). Reported: median microseconds per call over interleaved
repeats, and the largest pixel difference and PSNR of each candidate against pillow.

    .venv/bin/python -m experiments.bench_ops --repeats 7 --json experiments/results/bench_ops.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from experiments.harness import provenance, write_json


def _images(n: int, size: int = 224) -> list[np.ndarray]:
    """ImageNet-like synthetic JPEGs, decoded and resized to size x size (what the ops see)."""
    import io

    from PIL import Image

    from fusionflow.tools.synthetic import make_imagenet_like_jpegs

    out = []
    for data in make_imagenet_like_jpegs(n):
        img = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        out.append(np.ascontiguousarray(np.asarray(img)))
    return out


def _time(fn, inputs, repeats: int) -> float:
    """Median over `repeats` of the mean microseconds per call over `inputs`."""
    fn(inputs[0])
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in inputs:
            fn(x)
        runs.append((time.perf_counter() - t0) / len(inputs) * 1e6)
    return statistics.median(runs)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def op_cases():
    """(op name, value) at RandAugment's bin 9 of 31 for every op any shipped policy uses."""
    from fusionflow.policy import load_policy

    cases = {}
    for name in ("randaugment", "trivialaugment", "autoaugment", "randaugment-paper"):
        aug = load_policy(name).augment
        for op in aug.ops:
            if op.name not in cases:
                cases[op.name] = op.value(min(9, aug.num_bins - 1), aug.num_bins)
    return cases


def _tv_kernel(name: str, value: float, params):
    """torchvision.transforms.v2.functional for the op, on a CHW uint8 tensor, or None."""
    import torchvision.transforms.v2.functional as F
    from torchvision.transforms import InterpolationMode

    near = InterpolationMode.NEAREST
    table = {
        "Identity": lambda t: t,
        "ShearX": lambda t: F.affine(
            t, angle=0.0, translate=[0, 0], scale=1.0, shear=[math.degrees(math.atan(value)), 0.0], interpolation=near
        ),
        "ShearY": lambda t: F.affine(
            t, angle=0.0, translate=[0, 0], scale=1.0, shear=[0.0, math.degrees(math.atan(value))], interpolation=near
        ),
        "TranslateX": lambda t: F.affine(
            t, angle=0.0, translate=[int(value), 0], scale=1.0, shear=[0.0, 0.0], interpolation=near
        ),
        "TranslateY": lambda t: F.affine(
            t, angle=0.0, translate=[0, int(value)], scale=1.0, shear=[0.0, 0.0], interpolation=near
        ),
        "Rotate": lambda t: F.rotate(t, value, interpolation=near),
        "Brightness": lambda t: F.adjust_brightness(t, 1.0 + value),
        "Color": lambda t: F.adjust_saturation(t, 1.0 + value),
        "Contrast": lambda t: F.adjust_contrast(t, 1.0 + value),
        "Sharpness": lambda t: F.adjust_sharpness(t, 1.0 + value),
        "Posterize": lambda t: F.posterize(t, int(value)),
        "Solarize": lambda t: F.solarize(t, value),
        "AutoContrast": F.autocontrast,
        "Equalize": F.equalize,
        "Invert": F.invert,
    }
    return table.get(name)


def bench_op_table(images, repeats: int) -> dict:
    import torch
    from PIL import Image

    from fusionflow.ops import exact, fast
    from fusionflow.policy.op_specs import OPS

    torch.set_num_threads(1)
    style = exact.Style()
    pils = [Image.fromarray(a) for a in images]
    tensors = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in images]
    rows = {}
    for name, value in op_cases().items():
        params = OPS[name].resolve(value, (0.3, 0.6), 224, 224)
        ref = [np.asarray(exact.apply(name, p, value, params, style)) for p in pils]
        row = {"value": value}
        row["pillow_us"] = _time(lambda p: exact.apply(name, p, value, params, style), pils, repeats)
        for kind, table in (("exact", fast.EXACT), ("fast", fast.FAST)):
            fn = table[name]
            row[f"{kind}_us"] = _time(lambda a, fn=fn: fn(a, value, params, style), images, repeats)
            outs = [fn(a, value, params, style) for a in images]
            row[f"{kind}_max_diff"] = max(int(np.abs(o.astype(int) - r).max()) for o, r in zip(outs, ref))
            row[f"{kind}_psnr_min"] = min(_psnr(o, r) for o, r in zip(outs, ref))
            row[f"{kind}_kernel"] = fn.__name__
        tv = _tv_kernel(name, value, params)
        if tv is not None:
            row["torchvision_us"] = _time(tv, tensors, repeats)
        rows[name] = row
        print(
            f"{name:13s} pillow {row['pillow_us']:7.1f}  exact {row['exact_us']:7.1f} ({row['exact_kernel']}, "
            f"max diff {row['exact_max_diff']})  fast {row['fast_us']:7.1f} ({row['fast_kernel']}, max diff "
            f"{row['fast_max_diff']}, PSNR min {row['fast_psnr_min']:.1f})  torchvision "
            f"{row.get('torchvision_us', float('nan')):7.1f} us"
        )
    return rows


def bench_stages(images, repeats: int) -> dict:
    """Flip, the CHW write and the conversions between Pillow and arrays."""
    import cv2
    from PIL import Image

    from fusionflow.ops import fast

    pils = [Image.fromarray(a) for a in images]
    out = np.empty((3, 224, 224), np.uint8)

    def write_pillow(p):
        for plane, band in zip(out, p.split()):
            plane[...] = np.asarray(band)

    rows = {
        "flip_pillow_us": _time(lambda p: p.transpose(Image.Transpose.FLIP_LEFT_RIGHT), pils, repeats),
        "flip_opencv_us": _time(fast.flip, images, repeats),
        "flip_numpy_us": _time(lambda a: np.ascontiguousarray(a[:, ::-1]), images, repeats),
        "write_pillow_split_us": _time(write_pillow, pils, repeats),
        "write_opencv_split_us": _time(lambda a: fast.write_planes(a, out), images, repeats),
        "write_numpy_transpose_us": _time(lambda a: np.copyto(out, a.transpose(2, 0, 1)), images, repeats),
        "array_to_pillow_us": _time(Image.fromarray, images, repeats),
        "pillow_to_array_us": _time(np.asarray, pils, repeats),
        "opencv_threads": cv2.getNumThreads(),
    }
    for k, v in rows.items():
        print(f"{k:26s} {v:8.1f}")
    return rows


def _windows(n: int, out: int = 224, sizes: str = "imagenet"):
    """Decoded crop windows as the fast path sees them: (group, data, window, full-res window array,
    exact reference). group: 'up' (window smaller than the output), 'down<2' (up to 2x: no DCT
    reduction applies), 'dct' (2x or more: decoded at 1/2, 1/4, 1/8)."""
    from PIL import Image

    from fusionflow.ops import jpeg
    from fusionflow.ops.decode import dct_reduction
    from fusionflow.policy import crop_window, draw, load_policy
    from fusionflow.tools.synthetic import sample_set

    policy = load_policy("randaugment")
    rows = []
    for i, data in enumerate(sample_set(sizes, n)):
        height, width, _ = jpeg.info(data)
        top, left, h, w = crop_window(policy, draw(policy, 0, 0, i), height, width)
        arr, _ = jpeg.decode_window(data, top, left, h, w)
        ref = np.asarray(Image.fromarray(arr).resize((out, out), Image.Resampling.BILINEAR, reducing_gap=None))
        r = dct_reduction(h, w, out, out)
        group = "dct" if r > 1 else ("up" if max(h, w) <= out else "down<2")
        scaled = jpeg.decode_scaled_window(data, height, width, (top, left, h, w), r) if r > 1 else None
        rows.append((group, data, (top, left, h, w), arr, ref, scaled))
    return rows


def _resize_candidates(out: int = 224) -> dict:
    """name -> fn(data, window, full-res window array) -> (out, out, 3) uint8: decode (where the
    candidate decodes at another scale) + resize, as the fast path would run it."""
    import cv2
    from PIL import Image

    from fusionflow.ops import decode, jpeg, resample

    def pillow(data, win, arr, scaled=None):
        return np.asarray(Image.fromarray(arr).resize((out, out), Image.Resampling.BILINEAR, reducing_gap=None))

    def torch_aa(data, win, arr, scaled=None):
        return np.asarray(resample.resize_antialiased(arr, out, out))

    def cv_linear(data, win, arr, scaled=None):
        return cv2.resize(arr, (out, out), interpolation=cv2.INTER_LINEAR)

    def cv_area(data, win, arr, scaled=None):
        return cv2.resize(arr, (out, out), interpolation=cv2.INTER_AREA)

    def shipped_fast(
        data, win, arr, scaled=None
    ):  # today's fast mode from the bytes: DCT scale + Pillow box, or torch AA
        return np.asarray(decode.decode_crop_resize(data, lambda H, W: win, (out, out), True))

    def dct_m8(data, win, arr, scaled=None, inter=cv2.INTER_AREA):
        """Decode at the smallest M/8 scale that still covers the output, then OpenCV's resize."""
        top, left, h, w = win
        m = next(m for m in range(1, 9) if h * m >= out * 8 and w * m >= out * 8) if min(h, w) >= out else 8
        height, width, _ = jpeg.info(data)
        rh, rw = -(-height * m // 8), -(-width * m // 8)
        y0, x0 = top * m // 8, left * m // 8
        y1, x1 = min(rh, -(-(top + h) * m // 8)), min(rw, -(-(left + w) * m // 8))
        a, _ = jpeg.decode_window(data, y0, x0, y1 - y0, x1 - x0, (m, 8))
        return cv2.resize(a, (out, out), interpolation=inter)

    def cv_preblur_linear(data, win, arr, scaled=None):
        """resample.pre_blur at any shrink (the shipped path blurs only beyond LINEAR_UP_TO) + bilinear."""
        return cv2.resize(resample.pre_blur(arr, out, out), (out, out), interpolation=cv2.INTER_LINEAR)

    def cv_preblur_3sigma_linear(data, win, arr, scaled=None):
        """The pre-blur as shipped before its 3-tap kernel: taps out to +-3 sigma (5-7), then bilinear."""
        h, w = arr.shape[:2]
        if h > out * resample.LINEAR_UP_TO or w > out * resample.LINEAR_UP_TO:
            sy, sx = _pre_blur_sigma(h / out), _pre_blur_sigma(w / out)
            k = [2 * math.ceil(3 * v) + 1 if v else 1 for v in (sx, sy)]
            arr = cv2.GaussianBlur(arr, tuple(k), sigmaX=sx or 1.0, sigmaY=sy or 1.0)
        return cv2.resize(arr, (out, out), interpolation=cv2.INTER_LINEAR)

    def shipped_window(data, win, arr, scaled=None):  # what the array fast path runs on a full-scale window
        return resample.resize_window(arr, out, out)

    return {
        "pillow (exact)": pillow,
        "torch AA": torch_aa,
        "opencv INTER_LINEAR": cv_linear,
        "opencv Gaussian pre-blur + INTER_LINEAR": cv_preblur_linear,
        "pre-blur on +-3 sigma taps + INTER_LINEAR (before the 3 taps)": cv_preblur_3sigma_linear,
        "shipped resize_window": shipped_window,
        "opencv INTER_AREA": cv_area,
        "fast, Pillow-image path (bytes -> output)": shipped_fast,
        "DCT M/8 + opencv INTER_AREA (bytes -> output)": dct_m8,
    }


def _pre_blur_sigma(ratio: float) -> float:
    """The shipped pre-blur's sigma for a shrink by `ratio` (resample.pre_blur's docstring)."""
    from fusionflow.ops import resample

    return resample.PRE_BLUR * math.sqrt(ratio * ratio - 1.0) if ratio > 1.0 else 0.0


def _box_candidates(out: int = 224) -> dict:
    """name -> fn((scaled window array, fractional box)) -> (out, out, 3) uint8: the resample after a
    DCT-scaled decode (the window is 1-2x the output there)."""
    import cv2
    import torch
    from PIL import Image

    from fusionflow.ops import resample

    def pillow_box(s):
        arr, box = s
        return np.asarray(
            Image.fromarray(arr).resize((out, out), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
        )

    def cv_warp_linear(s):
        arr, (x0, y0, x1, y1) = s
        sx, sy = (x1 - x0) / out, (y1 - y0) / out
        m = np.array([[sx, 0, x0 + 0.5 * sx - 0.5], [0, sy, y0 + 0.5 * sy - 0.5]])
        return cv2.warpAffine(
            arr, m, (out, out), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE
        )

    def _rounded(s):
        arr, (x0, y0, x1, y1) = s
        return np.ascontiguousarray(arr[round(y0) : round(y1), round(x0) : round(x1)])

    def cv_area_rounded(s):
        return cv2.resize(_rounded(s), (out, out), interpolation=cv2.INTER_AREA)

    def cv_linear_rounded(s):
        return cv2.resize(_rounded(s), (out, out), interpolation=cv2.INTER_LINEAR)

    def torch_aa_rounded(s):
        x = torch.from_numpy(_rounded(s)).permute(2, 0, 1).unsqueeze(0)
        y = torch.nn.functional.interpolate(x, size=(out, out), mode="bilinear", antialias=True, align_corners=False)
        return cv2.merge(list(y[0].numpy()))

    def shipped_box(s):
        return resample.resample_box(*s, out, out)

    return {
        "pillow, fractional box (exact's geometry)": pillow_box,
        "shipped resample_box (pre-blur + warpAffine INTER_LINEAR)": shipped_box,
        "opencv warpAffine INTER_LINEAR, fractional box": cv_warp_linear,
        "opencv INTER_AREA, rounded box": cv_area_rounded,
        "opencv INTER_LINEAR, rounded box": cv_linear_rounded,
        "torch AA, rounded box": torch_aa_rounded,
    }


def bench_resize(n: int, repeats: int, sizes: str = "imagenet") -> dict:
    """Per window group: microseconds and PSNR against exact for each resize candidate. Candidates
    marked 'bytes -> output' include their decode; the others start from the full-res window."""
    from fusionflow.ops import jpeg

    windows = _windows(n, sizes=sizes)
    decode_us = {}
    result = {}
    for group in ("up", "down<2", "dct"):
        rows = [w for w in windows if w[0] == group]
        if not rows:
            continue
        result[group] = {"windows": len(rows)}
        decode_us = _time(lambda r: jpeg.decode_window(r[1], *r[2]), rows, repeats)
        result[group]["full-res window decode_us"] = decode_us
        candidates = _resize_candidates()
        if group == "dct":
            candidates.update({k: (lambda d, w, a, s, fn=fn: fn(s)) for k, fn in _box_candidates().items()})
        for name, fn in candidates.items():
            us = _time(lambda r, fn=fn: fn(r[1], r[2], r[3], r[5]), rows, repeats)
            psnr = [_psnr(fn(r[1], r[2], r[3], r[5]), r[4]) for r in rows]
            result[group][name] = {
                "us": us,
                "psnr_median": float(np.median(psnr)),
                "psnr_p1": float(np.percentile(psnr, 1)),
            }
            print(
                f"{group:7s} {len(rows):3d} windows  {name:48s} {us:7.1f} us  PSNR vs exact median "
                f"{np.median(psnr):5.1f} dB, 1st pct {np.percentile(psnr, 1):5.1f}"
            )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--windows", type=int, default=120, help="crop windows for the resize section")
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="ops,stages,resize", help="comma-separated: ops, stages, resize")
    p.add_argument(
        "--sizes",
        default="imagenet",
        choices=["200-1000", "imagenet", "800-2000"],
        help="image set of the resize section",
    )
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    import cv2
    import PIL
    import torch

    cv2.setNumThreads(1)  # per core, as in a worker process
    torch.set_num_threads(1)
    images = _images(args.images)
    result = {
        **provenance(),
        "versions": {"opencv": cv2.__version__, "pillow": PIL.__version__, "torch": torch.__version__},
    }
    if "ops" in sections:
        result["ops"] = bench_op_table(images, args.repeats)
    if "stages" in sections:
        result["stages"] = bench_stages(images, args.repeats)
    if "resize" in sections:
        result["resize"] = bench_resize(args.windows, args.repeats, args.sizes)
    if args.json:
        write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
