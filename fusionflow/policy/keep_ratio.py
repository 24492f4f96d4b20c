"""A policy's `crop.mode keep_ratio`: timm's keep-ratio crops, drawn from a sample's crop uniforms.

    crop:
      mode: keep_ratio
      resize: 224 | [h, w]     ResizeKeepRatio's target: the image is scaled by the ratio of its
                               sides to this (see `longest`), keeping its aspect
      longest: 0.0             0: the shorter side's ratio decides (the image covers the target),
                               1: the longer's (the image fits inside it); between: a blend (timm's)
      scale: [lo, hi]          with probability scale_p the scale is multiplied by a factor drawn
      scale_p: 0.0             uniformly from [lo, hi] -- an area factor (1/sqrt) when scale_area
      scale_area: true
      ratio: [lo, hi]          with probability ratio_p the aspect is changed by sqrt(a), a drawn
      ratio_p: 0.0             log-uniformly from [lo, hi] (height / sqrt(a), width * sqrt(a))
      place: random | center   the output.size window of the resized image: RandomCropOrPad (a
                               random offset; an axis shorter than the output is padded at a random
                               split) or CenterCropOrPad
      pad: reflect | [r, g, b] how an axis shorter than the output is padded (0..255 values)
      interpolation: ...       the resize's filter, as for the other modes ('random' allowed)

timm's train_crop_mode 'rkrr' is place random + reflect, 'rkrc' place center + reflect (both with
scale [0.8, 1] area and ratio [0.9, 1/0.9], each with probability 0.5); its eval crop_mode 'border' is
longest 1, place center, pad = the mean colour. The uniforms are the draw's first six crop uniforms
(scale's coin and value, ratio's coin and value, the row and column offset), so a sample's crop is a
pure function of (seed, epoch, index) like the random resized crop's.

`plan` gives what the pipeline does: the source box covered by the output window (fractional, to be
resampled to `covered`), then the pads around it; fusionflow/ops/pipeline.py runs it in both modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionflow.policy.reader import Reader

ONLY = ("longest", "scale_p", "scale_area", "ratio_p", "place", "pad")  # keys of this mode alone
KEYS = ("mode", "resize", "scale", "ratio", *ONLY)


@dataclass(frozen=True)
class KeepRatio:
    resize: tuple[int, int]  # ResizeKeepRatio's target (h, w)
    longest: float = 0.0
    scale: tuple[float, float] = (1.0, 1.0)
    scale_p: float = 0.0
    scale_area: bool = True
    ratio: tuple[float, float] = (1.0, 1.0)
    ratio_p: float = 0.0
    place: str = "random"  # random | center
    pad: tuple[int, int, int] | None = None  # None: reflect; else this constant colour
    resize_is_size: bool = False  # no crop.resize given: the output size's (a size override changes both)


def parse(r: Reader, crop: dict, size: tuple[int, int]) -> KeepRatio:
    """crop.mode keep_ratio's keys (the caller reads mode, interpolation and trim)."""
    raw = crop.get("resize", list(size))
    if isinstance(raw, (list, tuple)):
        if len(raw) != 2:
            r.fail("crop.resize", f"{list(raw)!r}: give one side (an int) or [height, width]")
        resize = tuple(r.integer(v, "crop.resize", 1, 16384) for v in raw)
    else:
        resize = (r.integer(raw, "crop.resize", 1, 16384),) * 2
    pad: Any = crop.get("pad", "reflect")
    return KeepRatio(
        resize=resize,
        resize_is_size="resize" not in crop,
        longest=r.number(crop.get("longest", 0.0), "crop.longest", 0.0, 1.0),
        scale=r.pair(crop.get("scale", (1.0, 1.0)), "crop.scale", 1e-3, 1e3),
        scale_p=r.number(crop.get("scale_p", 0.0), "crop.scale_p", 0.0, 1.0),
        scale_area=r.boolean(crop.get("scale_area", True), "crop.scale_area"),
        ratio=r.pair(crop.get("ratio", (1.0, 1.0)), "crop.ratio", 1e-3, 1e3),
        ratio_p=r.number(crop.get("ratio_p", 0.0), "crop.ratio_p", 0.0, 1.0),
        place=r.choice(crop.get("place", "random"), "crop.place", ("random", "center")),
        pad=None if pad == "reflect" else r.fill(pad, "crop.pad"),
    )


def resized_size(kr: KeepRatio, height: int, width: int, u) -> tuple[int, int]:
    """ResizeKeepRatio's output (h, w) for an image of this size, from uniforms u[0..3]."""
    ratio_h, ratio_w = height / kr.resize[0], width / kr.resize[1]
    ratio = max(ratio_h, ratio_w) * kr.longest + min(ratio_h, ratio_w) * (1.0 - kr.longest)
    fh = fw = 1.0
    if kr.scale_p > 0 and u[0] < kr.scale_p:
        f = kr.scale[0] + (kr.scale[1] - kr.scale[0]) * u[1]
        fh = fw = 1.0 / math.sqrt(f) if kr.scale_area else f
    if kr.ratio_p > 0 and u[2] < kr.ratio_p:
        lo, hi = math.log(kr.ratio[0]), math.log(kr.ratio[1])
        a = math.sqrt(math.exp(lo + (hi - lo) * u[3]))
        fh, fw = fh / a, fw * a
    return max(1, round(height * fh / ratio)), max(1, round(width * fw / ratio))


def offset(kr: KeepRatio, resized: int, out: int, u: float) -> int:
    """Where the output window starts along one axis of the resized image (negative: padded before)."""
    delta = resized - out
    if kr.place == "random":  # RandomCropOrPad: copysign(randint(0, |delta|), delta)
        k = min(int(u * (abs(delta) + 1)), abs(delta))
        return -k if delta < 0 else k
    return -((out - resized) // 2) if delta < 0 else int(round(delta / 2.0))  # CenterCropOrPad


def layout(kr: KeepRatio, size: tuple[int, int], u, height: int, width: int):
    """((resized h, w), the window (y0, y1, x0, x1) of the resized image the output covers, pads (top,
    bottom, left, right) around it to `size`): timm's resize, then crop-or-pad."""
    rh, rw = resized_size(kr, height, width, u)
    out_h, out_w = size
    oy, ox = offset(kr, rh, out_h, u[4]), offset(kr, rw, out_w, u[5])
    y0, y1 = max(oy, 0), min(oy + out_h, rh)
    x0, x1 = max(ox, 0), min(ox + out_w, rw)
    return (rh, rw), (y0, y1, x0, x1), (y0 - oy, out_h - (y1 - oy), x0 - ox, out_w - (x1 - ox))


def plan(kr: KeepRatio, size: tuple[int, int], u, height: int, width: int):
    """(source box (x0, y0, x1, y1), covered (h, w), pads (top, bottom, left, right)): the output is
    the box resampled to `covered`, padded by `pads` to `size` (the resize and the crop as one step)."""
    (rh, rw), (y0, y1, x0, x1), pads = layout(kr, size, u, height, width)
    sy, sx = height / rh, width / rw
    return (x0 * sx, y0 * sy, x1 * sx, y1 * sy), (y1 - y0, x1 - x0), pads


def pad(arr: np.ndarray, pads, fill: tuple[int, int, int] | None) -> np.ndarray:
    """uint8 HWC `arr` padded (top, bottom, left, right): reflected without repeating the edge (numpy's
    'reflect', as torchvision pads a PIL image), or with the constant colour `fill`."""
    top, bottom, left, right = pads
    if not (top or bottom or left or right):
        return arr
    if fill is None:
        return np.pad(arr, ((top, bottom), (left, right), (0, 0)), mode="reflect")
    out = np.empty((arr.shape[0] + top + bottom, arr.shape[1] + left + right, 3), np.uint8)
    out[...] = np.asarray(fill, np.uint8)
    out[top : top + arr.shape[0], left : left + arr.shape[1]] = arr
    return out
