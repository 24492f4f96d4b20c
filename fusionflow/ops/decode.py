"""Encoded sample -> RGB Pillow image, cropped and resized in as few passes as possible.

Accepts JPEG/PNG/any Pillow-readable bytes, a PIL image, a uint8 HW / HWC numpy array, or a uint8
torch tensor. Grayscale, palette, RGBA/LA (alpha dropped) and 16-bit inputs come out as 8-bit RGB.

Decoded samples (arrays, tensors) and modes other than RGB: fusionflow/ops/decoded.py.

A complete JPEG (baseline or progressive, grayscale or YCbCr) goes through the window decoder
(`fusionflow.ops.jpeg`: our libjpeg-turbo kernel, else nvImageCodec's CPU backend): only the crop
window is decoded. Both modes draw the same window:
  exact  the window at full resolution, resized by Pillow: bit-identical to torchvision's
         decode + resized_crop on a PIL image;
  fast   the window at the coarsest DCT scale (1/2, 1/4, 1/8) that still covers the output, then
         OpenCV's kernels (fusionflow/ops/resample.py); fidelity: bench_cpu_pipeline.py, the tests.
Everything else (PNG, CMYK or corrupt JPEGs, arrays, PIL images, no window decoder) takes the Pillow
path; its errors name the sample. A JPEG there is decoded into the same pixels the window decoder gives
(fast mode: at the same DCT scale, Pillow's draft(), and the same region), so a sample's pixels do not
depend on which decoder the host has (`fast_jpeg_array`; Pillow's other filters: decode_filtered.py).

Pixel limit (decompression bombs): `max_pixels` (the policy's decode.max_pixels; None: no limit) is
checked against the size in the image's header before any pixel is decoded, on both paths: the
window decoder's `jpeg.info`, and the lazy `Image.open` (or a lazily opened PIL image a dataset
returns). Over it, `ImageTooLargeError` (a DecodeError) names the sample and its size. Pillow's
process-wide `Image.MAX_IMAGE_PIXELS` is left alone (importing FusionFlow changes nothing for the
user's own Pillow code); since the policy's limit governs here, Pillow's DecompressionBombWarning
is silenced while we open an image, and its DecompressionBombError -- raised only when the user
set Pillow's limit below 1/2 of the policy's -- is reported as the same ImageTooLargeError.
Decoded inputs (arrays, tensors) are not checked: their memory is already spent.
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from fusionflow.errors import DecodeError, ImageTooLargeError
from fusionflow.ops import jpeg
from fusionflow.ops.decoded import from_array, tensor_to_hwc, to_rgb
from fusionflow.ops.resample import resample_box, resize_antialiased, resize_window


def window_decodable(data) -> bool:  # complete JPEG bytes, and the window decoder loaded
    return isinstance(data, (bytes, bytearray, memoryview)) and jpeg.is_complete_jpeg(data) and jpeg.available()


def checked_header(data: bytes, what, max_pixels) -> tuple[int, int]:  # refused before decoding
    height, width, _ = jpeg.info(data)
    check_pixels(width, height, max_pixels, what)
    return height, width


def check_pixels(width: int, height: int, max_pixels: int | None, what: str | None = None) -> None:
    """Raise ImageTooLargeError when a header's size exceeds `max_pixels` (None: no limit)."""
    if max_pixels is not None and width * height > max_pixels:
        raise _too_large(f"{width}x{height} = {width * height} pixels", max_pixels, what)


def _too_large(size: str, max_pixels: int, what) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"image of {size} exceeds the policy's decode.max_pixels={max_pixels} (a possible "
        f"decompression bomb); not decoded. If the dataset holds images this large on "
        f"purpose, raise decode.max_pixels in the policy (null: no limit)",
        what,
    )


def within_pixel_limit(data, max_pixels: int | None) -> bool:
    """Whether encoded `data`'s header declares at most `max_pixels` pixels, read without decoding
    (for the accelerator, before it hands bytes to DALI). False also when the header cannot be read:
    the CPU path then reports the sample precisely."""
    if max_pixels is None:
        return True
    if jpeg.is_complete_jpeg(data) and jpeg.available():
        try:
            height, width, _ = jpeg.info(bytes(data))
            return width * height <= max_pixels
        except jpeg.WindowDecodeError:
            pass
    try:
        width, height = open_encoded(data, None, max_pixels).size
    except (DecodeError, UnidentifiedImageError, OSError, ValueError):
        return False
    return width * height <= max_pixels


def open_encoded(data, what, max_pixels: int | None = None) -> Image.Image:
    """Image.open, lazily, without Pillow's process-wide bomb warning: the caller applies the policy's
    limit. Pillow's DecompressionBombError (its limit, which is the user's to set, refused the size
    before we could see it) becomes an ImageTooLargeError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            found = re.search(r"\((\d+) pixels\) exceeds limit of (\d+)", str(exc))
            pixels, limit = (int(found[1]), int(found[2])) if found else (None, None)
            if pixels is not None and max_pixels is not None and pixels > max_pixels:
                raise _too_large(f"{pixels} pixels", max_pixels, what) from exc
            raise ImageTooLargeError(
                f"Pillow refused the image: {exc} This process set PIL.Image.MAX_IMAGE_PIXELS "
                f"(2 x it = {limit}) below the policy's decode.max_pixels={max_pixels}; raise it (or set it to "
                f"None) to let the policy's limit govern",
                what,
            ) from exc


def open_image(data, what: str | None = None, max_pixels: int | None = None) -> Image.Image:
    """A (lazily decoded) PIL image from bytes, a PIL image or a uint8 numpy array; encoded inputs
    (bytes, or a PIL image not yet loaded) over `max_pixels` raise ImageTooLargeError."""
    if isinstance(data, Image.Image):
        if getattr(data, "tile", None):  # opened lazily (Image.open), nothing decoded yet
            check_pixels(*data.size, max_pixels, what)
        if 0 in data.size:
            raise ValueError(f"{what or 'sample'}: an empty image ({data.size[1]}x{data.size[0]} pixels)")
        return data
    if isinstance(data, np.ndarray):
        return from_array(data, what)
    if isinstance(data, torch.Tensor):
        return from_array(tensor_to_hwc(data, what), what)
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            img = open_encoded(data, what, max_pixels)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            head = bytes(data[:8]).hex()
            # (Pillow's own text for it names a BytesIO at an address: no news)
            why = "no format Pillow reads" if isinstance(exc, UnidentifiedImageError) else exc
            raise DecodeError(
                f"cannot identify an image in {len(data)} bytes (first bytes {head}): {why}", what
            ) from exc
        check_pixels(*img.size, max_pixels, what)
        return img
    raise TypeError(
        f"{what or 'sample'}: expected encoded bytes, a PIL image, a uint8 array or a uint8 tensor, "
        f"got {type(data).__name__}"
    )


def dct_reduction(crop_h: int, crop_w: int, out_h: int, out_w: int) -> int:
    """Largest of 1, 2, 4, 8 by which the crop can shrink and still cover the output size."""
    r = 8
    while r > 1 and (crop_w < out_w * r or crop_h < out_h * r):
        r //= 2
    return r


def decode_crop_resize(
    data, window_fn, out_size: tuple[int, int], fast: bool, what: str | None = None, max_pixels: int | None = None
) -> Image.Image:
    """Decode `data`, crop the window `window_fn(height, width)` returns, resize to `out_size`
    (height, width) with antialiased bilinear filtering. Returns an RGB image. An encoded image
    whose header declares more than `max_pixels` pixels raises ImageTooLargeError undecoded."""
    if window_decodable(data):
        try:
            return _jpeg_window_crop_resize(bytes(data), window_fn, out_size, fast, what, max_pixels)
        except jpeg.WindowDecodeError:
            pass  # CMYK, corrupt data, ...: Pillow decodes it or raises its usual error below
    img = open_image(data, what, max_pixels)
    width, height = img.size
    top, left, h, w = window_fn(height, width)
    out_h, out_w = out_size
    box = (left, top, left + w, top + h)
    try:
        if fast and img.format == "JPEG":
            r = dct_reduction(h, w, out_h, out_w)
            if r > 1:
                # draft() picks the largest scale s with s <= min(W // w, H // h) of the size asked for:
                # asking floor(W / r) makes that r (asking ceil(W / r) often gave r / 2)
                img.draft("RGB" if img.mode == "RGB" else None, (max(1, width // r), max(1, height // r)))
                sx, sy = img.size[0] / width, img.size[1] / height
                box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"cannot decode {img.format or 'image'} {width}x{height}: {exc}", what) from exc
    img = load_rgb(img, what, (width, height))
    if isinstance(box[0], float):  # reduced image: resample straight from the fractional box
        return img.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    # crop first so border pixels never read outside the window (torchvision's resized_crop)
    return img.crop(box).resize((out_w, out_h), Image.Resampling.BILINEAR, reducing_gap=None)


def load_rgb(img: Image.Image, what, size: tuple[int, int] | None = None) -> Image.Image:
    """Decode a lazily opened image (its errors named, with `size`, its (width, height) before a draft() reduced
    img.size, else img.size) and convert it to RGB."""
    width, height = size or img.size
    try:
        with warnings.catch_warnings():  # a frame's size (GIF) is checked on load too: the policy governs
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"cannot decode {img.format or 'image'} {width}x{height}: {exc}", what) from exc
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(
            f"Pillow refused a frame of the {width}x{height} image while decoding: {exc} "
            "(PIL.Image.MAX_IMAGE_PIXELS, the process-wide limit, applies there)",
            what,
        ) from exc
    return to_rgb(img)


def _jpeg_window_crop_resize(
    data: bytes, window_fn, out_size, fast: bool, what=None, max_pixels: int | None = None
) -> Image.Image:
    """decode_crop_resize for a JPEG, decoding only the crop window.

    exact: the window's pixels equal a full decode's and Pillow resizes them: torchvision's result
    to the bit. fast, window < 2x the output: the same window, resized with torch's SIMD uint8
    antialiased bilinear filter (within one level of Pillow's, 3-5x faster). fast, window >= 2x:
    decoded at 1/2, 1/4 or 1/8 DCT scale (libjpeg-turbo's SIMD IDCT scales; the M/8 scales between
    them measured slower) with a margin, and resampled by Pillow from the window's exact fractional
    box in the scaled image -- the geometry of a full-image Pillow draft(), so the crop is exactly
    the drawn one (rounding it to the scaled grid for torch's resize measured 2-4 dB worse)."""
    height, width = checked_header(data, what, max_pixels)
    top, left, h, w = window_fn(height, width)
    out_h, out_w = out_size
    r = dct_reduction(h, w, out_h, out_w) if fast else 1
    if r == 1:
        arr, _ = jpeg.decode_window(data, top, left, h, w)
        if arr.shape[:2] != (h, w):
            raise jpeg.WindowDecodeError(f"decoded window {arr.shape[:2]} != {(h, w)}")
        if fast:
            return resize_antialiased(arr, out_h, out_w)
        return Image.fromarray(arr).resize((out_w, out_h), Image.Resampling.BILINEAR, reducing_gap=None)
    arr, box = jpeg.decode_scaled_window(data, height, width, (top, left, h, w), r)
    return Image.fromarray(arr).resize((out_w, out_h), Image.Resampling.BILINEAR, box=box, reducing_gap=None)


JPEG_FORMATS = ("JPEG", "MPO")  # Pillow's names for a JPEG (MPO: a camera's multi-picture JPEG)
BILINEAR_FAST = (resize_window, resample_box)  # the fast mode's resamplers: a full-scale window, a DCT-scaled box


def decode_crop_resize_array(
    data, window_fn, out_size: tuple[int, int], what: str | None = None, max_pixels: int | None = None
) -> np.ndarray:
    """The fast mode's decode_crop_resize as a uint8 HWC RGB array (the array pipeline's input): a JPEG
    through `fast_jpeg_array`, anything else through the Pillow path."""
    arr = fast_jpeg_array(data, window_fn, out_size, BILINEAR_FAST, what, max_pixels)
    if arr is not None:
        return arr
    return np.asarray(decode_crop_resize(data, window_fn, out_size, True, what, max_pixels))


def fast_jpeg_array(data, window_fn, out_size, resamplers, what=None, max_pixels: int | None = None):
    """The fast mode's crop of a JPEG as uint8 HWC, or None (not a JPEG): the window decoded at the coarsest
    DCT scale that still covers the output (`decode_fast_window`), resampled by `resamplers` (full-scale
    window, DCT-scaled box). Where the window decoder cannot serve the JPEG (none on this host, nvImageCodec
    at a reduced scale, a CMYK JPEG), Pillow decodes it at the same DCT scale (draft()) and the same region
    and resampling follow: libjpeg-turbo's IDCTs are Pillow's too, so a sample's pixels do not depend on the
    host's decoder (tests/test_jpeg_window.py)."""
    full, scaled = resamplers
    if window_decodable(data):
        try:
            arr, box = decode_fast_window(bytes(data), window_fn, out_size, what, max_pixels)
            return full(arr, *out_size) if box is None else scaled(arr, box, *out_size)
        except jpeg.WindowDecodeError:
            pass
    if not _may_be_jpeg(data):  # (a PNG, an array: not opened here, where its caller's path opens it again)
        return None
    img = open_image(data, what, max_pixels)
    if img.format not in JPEG_FORMATS:
        return None
    width, height = img.size
    top, left, h, w = window_fn(height, width)
    r = dct_reduction(h, w, *out_size)
    if r == 1:
        return full(
            np.array(load_rgb(img, what))[top : top + h, left : left + w], *out_size
        )  # (writable: torch reads it)
    return scaled(*pillow_scaled_region(img, (top, left, h, w), r, what), *out_size)


def _may_be_jpeg(data) -> bool:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data[:2]) == jpeg.SOI
    return isinstance(data, Image.Image) and data.format in JPEG_FORMATS


def pillow_scaled_region(img: Image.Image, window, r: int, what=None):
    """`jpeg.decode_scaled_window` by Pillow: the `jpeg.scaled_region` of a lazily opened JPEG's window decoded at
    DCT scale 1/r (draft()), as (uint8 HWC array, the window's fractional box in it)."""
    width, height = img.size
    try:
        img.draft("RGB" if img.mode == "RGB" else None, (max(1, width // r), max(1, height // r)))
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"cannot decode JPEG {width}x{height}: {exc}", what) from exc
    arr = np.asarray(load_rgb(img, what, (width, height)))
    (y0, x0, y1, x1), box, size = jpeg.scaled_region(height, width, window, r)
    if arr.shape[:2] != size:  # draft() chose another scale: the window's box in what it gave
        top, left, h, w = window
        sy, sx = arr.shape[0] / height, arr.shape[1] / width
        return arr, (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    return arr[y0:y1, x0:x1], box


def decode_fast_window(data: bytes, window_fn, out_size, what=None, max_pixels: int | None = None):
    """The fast mode's decode alone (the limit of the CPU pipeline, experiments/bench_cpu_pipeline.py's
    decode-only column): the window `window_fn(height, width)` of a JPEG decoded at the coarsest DCT
    scale that still covers `out_size`, as (uint8 HWC array, None) at full scale or (array, the
    window's fractional box in it) when scaled (`decode_scaled_window`)."""
    height, width = checked_header(data, what, max_pixels)
    top, left, h, w = window_fn(height, width)
    r = dct_reduction(h, w, *out_size)
    if r == 1:
        arr, _ = jpeg.decode_window(data, top, left, h, w)
        if arr.shape[:2] != (h, w):
            raise jpeg.WindowDecodeError(f"decoded window {arr.shape[:2]} != {(h, w)}")
        return arr, None
    return jpeg.decode_scaled_window(data, height, width, (top, left, h, w), r)
