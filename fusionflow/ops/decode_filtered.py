"""Decodes with Pillow's other filters: the bicubic and nearest crops (`decode_crop_resize_filtered`, the fast
mode's bicubic crop `fast_bicubic_array`) and the box resizes of evaluation and timm's resize-then-crop
(`decode_box_resize`). The bilinear crops, the pixel limit and the window decoder's use: fusionflow/ops/decode.py.
In fast mode, as there, a JPEG's pixels do not depend on which decoder the host has."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from fusionflow.ops import jpeg
from fusionflow.ops.decode import (
    JPEG_FORMATS,
    checked_header,
    dct_reduction,
    fast_jpeg_array,
    load_rgb,
    open_image,
    pillow_scaled_region,
    window_decodable,
)
from fusionflow.ops.resample import resize_window_cubic


def decode_crop_resize_filtered(
    data,
    window_fn,
    out_size: tuple[int, int],
    resample,
    what: str | None = None,
    max_pixels: int | None = None,
    fast: bool = False,
) -> Image.Image:
    """decode_crop_resize with Pillow's bicubic or nearest: the full-scale window (a full decode's pixels)
    resized by Pillow, torchvision's PIL path (crop, then resize) to the bit. `fast` and bicubic: a JPEG
    window of 2x the output or more is decoded at the coarsest DCT scale covering the output and Pillow's
    bicubic resamples its fractional box, as the fast mode's bilinear crop does; a smaller one by
    `resize_window_cubic` (`fast_bicubic_array`; timm's 'random' interpolation sends half the samples here)."""
    out_h, out_w = out_size
    if fast and resample == Image.Resampling.BICUBIC:
        arr = fast_bicubic_array(data, window_fn, out_size, what, max_pixels)
        if arr is not None:
            return Image.fromarray(arr)
    if window_decodable(data):
        data = bytes(data)
        try:  # (the header too: one libjpeg-turbo cannot read is Pillow's to decode or report)
            height, width = checked_header(data, what, max_pixels)
            top, left, h, w = window_fn(height, width)
            arr, _ = jpeg.decode_window(data, top, left, h, w)
            if arr.shape[:2] == (h, w):
                return Image.fromarray(arr).resize((out_w, out_h), resample, reducing_gap=None)
        except jpeg.WindowDecodeError:
            pass  # CMYK, corrupt data, ...: Pillow decodes it or raises its usual error below
    img = load_rgb(open_image(data, what, max_pixels), what)
    top, left, h, w = window_fn(img.size[1], img.size[0])
    return img.crop((left, top, left + w, top + h)).resize((out_w, out_h), resample, reducing_gap=None)


def fast_bicubic_array(data, window_fn, out_size: tuple[int, int], what=None, max_pixels=None) -> np.ndarray | None:
    """The fast mode's bicubic crop of a JPEG as uint8 HWC (`fast_jpeg_array`: the same pixels on every host), or
    None (not a JPEG: the caller's full-scale path decodes it or reports it). Full scale: resample.py's cubic
    (OpenCV's after the pre-blur, or torch's antialiased one); DCT-scaled: Pillow's bicubic from the box."""
    return fast_jpeg_array(data, window_fn, out_size, (resize_window_cubic, _bicubic_box), what, max_pixels)


def _bicubic_box(arr: np.ndarray, box, out_h: int, out_w: int) -> np.ndarray:
    return np.asarray(Image.fromarray(arr).resize((out_w, out_h), Image.Resampling.BICUBIC, box=box, reducing_gap=None))


def decode_box_resize(
    data,
    plan_fn,
    fast: bool,
    what: str | None = None,
    max_pixels: int | None = None,
    resample=Image.Resampling.BILINEAR,
) -> tuple[Image.Image, tuple]:
    """(image, the plan): `plan_fn(height, width)` = ((x0, y0, x1, y1), (out_h, out_w), ...) for the
    source's size, the fractional box resampled to that size by Pillow's antialiased filter `resample` at the box's
    own scale: torchvision's Resize + CenterCrop (the eval policy) and timm's resize-then-crop without
    rounding the crop to whole source pixels. `fast`: a JPEG decodes only the box and the filter's support
    (`_support`; within a level or two: Pillow's coefficients follow the box's offset in what it resizes), and with
    bilinear a box of 2x the output or more is decoded at a DCT scale first; else the whole image (`_window`: a
    centre crop's box is most of it), so the coefficients are those of the reference's resize: its pixels (since
    session 40: up to 6 levels apart on small images). Where the window decoder cannot
    serve a JPEG, Pillow decodes the same pixels (`_pillow_box_resize`): a JPEG's result is the same on every host."""
    if window_decodable(data):
        data = bytes(data)
        try:  # (the header too: one libjpeg-turbo cannot read is Pillow's to decode or report)
            height, width = checked_header(data, what, max_pixels)
            plan = plan_fn(height, width)
            (x0, y0, x1, y1), out_size = plan[:2]
            r = dct_reduction(int(y1 - y0), int(x1 - x0), *out_size) if _scales(fast, resample) else 1
            if r > 1:
                arr, box = jpeg.decode_scaled_window(data, height, width, (y0, x0, y1 - y0, x1 - x0), r)
                return Image.fromarray(arr).resize(out_size[::-1], resample, box=box, reducing_gap=None), plan
            window = _window(plan[0], out_size, width, height, resample, fast)
            wx0, wy0, wx1, wy1 = window
            arr, _ = jpeg.decode_window(data, wy0, wx0, wy1 - wy0, wx1 - wx0)
            if arr.shape[:2] == (wy1 - wy0, wx1 - wx0):
                return _resize_in(arr, window, plan[0], out_size, resample), plan
        except jpeg.WindowDecodeError:
            pass  # nvImageCodec at a reduced scale, CMYK, corrupt data, ...: Pillow decodes it below
    img = open_image(data, what, max_pixels)
    plan = plan_fn(img.size[1], img.size[0])
    if img.format in JPEG_FORMATS:
        return _pillow_box_resize(img, plan, fast, resample, what), plan
    box, (out_h, out_w) = plan[:2]
    return load_rgb(img, what).resize((out_w, out_h), resample, box=box, reducing_gap=None), plan


def _scales(fast: bool, resample) -> bool:
    return fast and resample == Image.Resampling.BILINEAR  # others: Pillow's filter at full scale


def _window(box, out_size, width: int, height: int, resample, fast: bool) -> tuple[int, int, int, int]:
    """What to decode for `box`: its filter's support (`_support`), or in exact mode the whole image, so that a
    bilinear or bicubic filter's coefficients are those of a resize of the whole image (the reference's). Nearest
    keeps the support: its sampled pixel follows the box's float offset either way, and from the support it
    matched torchvision's Resize + CenterCrop (tests/test_interpolation.py)."""
    if fast or resample == Image.Resampling.NEAREST:
        return _support(box, out_size, width, height, resample)
    return 0, 0, width, height


def _support(box, out_size, width: int, height: int, resample) -> tuple[int, int, int, int]:
    """The whole pixels (x0, y0, x1, y1) Pillow's filter reads to resample `box` to `out_size`: support x
    max(1, scale) pixels either side of each centre, and a margin."""
    (x0, y0, x1, y1), (out_h, out_w) = box, out_size
    support = 2.0 if resample == Image.Resampling.BICUBIC else 1.0
    mx, my = (math.ceil(support * max(1.0, v / o)) + 2 for v, o in ((x1 - x0, out_w), (y1 - y0, out_h)))
    return (
        max(0, math.floor(x0) - mx),
        max(0, math.floor(y0) - my),
        min(width, math.ceil(x1) + mx),
        min(height, math.ceil(y1) + my),
    )


def _resize_in(arr: np.ndarray, window, box, out_size, resample) -> Image.Image:
    """Pillow's resize of `box` (image coordinates) from `arr`, the image's pixels in `window`."""
    wx0, wy0, (x0, y0, x1, y1) = window[0], window[1], box
    return Image.fromarray(arr).resize(
        out_size[::-1], resample, box=(x0 - wx0, y0 - wy0, x1 - wx0, y1 - wy0), reducing_gap=None
    )


def _pillow_box_resize(img: Image.Image, plan, fast: bool, resample, what) -> Image.Image:
    """decode_box_resize for a JPEG the window decoder cannot serve, from the pixels the window decoder would have
    decoded: at a DCT scale of 2 or more the same scaled region by Pillow's draft() (`pillow_scaled_region`), else
    the same support window of the full decode (Pillow's coefficients follow the box's offset in what it resizes)."""
    width, height = img.size
    (x0, y0, x1, y1), out_size = plan[:2]
    r = dct_reduction(int(y1 - y0), int(x1 - x0), *out_size) if _scales(fast, resample) else 1
    if r > 1:
        arr, box = pillow_scaled_region(img, (y0, x0, y1 - y0, x1 - x0), r, what)
        return Image.fromarray(arr).resize(out_size[::-1], resample, box=box, reducing_gap=None)
    window = _window(plan[0], out_size, width, height, resample, fast)
    full = np.asarray(load_rgb(img, what))
    return _resize_in(full[window[1] : window[3], window[0] : window[2]], window, plan[0], out_size, resample)
