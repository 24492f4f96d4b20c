"""Resampling a decoded window to the output size, fast mode (fusionflow/ops/decode.py decodes; this
chooses the filter per scale ratio, by measurement: experiments/bench_ops.py's resize section)."""

from __future__ import annotations

import math

import cv2
import numpy as np
import torch
from PIL import Image

# Largest window / output ratio resized with OpenCV's bilinear alone. Enlarging, it is Pillow's
# filter (within a level: 55 dB); shrinking by up to 1.25x it aliases little (>= 41 dB on a
# 1/f-spectrum image). Beyond, a Gaussian pre-blur of sigma = PRE_BLUR * sqrt(s^2 - 1) per axis
# (s: that axis's ratio) takes the aliasing out first: 48-52 dB against Pillow's antialiased filter,
# at about half the time of torch's antialiased resize (experiments/README.md, "Arrays").
LINEAR_UP_TO = 1.25
PRE_BLUR = 0.5


def resize_window(arr: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """A full-scale window (under 2x the output) to (out_h, out_w), HWC uint8: OpenCV's bilinear,
    after a Gaussian pre-blur along each axis shrunk by more than LINEAR_UP_TO."""
    h, w = arr.shape[:2]
    if (h, w) == (out_h, out_w):
        return arr
    if h > out_h * LINEAR_UP_TO or w > out_w * LINEAR_UP_TO:
        arr = pre_blur(arr, out_h, out_w)
    return cv2.resize(arr, (out_w, out_h), interpolation=cv2.INTER_LINEAR)


def resize_window_cubic(arr: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """A full-scale window (under 2x the output) to (out_h, out_w) with a bicubic filter, HWC uint8.
    Shrinking along both axes: the same pre-blur as `resize_window`, then OpenCV's cubic (a = -0.75 where
    Pillow's is -0.5; the blur dominates the difference): 49-52 dB from Pillow's antialiased bicubic at
    about half the time of torch's. Enlarging along an axis, where the kernels' difference shows:
    torch's antialiased bicubic (Pillow's to ~70 dB)."""
    h, w = arr.shape[:2]
    if h < out_h or w < out_w:
        return resize_antialiased_array(arr, out_h, out_w, "bicubic")
    return cv2.resize(pre_blur(arr, out_h, out_w), (out_w, out_h), interpolation=cv2.INTER_CUBIC)


def pre_blur(arr: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """The Gaussian that takes the aliasing out of a bilinear shrink of `arr` to (out_h, out_w):
    sigma = PRE_BLUR * sqrt(s^2 - 1) along each axis shrunk by s, none along the others."""
    return _blur_for(arr, arr.shape[0] / out_h, arr.shape[1] / out_w)


def _blur_for(arr: np.ndarray, ratio_y: float, ratio_x: float) -> np.ndarray:
    sy, sx = _pre_blur_sigma(ratio_y), _pre_blur_sigma(ratio_x)
    if not (sx or sy):
        return arr
    ky, kx = _taps(sy), _taps(sx)
    return cv2.GaussianBlur(arr, (kx, ky), sigmaX=sx or 1.0, sigmaY=sy or 1.0)  # a size-1 kernel ignores its sigma


def _taps(sigma: float) -> int:
    """Three taps below sigma 0.9 (every window under 2x the output: sigma < 0.87): there the taps at
    +-1 px hold most of the weight, and the PSNR against Pillow is that of +-3 sigma (5-7 taps) or a
    little better, with fewer taps (experiments/README.md, "Arrays"); +-3 sigma beyond; 1 at 0."""
    if not sigma:
        return 1
    return 3 if sigma < 0.9 else 2 * math.ceil(3 * sigma) + 1


def _pre_blur_sigma(ratio: float) -> float:
    return PRE_BLUR * math.sqrt(ratio * ratio - 1.0) if ratio > 1.0 else 0.0


def resample_box(arr: np.ndarray, box, out_h: int, out_w: int) -> np.ndarray:
    """A DCT-scaled window (its box 1-2x the output) resampled from its exact fractional `box` (x0,
    y0, x1, y1) to (out_h, out_w), the geometry of Pillow's resize(box=...): the same pre-blur as
    `resize_window` beyond LINEAR_UP_TO, then OpenCV's bilinear warp of the box onto the output
    (pixels outside the box, the decoder's margin, feed the filter as in Pillow; the image's own
    edges replicate). 3x faster than Pillow's box resize with its conversions, 52 dB from it."""
    x0, y0, x1, y1 = box
    sx, sy = (x1 - x0) / out_w, (y1 - y0) / out_h
    if sx > LINEAR_UP_TO or sy > LINEAR_UP_TO:
        arr = _blur_for(arr, sy, sx)
    # output pixel centre i -> input x0 + (i + 0.5) * sx in Pillow's frame, minus 0.5 in OpenCV's
    m = np.array([[sx, 0.0, x0 + 0.5 * sx - 0.5], [0.0, sy, y0 + 0.5 * sy - 0.5]])
    return cv2.warpAffine(
        arr, m, (out_w, out_h), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE
    )


def resize_antialiased(arr: np.ndarray, out_h: int, out_w: int, mode: str = "bilinear") -> Image.Image:
    """`resize_antialiased_array` as an RGB image."""
    return Image.fromarray(resize_antialiased_array(arr, out_h, out_w, mode))


def resize_antialiased_array(arr: np.ndarray, out_h: int, out_w: int, mode: str = "bilinear") -> np.ndarray:
    """uint8 HWC -> uint8 HWC of (out_h, out_w): antialiased bilinear (or `mode` "bicubic": Pillow's
    antialiased bicubic to ~70 dB, at a quarter of Pillow's time) with torch's vectorised uint8 kernel
    (channels-last input, no float copy); its planar output is interleaved by OpenCV's merge, several
    times faster than a strided numpy transpose or Pillow's merge."""
    if arr.shape[:2] == (out_h, out_w):
        return arr
    x = torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0)  # a channels-last view, no copy
    y = torch.nn.functional.interpolate(x, size=(out_h, out_w), mode=mode, antialias=True, align_corners=False)
    planes = y[0].contiguous().numpy()
    return cv2.merge([planes[0], planes[1], planes[2]])
