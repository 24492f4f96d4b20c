"""CPU implementations of every registered op, on Pillow images (mode RGB).

Each takes (image, value, params, style) -- `value` in the op's unit, `params` from the op's
`resolve` in `fusionflow.policy.op_specs`, `style` the policy's interpolation and fill -- and returns a
new image. Semantics equal torchvision.transforms.v2's functional op of the same name on a PIL
image (checked op by op in tests/test_ops_exact.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

from fusionflow.policy.op_specs import registrar

CpuOp = Callable[[Image.Image, float, tuple, "Style"], Image.Image]
CPU_IMPLS: dict[str, CpuOp] = {}

RESAMPLE = {  # the policies' interpolation names -> Pillow's filters (crop and ops)
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}


@dataclass(frozen=True)
class Style:
    interpolation: str = "nearest"
    fill: tuple[int, int, int] = (0, 0, 0)

    @property
    def resample(self):
        return RESAMPLE[self.interpolation]


cpu_impl = registrar(CPU_IMPLS, "cpu_impl")
IDENTITY = np.arange(256, dtype=np.int64)


def _point(img: Image.Image, lut: list) -> Image.Image:
    """img.point(lut) for an 8-bit image and a table of ints, without Image.point's per-entry
    Python round() (a third of its cost at 224x224); the public call where the core method differs."""
    try:
        return img._new(img.im.point(lut, None))
    except (AttributeError, TypeError):
        return img.point(lut)


@cpu_impl("Identity")
def identity(img, value, params, style):
    return img


@cpu_impl("ShearX", "ShearY", "TranslateX", "TranslateY", "ShiftX", "ShiftY", "SkewX", "SkewY")
def affine(img, value, params, style):
    return img.transform(img.size, Image.Transform.AFFINE, params[:6], style.resample, fillcolor=style.fill)


@cpu_impl("FlipX")
def flip_x(img, value, params, style):
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


@cpu_impl("Rotate")
def rotate(img, value, params, style):
    # Pillow's own rotate (not the shared matrix): it turns exact multiples of 90 degrees into
    # lossless transposes, as torchvision does on PIL images.
    return img.rotate(value, style.resample, fillcolor=style.fill)


_LEVELS = np.arange(256, dtype=np.float32)


def blend_lut(degenerate: int, factor: float) -> np.ndarray:
    """Image.blend(constant image of `degenerate`, image, factor) as a 256-entry uint8 table: per
    entry in1 + alpha * (in2 - in1) in float32 (Pillow's alpha is a C float), truncated, and clipped
    to 0..255 when the factor extrapolates, as Pillow's ImagingBlend computes each byte."""
    alpha = np.float32(factor)
    out = np.float32(degenerate) + alpha * (_LEVELS - np.float32(degenerate))
    return np.clip(out, 0, 255).astype(np.uint8)  # truncation toward zero of values in 0..255


@cpu_impl("Brightness")
def brightness(img, value, params, style):
    """ImageEnhance.Brightness(img).enhance(f), a blend with black: one table (bit for bit)."""
    return _point(img, blend_lut(0, params[0]).tolist() * 3)


@cpu_impl("Color")
def color(img, value, params, style):
    return ImageEnhance.Color(img).enhance(params[0])


@cpu_impl("Contrast")
def contrast(img, value, params, style):
    """ImageEnhance.Contrast(img).enhance(f): blend with the grey level of the image's mean luma
    (rounded half up); the mean as ImageStat computes it -- integer sum over the L histogram divided
    by the pixel count -- with numpy instead of its 256-step Python loop."""
    h = np.asarray(img.convert("L").histogram(), dtype=np.int64)
    mean = int(int(h @ IDENTITY) / int(h.sum()) + 0.5)
    return _point(img, blend_lut(mean, params[0]).tolist() * 3)  # a blend with a constant: a table


@cpu_impl("Hue")
def hue(img, value, params, style):
    """torchvision's adjust_hue on a PIL image: Pillow's 8-bit HSV, the hue band plus int(255 v)
    wrapped as a uint8 add wraps, back to RGB. Pillow's HSV round trip alone moves pixels by a few
    levels, so even v = 0 takes it (as torchvision does)."""
    h, s, v = img.convert("HSV").split()
    shift = int(params[0] * 255) & 0xFF  # truncated toward zero, as np.int32(); & 0xFF: astype(uint8)
    if shift:
        h = _point(h, [(i + shift) & 0xFF for i in range(256)])
    return Image.merge("HSV", (h, s, v)).convert("RGB")


# Pillow's SMOOTH kernel (1 1 1 / 1 5 1 / 1 1 1) / 13, each weight a float32 divided by 13 as Pillow does
_SMOOTH_SIDE = np.float32(1) / np.float32(13)
_SMOOTH_CENTRE = np.float32(5) / np.float32(13)


def smooth(img: Image.Image) -> Image.Image:
    """img.filter(ImageFilter.SMOOTH), bit for bit, vectorised: Pillow's 3x3 filter runs one pixel at a
    time (about 1 ms at 224x224). Same float32 arithmetic in the same order -- the rounding offset
    0.5, then the rows below, at and above the pixel, each summed left to right -- truncated and
    clamped to 0..255; the one-pixel border is copied unfiltered. A product pixel*weight is the same
    float wherever it is used, so each is computed once."""
    src = np.asarray(img)
    if src.shape[0] < 3 or src.shape[1] < 3:
        return img.copy()
    a = src.astype(np.float32)
    side = a * _SMOOTH_SIDE
    centre = a[1:-1] * _SMOOTH_CENTRE
    rows = side[:, :-2] + side[:, 1:-1]  # (left + centre) + right, for the rows weighted 1 1 1
    rows += side[:, 2:]
    mid = side[1:-1, :-2] + centre[:, 1:-1]  # the pixel's own row, weighted 1 5 1
    mid += side[1:-1, 2:]
    ss = np.float32(0.5) + rows[2:]
    ss += mid
    ss += rows[:-2]
    np.clip(ss, 0.0, 255.0, out=ss)
    out = src.copy()
    out[1:-1, 1:-1] = ss  # float -> uint8 assignment truncates, as Pillow's (UINT8) cast
    return Image.fromarray(out, img.mode)


@cpu_impl("Sharpness")
def sharpness(img, value, params, style):
    # ImageEnhance.Sharpness(img).enhance(f) is blend(img.filter(SMOOTH), img, f)
    return Image.blend(smooth(img), img, params[0])


# The point ops below build the same 256-entry tables as Pillow's ImageOps (torchvision's PIL
# path), so they stay bit-identical; fixed tables are cached per parameter and histogram-driven ones
# are computed with numpy instead of Pillow's per-entry Python loops.
@functools.lru_cache(maxsize=1024)
def rgb_lut(kind: str, param: float) -> list:
    i = IDENTITY
    if kind == "posterize":  # a LUT rather than ImageOps.posterize, which refuses 0 bits
        lut = i & int(param)
    elif kind == "solarize":
        lut = np.where(i < param, i, 255 - i)
    elif kind == "solarize_add":
        lut = np.where(i < 128, np.minimum(255, (i + param).astype(np.int64)), i)
    elif kind == "invert":
        lut = 255 - i
    else:
        raise KeyError(kind)
    return lut.tolist() * 3


def _band_histograms(img: Image.Image) -> np.ndarray:
    return np.asarray(img.histogram(), dtype=np.int64).reshape(-1, 256)


@cpu_impl("Posterize")
def posterize(img, value, params, style):
    return _point(img, rgb_lut("posterize", int(params[1])))


@cpu_impl("Solarize")
def solarize(img, value, params, style):
    return _point(img, rgb_lut("solarize", float(params[0])))


@cpu_impl("SolarizeAdd")
def solarize_add(img, value, params, style):
    return _point(img, rgb_lut("solarize_add", float(params[0])))


def autocontrast_lut(hists) -> list:
    """ImageOps.autocontrast's table: per band, stretch [lowest, highest] present value to 0..255."""
    lut = []
    for h in hists:
        present = np.flatnonzero(h)
        lo, hi = (int(present[0]), int(present[-1])) if present.size else (255, 0)
        if hi <= lo:
            lut.extend(range(256))
            continue
        scale = 255.0 / (hi - lo)
        offset = -lo * scale
        lut.extend(np.clip(np.trunc(IDENTITY * scale + offset), 0, 255).astype(np.int64).tolist())
    return lut


def equalize_lut(hists) -> list:
    """ImageOps.equalize's table: per band, the cumulative histogram in steps of (pixels minus the
    last present value's count) // 255, rounded by half a step."""
    lut = []
    for h in hists:
        present = h[h > 0]
        step = int(present.sum() - present[-1]) // 255 if present.size > 1 else 0
        if not step:
            lut.extend(range(256))
            continue
        before = np.concatenate(([0], np.cumsum(h)[:-1]))  # pixels below each value
        lut.extend(((step // 2 + before) // step).tolist())
    return lut


@cpu_impl("AutoContrast")
def autocontrast(img, value, params, style):
    return _point(img, autocontrast_lut(_band_histograms(img)))


@cpu_impl("Equalize")
def equalize(img, value, params, style):
    return _point(img, equalize_lut(_band_histograms(img)))


@cpu_impl("Invert")
def invert(img, value, params, style):
    return _point(img, rgb_lut("invert", 0.0))


@cpu_impl("GaussianBlur")
def gaussian_blur_op(img, value, params, style):
    """Pillow's GaussianBlur (timm's GaussianBlur / GaussianBlurRand ops, 3a): radius `value`."""
    return img.filter(ImageFilter.GaussianBlur(radius=float(value))) if value > 0 else img


@cpu_impl("Cutout")
def cutout(img, value, params, style):
    top, left, h, w = (int(v) for v in params[:4])
    if h <= 0 or w <= 0:
        return img
    out = img.copy()
    out.paste(style.fill, (left, top, left + w, top + h))
    return out


def apply(name: str, img: Image.Image, value: float, params: tuple, style: Style) -> Image.Image:
    return CPU_IMPLS[name](img, value, params, style)


def gaussian_blur(img: Image.Image, kernel_size, sigma: float) -> Image.Image:
    """torchvision's GaussianBlur on the image: its own functional kernel (separable float convolution,
    reflected borders, rounded back to uint8), so the exact mode's pixels are torchvision's."""
    import torchvision.transforms.v2.functional as F

    return F.gaussian_blur(img, list(kernel_size), [sigma, sigma])
