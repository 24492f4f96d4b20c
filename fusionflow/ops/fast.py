"""Every op on uint8 HWC RGB arrays (C-contiguous): the CPU pipeline's working form. Windows come
out of the decoder as arrays and the ring wants planes, so the pipeline stays in arrays from the
resize to the write and wraps an array as a Pillow image only for an op whose kernel is Pillow's.

Each op has two kernels: FAST is what the fast mode runs; EXACT proves the shared tables exact:

  exact  bit-identical to `fusionflow.ops.exact` (Pillow, which is torchvision's PIL path). The point
         ops are 256-entry tables applied with OpenCV's LUT: Posterize, Solarize, SolarizeAdd,
         Invert, AutoContrast and Equalize build Pillow's own tables, and Brightness and Contrast
         are blends with a constant image, so a table too, with Pillow's float32 arithmetic and
         truncation reproduced per entry. The geometric ops, Color and Sharpness run Pillow's code.
  fast   the fastest kernel measured per op at 224x224 (experiments/bench_ops.py, the table in
         experiments/README.md): native kernels (fusionflow/kernels/pixel_ops.cc, Pillow's own
         pixels) for the nearest warps, Equalize and AutoContrast; cvtColor+addWeighted for Color,
         a box blur + addWeighted for Sharpness; OpenCV's warpAffine for bilinear and bicubic warps
         (or where the native kernels cannot be built); the exact kernel where it is already the fastest.
         These differ from exact by rounding (a blend rounds where Pillow truncates) and, for
         OpenCV's warps, by pixels whose source lies on a sampling boundary; tests/test_ops_fast.py
         bounds each against the exact kernel.

A kernel takes (arr, value, params, style) as the Pillow ops do and returns a new array or `arr`
itself (never modified in place: a decoder's buffer may be shared).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import cv2
import numpy as np
from PIL import Image

from fusionflow.ops import exact, pixel_kernels

ArrayOp = Callable[[np.ndarray, float, tuple, exact.Style], np.ndarray]
EXACT: dict[str, ArrayOp] = {}
FAST: dict[str, ArrayOp] = {}

_CV_INTER = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC}


def _register(table: dict, *names: str):
    def put(fn):
        for name in names:
            table[name] = fn
        return fn

    return put


def via_pillow(name: str) -> ArrayOp:
    """The Pillow op of `fusionflow.ops.exact` on an array: exact by construction."""
    op = exact.CPU_IMPLS[name]

    def run(arr, value, params, style):
        return np.asarray(op(Image.fromarray(arr), value, params, style))

    run.__name__ = f"pillow_{name}"
    return run


for _name in (
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "ShiftX",
    "ShiftY",
    "SkewX",
    "SkewY",
    "Rotate",
    "Color",
    "Sharpness",
    "Hue",
    "GaussianBlur",
):
    EXACT[_name] = via_pillow(_name)
FAST["GaussianBlur"] = EXACT["GaussianBlur"]  # Pillow's box-approximated blur is its own: kept exact


@_register(EXACT, "Identity")
@_register(FAST, "Identity")
def identity(arr, value, params, style):
    return arr


# ---- point ops: a table per channel, applied by OpenCV's LUT ----------------------------------------


def apply_lut(arr: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """`lut`: 256 uint8 entries for every channel, or (256, 3) one column per channel."""
    if lut.ndim == 2:
        lut = lut.reshape(256, 1, 3)
    return cv2.LUT(arr, lut)


@functools.lru_cache(maxsize=1024)
def _fixed_lut(kind: str, param: float) -> np.ndarray:
    return np.asarray(exact.rgb_lut(kind, param)[:256], np.uint8)


@_register(FAST, "Posterize")
def posterize_fast(arr, value, params, style):
    """The kept bits' mask, AND-ed (SIMD): the same pixels as the table."""
    m = int(params[1])
    return cv2.bitwise_and(arr, np.full_like(arr, m)) if m != 255 else arr


@_register(FAST, "Solarize")
def solarize_fast(arr, value, params, style):
    """v >= threshold -> 255 - v as v XOR (v >= threshold ? 255 : 0) (two SIMD passes): the same
    pixels as the table."""
    thr = math.ceil(float(params[0]))  # integer pixels: v >= t  <=>  v >= ceil(t)
    if thr > 255:
        return arr
    flat = arr.reshape(arr.shape[0], -1)
    return cv2.bitwise_xor(flat, cv2.compare(flat, thr, cv2.CMP_GE)).reshape(arr.shape)


@_register(EXACT, "Posterize")
def posterize(arr, value, params, style):
    return apply_lut(arr, _fixed_lut("posterize", int(params[1])))


@_register(EXACT, "Solarize")
def solarize(arr, value, params, style):
    return apply_lut(arr, _fixed_lut("solarize", float(params[0])))


@_register(EXACT, "SolarizeAdd")
@_register(FAST, "SolarizeAdd")
def solarize_add(arr, value, params, style):
    return apply_lut(arr, _fixed_lut("solarize_add", float(params[0])))


@_register(EXACT, "Invert")
@_register(FAST, "Invert")
def invert(arr, value, params, style):
    return cv2.bitwise_not(arr)


def histograms(arr: np.ndarray) -> np.ndarray:
    """(3, 256) int64: each channel's histogram (Pillow's img.histogram(), reshaped)."""
    return np.stack([cv2.calcHist([arr], [c], None, [256], [0, 256]).ravel() for c in range(arr.shape[2])]).astype(
        np.int64
    )


def _table(lut: list) -> np.ndarray:
    """Pillow's per-band table (3 x 256 ints, possibly 256 at the top of Equalize's) as (256, 3)
    uint8, clipped as Image.point clips its entries."""
    return np.clip(np.asarray(lut, np.int64), 0, 255).astype(np.uint8).reshape(3, 256).T


@_register(FAST, "AutoContrast")
def autocontrast_fast(arr, value, params, style):
    """Pillow's tables (the lowest and highest present value are each plane's minimum and maximum):
    the same pixels. The native kernel's one min/max pass and one lookup pass; else per plane."""
    out = pixel_kernels.autocontrast(arr)
    if out is not None:
        return out
    planes = cv2.split(arr)
    out = []
    for plane in planes:
        lo, hi = (int(v) for v in cv2.minMaxLoc(plane)[:2])
        if hi <= lo:
            out.append(plane)
            continue
        scale = 255.0 / (hi - lo)
        lut = np.clip(np.trunc(exact.IDENTITY * scale + (-lo * scale)), 0, 255).astype(np.uint8)
        out.append(cv2.LUT(plane, lut))
    return cv2.merge(out)


@_register(FAST, "Equalize")
def equalize_fast(arr, value, params, style):
    """Pillow's tables: the same pixels. The native kernel's histogram and lookup passes; else each
    plane through its own (one-channel lookups beat a three-channel one)."""
    out = pixel_kernels.equalize(arr)
    if out is not None:
        return out
    planes = cv2.split(arr)
    hists = [cv2.calcHist([p], [0], None, [256], [0, 256]).ravel().astype(np.int64) for p in planes]
    lut = _table(exact.equalize_lut(hists))
    return cv2.merge([cv2.LUT(p, np.ascontiguousarray(lut[:, c])) for c, p in enumerate(planes)])


@_register(EXACT, "AutoContrast")
def autocontrast(arr, value, params, style):
    return apply_lut(arr, _table(exact.autocontrast_lut(histograms(arr))))


@_register(EXACT, "Equalize")
def equalize(arr, value, params, style):
    return apply_lut(arr, _table(exact.equalize_lut(histograms(arr))))


blend_lut = exact.blend_lut


def luma(arr: np.ndarray) -> np.ndarray:
    """Pillow's RGB -> L: (19595 R + 38470 G + 7471 B + 0x8000) >> 16, as uint8 HW."""
    a = arr.astype(np.uint32)
    return ((a[..., 0] * 19595 + a[..., 1] * 38470 + a[..., 2] * 7471 + 0x8000) >> 16).astype(np.uint8)


@_register(FAST, "Brightness")
def brightness_fast(arr, value, params, style):
    """f * v, rounded and saturated (SIMD; Pillow truncates: within one level)."""
    return cv2.convertScaleAbs(arr, alpha=max(0.0, float(params[0])))


@_register(EXACT, "Brightness")
def brightness(arr, value, params, style):
    return apply_lut(arr, blend_lut(0, params[0]))


def mean_luma_exact(arr: np.ndarray) -> int:
    """ImageStat's mean of the L image, rounded half up (exact.contrast): the integer sum over L's
    histogram divided by the pixel count."""
    h = np.bincount(luma(arr).ravel(), minlength=256)
    return int(int(h @ exact.IDENTITY) / int(h.sum()) + 0.5)


@_register(EXACT, "Contrast")
def contrast(arr, value, params, style):
    return apply_lut(arr, blend_lut(mean_luma_exact(arr), params[0]))


@_register(FAST, "Contrast")
def contrast_fast(arr, value, params, style):
    """The mean luma from OpenCV's grey conversion (its coefficients round differently from
    Pillow's: the mean can differ by one level)."""
    mean = int(cv2.mean(cv2.cvtColor(arr, cv2.COLOR_RGB2GRAY))[0] + 0.5)
    f = float(params[0])
    return cv2.addWeighted(arr, f, arr, 0.0, (1.0 - f) * mean)


@_register(EXACT, "Cutout")
@_register(FAST, "Cutout")
def cutout(arr, value, params, style):
    top, left, h, w = (int(v) for v in params[:4])
    if h <= 0 or w <= 0:
        return arr
    out = arr.copy()
    out[top : top + h, left : left + w] = style.fill
    return out


# ---- fast kernels (OpenCV) ----------------------------------------------------------------------------


def _cv_matrix(params) -> np.ndarray:
    """Pillow's output -> input affine matrix (pixel centres at +0.5) in OpenCV's convention (centres
    at integers), for warpAffine with WARP_INVERSE_MAP."""
    a, b, c, d, e, f = params[:6]
    return np.array([[a, b, c + 0.5 * (a + b) - 0.5], [d, e, f + 0.5 * (d + e) - 0.5]], np.float64)


@_register(FAST, "TranslateX", "TranslateY")
def translate(arr, value, params, style):
    """A whole-pixel shift (the op's offset is an int, so nearest and bilinear sampling both copy
    pixels), the uncovered band filled: the same pixels as Pillow's transform."""
    dx, dy = -round(params[2]), -round(params[5])  # the matrix maps output to input: x_in = x - dx
    h, w = arr.shape[:2]
    if abs(dx) >= w or abs(dy) >= h:
        return np.full_like(arr, np.asarray(style.fill, np.uint8))
    src = arr[max(0, -dy) : h + min(0, -dy), max(0, -dx) : w + min(0, -dx)]
    fill = tuple(int(v) for v in style.fill)
    return cv2.copyMakeBorder(src, max(0, dy), max(0, -dy), max(0, dx), max(0, -dx), cv2.BORDER_CONSTANT, value=fill)


@_register(FAST, "ShearX", "ShearY", "ShiftX", "ShiftY", "SkewX", "SkewY")
def warp(arr, value, params, style):
    """Nearest: the native kernel walks Pillow's fixed-point coordinates; without it (a host that could not
    compile it), Pillow's own transform: the same pixels either way, as a sample's pixels must not depend
    on the host. Bilinear: OpenCV's warpAffine (boundary pixels may differ from Pillow's). Bicubic: OpenCV's
    cubic warp (its kernel's a = -0.75 against Pillow's -0.5: >= 35 dB from Pillow's, tests/
    test_interpolation.py) at 2.6x Pillow's speed (1.2 vs 3.2 ms at 224x224)."""
    if style.interpolation == "nearest":
        out = pixel_kernels.affine_nearest(arr, params, style.fill)
        if out is not None:
            return out
        if arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3:
            return np.asarray(exact.affine(Image.fromarray(arr), value, params, style))  # the kernel's reference
    h, w = arr.shape[:2]
    return cv2.warpAffine(
        arr,
        _cv_matrix(params),
        (w, h),
        flags=_CV_INTER[style.interpolation] | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=tuple(int(v) for v in style.fill),
    )


@_register(FAST, "Rotate")
def rotate(arr, value, params, style):
    return warp(arr, value, params, style)


# Beyond this enhancement factor (value 1) the fast Color and Sharpness run Pillow's kernel: their degenerate
# image rounds to a level where Pillow's does not, and the blend multiplies that by |1 - factor| (at factor 11,
# a policy's largest, up to 10 levels off). Up to 2 they stay within two levels (tests/test_ops_fast.py).
FAST_FACTOR_MAX = 2.0


@_register(FAST, "Color")
def color_fast(arr, value, params, style):
    f = float(params[0])
    if not 0.0 <= f <= FAST_FACTOR_MAX:
        return EXACT["Color"](arr, value, params, style)
    grey = cv2.cvtColor(cv2.cvtColor(arr, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
    return cv2.addWeighted(arr, f, grey, 1.0 - f, 0.0)


@_register(FAST, "Hue")
def hue_fast(arr, value, params, style):
    """The hue turned in float (OpenCV's HSV in degrees), by Pillow's steps as the exact op: int(255 v)
    of 255 per turn, added with its uint8 wrap-around (past 255 the shift drops by 256 steps). No 8-bit
    HSV round trip (which alone moves Pillow's pixels by up to 5 levels): within 8 levels of
    exact, a fraction of a level on average (tests/test_ops_fast.py)."""
    shift = int(params[0] * 255) & 0xFF
    hsv = cv2.cvtColor(arr.astype(np.float32) * np.float32(1 / 255), cv2.COLOR_RGB2HSV)
    steps = hsv[..., 0] * np.float32(255 / 360) + np.float32(shift)
    steps[steps >= 256] -= 256  # the uint8 add's wrap-around, in Pillow's steps
    hsv[..., 0] = np.fmod(steps * np.float32(360 / 255), np.float32(360))
    rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
    return cv2.convertScaleAbs(rgb, alpha=255.0)  # rounded and saturated to uint8


@_register(FAST, "Sharpness")
def sharpness_fast(arr, value, params, style):
    """blend(smooth, image, f) with Pillow's SMOOTH kernel (1 1 1 / 1 5 1 / 1 1 1) / 13, which is
    (9 * box3x3 + 4 * centre) / 13: one SIMD box blur and one weighted sum (the box mean rounds to a
    level, so within two of Pillow up to FAST_FACTOR_MAX; Pillow's kernel beyond). The one-pixel border
    stays unfiltered as in Pillow."""
    if arr.shape[0] < 3 or arr.shape[1] < 3:
        return arr
    f = float(params[0])
    if not 0.0 <= f <= FAST_FACTOR_MAX:
        return EXACT["Sharpness"](arr, value, params, style)
    box = cv2.blur(arr, (3, 3), borderType=cv2.BORDER_REPLICATE)
    out = cv2.addWeighted(arr, f + (1.0 - f) * 4.0 / 13.0, box, (1.0 - f) * 9.0 / 13.0, 0.0)
    out[0], out[-1], out[:, 0], out[:, -1] = arr[0], arr[-1], arr[:, 0], arr[:, -1]
    return out


def grayscale(arr: np.ndarray) -> np.ndarray:
    """RandomGrayscale's output: Pillow's luma (its own RGB -> L, exact) in all three channels."""
    return cv2.cvtColor(np.asarray(Image.fromarray(arr).convert("L")), cv2.COLOR_GRAY2RGB)


def gaussian_blur(arr: np.ndarray, kernel_size: tuple[int, int], sigma: float) -> np.ndarray:
    """torchvision's GaussianBlur (its kernel, reflected borders) by OpenCV's fixed-point filter: within
    a level of torchvision's rounding (tests/test_from_torchvision.py)."""
    return cv2.GaussianBlur(arr, tuple(kernel_size), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT_101)


def flip(arr: np.ndarray, vertical: bool = False) -> np.ndarray:
    return cv2.flip(arr, 0 if vertical else 1)


@_register(EXACT, "FlipX")
@_register(FAST, "FlipX")
def flip_x(arr, value, params, style):
    return flip(arr)


def split(arr: np.ndarray) -> list[np.ndarray]:
    """HWC -> three contiguous HW planes."""
    return list(cv2.split(arr))


def write_planes(arr: np.ndarray, out: np.ndarray) -> None:
    """HWC uint8 -> the CHW uint8 `out` (a ring slot): OpenCV's split de-interleaves into each plane."""
    cv2.split(arr, [out[0], out[1], out[2]])
