"""The CPU pipeline's side of the decoded-image cache (fusionflow/cache/): a sample's image at the
cache's resolution -- read from the cache, or decoded now and written to it -- and its crop from there.

The cached image is the whole sample decoded (a JPEG at the coarsest DCT scale whose short side still
reaches `max_side`) and shrunk (the fast mode's `resize_window`) until its short side is at most `max_side`.
The draw is made on the source's size (kept with the entry), so crop, flip, ops and magnitudes are
those of the uncached pipeline; the crop window is mapped into the cached image (coordinates scaled
by cached / source size, the geometry of a DCT-scaled decode) and resampled from its fractional box:
bilinear by `resample_box` (the fast mode's kernel), bicubic / nearest and the eval policy's centre box
by Pillow. Only the resampling differs from the uncached fast mode; experiments/bench_cache.py
measures by how much, tests/test_cache.py bounds it.

The lookups and fills are fusionflow/cache/reader.py's (the pipeline gets its `CacheReader` as
`cache=`); this module holds the image work only, and `CacheRendering`: that work without a store, the `cache=`
of a process that cannot reach the node's cache (a Ray actor, a lent worker of another spec).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from fusionflow.ops import jpeg
from fusionflow.ops.decode import checked_header, load_rgb, open_image, window_decodable
from fusionflow.ops.resample import resample_box, resize_window

_PIL_FILTERS = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}


def cached_size(height: int, width: int, max_side: int) -> tuple[int, int]:
    """The cached image's (height, width): the short side at most `max_side`, the aspect kept."""
    short = min(height, width)
    if short <= max_side:
        return height, width
    s = max_side / short
    return max(1, round(height * s)), max(1, round(width * s))


def decode_reduced(data, max_side: int, what=None, max_pixels: int | None = None):
    """(uint8 HWC RGB image at the cache's resolution, (source height, source width))."""
    if window_decodable(data):
        data = bytes(data)
        try:  # a header libjpeg-turbo cannot read is Pillow's to decode or report, as the uncached path does
            height, width = checked_header(data, what, max_pixels)
            return _jpeg_reduced(data, height, width, max_side), (height, width)
        except jpeg.WindowDecodeError:
            pass  # CMYK, corrupt data, ...: Pillow decodes it or reports it below
    img = open_image(data, what, max_pixels)
    width, height = img.size
    if img.format == "JPEG":  # Pillow's DCT scaling, as its fast path does
        img.draft("RGB", _draft_size(height, width, max_side))
    arr = np.asarray(load_rgb(img, what, (width, height)))
    return _shrink(arr, *cached_size(height, width, max_side)), (height, width)


def _draft_size(height: int, width: int, max_side: int) -> tuple[int, int]:
    s = max_side / min(height, width)
    return math.ceil(width * s), math.ceil(height * s)


def _jpeg_reduced(data: bytes, height: int, width: int, max_side: int) -> np.ndarray:
    short, r = min(height, width), 1
    if jpeg.can_scale():
        while r < 8 and -(-short // (2 * r)) >= max_side:
            r *= 2
    arr, scaled = jpeg.decode_window(data, 0, 0, -(-height // r), -(-width // r), (1, r))
    if arr.shape[:2] != scaled:
        raise jpeg.WindowDecodeError(f"decoded {arr.shape[:2]} != {scaled}")
    return _shrink(arr, *cached_size(height, width, max_side))


def _shrink(arr: np.ndarray, h: int, w: int) -> np.ndarray:
    """The fast mode's own resampling (`resize_window`: OpenCV's bilinear after the measured
    anti-aliasing pre-blur), 4x faster than OpenCV's area filter at these ratios."""
    if arr.shape[:2] == (h, w):
        return np.ascontiguousarray(arr)
    return resize_window(arr, h, w)


def crop_cached(img: np.ndarray, source, box, out_size, resample: str = "bilinear") -> np.ndarray:
    """The source-coordinate box (x0, y0, x1, y1) of a cached image resampled to `out_size` (uint8 HWC)."""
    (src_h, src_w), (h, w) = source, img.shape[:2]
    sx, sy = w / src_w, h / src_h
    x0, y0, x1, y1 = box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy
    out_h, out_w = out_size
    # the pixels the filter reads around the box (its pre-blur's taps when shrinking), a view
    m = 3 + math.ceil(2 * max(1.0, (x1 - x0) / out_w, (y1 - y0) / out_h))
    a0, b0 = max(0, math.floor(x0) - m), max(0, math.floor(y0) - m)
    a1, b1 = min(w, math.ceil(x1) + m), min(h, math.ceil(y1) + m)
    sub, sub_box = img[b0:b1, a0:a1], (x0 - a0, y0 - b0, x1 - a0, y1 - b0)
    if resample == "bilinear":
        return resample_box(sub, sub_box, out_h, out_w)
    pil = Image.fromarray(np.ascontiguousarray(sub))
    return np.asarray(pil.resize((out_w, out_h), _PIL_FILTERS[resample], box=sub_box, reducing_gap=None))


class CacheRendering:
    """The cache's rendering without its store, for a process that cannot reach the node's cache (a Ray
    actor, on any node; a worker lent by a rank whose loader has another spec): each encoded sample is decoded
    at the cache's resolution and cropped from there, as a fill does, so its pixels are those the loader's own
    workers give a cached sample, wherever it runs (docs/cache.md, Repeatability). Nothing is kept or counted."""

    def __init__(self, max_side: int):
        self.max_side = max_side

    def source(self, data, index: int, what=None, max_pixels: int | None = None):
        """(image at the cache's resolution, (source h, w), False), or None: not encoded, or the sample's own
        fault (the uncached path reports it)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return None
        try:
            img, source = decode_reduced(data, self.max_side, what, max_pixels)
        except Exception:  # the sample's own fault, or another: the uncached path renders or reports it
            return None
        return img, source, False

    def kept_crop(self, index: int, d, data):
        return None

    def keep_crop(self, index: int, d, data, arr) -> None:
        pass

    def hit_time(self, ns: int) -> None:
        pass
