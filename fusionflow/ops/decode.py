"""Encoded sample -> RGB Pillow image, cropped and resized in as few passes as possible.

Accepts JPEG/PNG/any Pillow-readable bytes, a PIL image, or a uint8 HW / HWC numpy array.
Grayscale, palette, RGBA/LA (alpha dropped) and 16-bit inputs come out as 8-bit RGB.

Fast path (policy `decode.fast_downscale`): when the crop is at least 2x the output size in both
directions, a JPEG is decoded with libjpeg-turbo's DCT scaling at 1/2, 1/4 or 1/8 of its size
(never below the output resolution), and the crop box is mapped into the reduced image. Fidelity
against the exact path is measured by experiments/bench_cpu_pipeline.py (PSNR).
"""
from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError

from fusionflow.errors import DecodeError

Image.MAX_IMAGE_PIXELS = None  # datasets hold large images on purpose; decoding is our job


def open_image(data, what: str | None = None) -> Image.Image:
    """A (lazily decoded) PIL image from bytes, a PIL image or a uint8 numpy array."""
    if isinstance(data, Image.Image):
        return data
    if isinstance(data, np.ndarray):
        return _from_array(data, what)
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            head = bytes(data[:8]).hex()
            raise DecodeError(f"cannot identify an image in {len(data)} bytes (first bytes {head}): {exc}",
                              what) from exc
    raise TypeError(f"{what or 'sample'}: expected encoded bytes, a PIL image or a uint8 array, "
                    f"got {type(data).__name__}")


def _from_array(arr: np.ndarray, what) -> Image.Image:
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
        raise TypeError(f"{what or 'sample'}: an array sample must be uint8 HW or HWC with 1, 3 or 4 "
                        f"channels, got {arr.dtype} {arr.shape}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(arr))


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img)
        arr = (arr >> 8) if img.mode.startswith("I;16") else np.clip(arr, 0, 255)
        return Image.fromarray(arr.astype(np.uint8)).convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return img.convert("RGB")


def dct_reduction(crop_h: int, crop_w: int, out_h: int, out_w: int) -> int:
    """Largest of 1, 2, 4, 8 by which the crop can shrink and still cover the output size."""
    r = 8
    while r > 1 and (crop_w < out_w * r or crop_h < out_h * r):
        r //= 2
    return r


def decode_crop_resize(data, window_fn, out_size: tuple[int, int], fast: bool,
                       what: str | None = None) -> Image.Image:
    """Decode `data`, crop the window `window_fn(height, width)` returns, resize to `out_size`
    (height, width) with antialiased bilinear filtering. Returns an RGB image."""
    img = open_image(data, what)
    width, height = img.size
    top, left, h, w = window_fn(height, width)
    out_h, out_w = out_size
    box = (left, top, left + w, top + h)
    try:
        if fast and img.format == "JPEG":
            r = dct_reduction(h, w, out_h, out_w)
            if r > 1:
                img.draft("RGB" if img.mode == "RGB" else None, (math.ceil(width / r), math.ceil(height / r)))
                sx, sy = img.size[0] / width, img.size[1] / height
                box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        img.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"cannot decode {img.format or 'image'} {width}x{height}: {exc}", what) from exc
    img = to_rgb(img)
    if isinstance(box[0], float):  # reduced image: resample straight from the fractional box
        return img.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    # crop first so border pixels never read outside the window (torchvision's resized_crop)
    return img.crop(box).resize((out_w, out_h), Image.Resampling.BILINEAR, reducing_gap=None)
