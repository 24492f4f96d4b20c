"""Window decoding of JPEGs: only the crop window is decoded, optionally at a reduced DCT scale.

`decode_window(data, top, left, height, width, (num, denom))` returns only the pixels of that
window of the image scaled by num/denom as uint8 HWC RGB: rows below the window are never decoded,
rows above it are only entropy-decoded, columns outside it are not transformed or colour-converted.

Two backends, chosen once per process:
  * fusionflow/kernels/jpeg_roi.cc over libjpeg-turbo (loaded with ctypes): window + DCT scaling
    (1/8 .. 8/8 in eighths; 1/1, 1/2, 1/4, 1/8 have SIMD IDCTs). Compiled on first use with the host
    C++ compiler against the system's libjpeg-turbo (`jpeglib.h`, e.g. Debian's libjpeg62-turbo-dev)
    and cached like the allocator bridge's kernels.
  * if that cannot be built: nvImageCodec's CPU backend (libjpeg-turbo inside; installed with DALI),
    region decode at full scale only (`can_scale()` is False; the caller then uses Pillow's draft
    for windows that a DCT scale would shrink).
Both give a full decode's pixels for the window, bit for bit (tests/test_jpeg_window.py). If
neither is usable, `available()` is False, the reason is logged once, and the caller decodes with
Pillow (slower, the same pixels: decode.py decodes the same region at the same DCT scale with it).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os

import numpy as np

log = logging.getLogger(__name__)

_LIB = None
_WHY_NOT: str | None = None
_ERRLEN = 256
SOI = b"\xff\xd8"
EOI = b"\xff\xd9"


class WindowDecodeError(Exception):
    """This decoder declined or failed; the caller decodes with Pillow instead."""


def _load():
    """The native library, building it on first use; None (reason in _WHY_NOT) if it cannot be."""
    global _LIB, _WHY_NOT
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    if os.environ.get("FUSIONFLOW_JPEG_WINDOW", "1") == "0":
        _WHY_NOT = "turned off by FUSIONFLOW_JPEG_WINDOW=0"
        return None
    from fusionflow import native

    try:
        path = native.build("ff_jpeg_roi", [native.KERNELS / "jpeg_roi.cc"], ["-ljpeg"])
        lib = ctypes.CDLL(str(path))
    except (native.NativeBuildError, OSError) as exc:
        _WHY_NOT = str(exc).splitlines()[0]
        fallback = (
            "decoding crop windows with nvImageCodec's CPU backend (no DCT scaling)"
            if _nvimgcodec()
            else "decoding whole images with Pillow"
        )
        log.warning(
            "fusionflow: the libjpeg-turbo window decoder is unavailable (%s); %s. Install "
            "libjpeg-turbo's headers (Debian/Ubuntu: apt-get install libjpeg-turbo8-dev or "
            "libjpeg62-turbo-dev) and a C++ compiler for the fastest path.",
            _WHY_NOT,
            fallback,
        )
        return None
    p, ul, i, ip, s = ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p
    lib.ff_jpeg_info.restype = i
    lib.ff_jpeg_info.argtypes = [p, ul, ip, s, i]
    lib.ff_jpeg_info_many.restype = i
    lib.ff_jpeg_info_many.argtypes = [ctypes.POINTER(p), ctypes.c_void_p, i, ctypes.c_void_p]
    lib.ff_jpeg_scan_clean_many.restype = i
    lib.ff_jpeg_scan_clean_many.argtypes = [ctypes.POINTER(p), ctypes.c_void_p, i, ctypes.c_void_p]
    lib.ff_jpeg_decode_window.restype = i
    lib.ff_jpeg_decode_window.argtypes = [p, ul, i, i, i, i, i, i, ctypes.c_void_p, i, i, ip, s, i]
    _LIB = lib
    return lib


_NV = None  # (pid, nvimgcodec module, decoder, params), or False when unusable
_NV_DISABLED = os.environ.get("FUSIONFLOW_JPEG_NVIMGCODEC", "1") == "0"


def _nvimgcodec():
    """nvImageCodec's CPU decoder for this process (created after fork, one thread), or None."""
    global _NV
    if _NV_DISABLED or _NV is False:
        return None
    if _NV is not None and _NV[0] == os.getpid():
        return _NV
    try:
        from nvidia import nvimgcodec as nv

        dec = nv.Decoder(
            device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
            max_num_cpu_threads=1,
            backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
        )
        params = nv.DecodeParams(apply_exif_orientation=False)  # as Pillow and torchvision: EXIF ignored
    except Exception as exc:  # not installed, or a build without the CPU backend
        log.info("nvImageCodec's CPU decoder is unavailable: %r", exc)
        _NV = False
        return None
    _NV = (os.getpid(), nv, dec, params)
    return _NV


def available() -> bool:
    return _load() is not None or _nvimgcodec() is not None


def can_scale() -> bool:
    """The backend decodes at reduced DCT scales too (the native one does; nvImageCodec does not)."""
    return _load() is not None


def backend() -> str | None:
    if _load() is not None:
        return "libjpeg-turbo (fusionflow/kernels/jpeg_roi.cc)"
    return "nvImageCodec CPU" if _nvimgcodec() is not None else None


def why_unavailable() -> str | None:
    _load()
    return _WHY_NOT


def is_cut_short(data) -> bool:
    """A JPEG whose last scan has no end marker after it: truncated (markers cannot occur inside entropy-coded
    data, and an embedded thumbnail's end comes before the main image's scans); one with bytes after its end, which
    `is_complete_jpeg`'s look at the tail misses, is whole. Reads the whole buffer: for what that look refused."""
    data = bytes(data)
    return data[:2] == SOI and data.rfind(EOI) < data.rfind(b"\xff\xda")


def is_complete_jpeg(data) -> bool:
    """Starts with SOI and ends with EOI (trailing padding allowed): truncated files go to Pillow,
    which reports them as it always has."""
    if len(data) < 4 or bytes(data[:2]) != SOI:
        return False
    tail = bytes(data[-16:]).rstrip(b"\x00\r\n ")
    return tail.endswith(EOI)


def info(data: bytes) -> tuple[int, int, int]:
    """(height, width, components) from the JPEG header."""
    lib = _LIB or _load()
    if lib is None:
        nv = _nvimgcodec()
        if nv is None:
            raise WindowDecodeError("no window decoder")
        try:
            stream = nv[1].CodeStream(data)
            return stream.height, stream.width, stream.num_channels
        except Exception as exc:
            raise WindowDecodeError(f"nvImageCodec cannot parse the header: {exc}") from None
    dims = (ctypes.c_int * 3)()
    err = ctypes.create_string_buffer(_ERRLEN)
    if lib.ff_jpeg_info(data, len(data), dims, err, _ERRLEN) != 0:
        raise WindowDecodeError(err.value.decode(errors="replace"))
    return dims[0], dims[1], dims[2]


def info_many(data: list) -> np.ndarray | None:
    """(height, width) of each of `data` (bytes objects) as an (n, 2) int32 array, read in one native call (one
    decompressor, the GIL released once: a run's headers, not a Python round trip each); (0, 0) where an item is
    not a complete JPEG or its header cannot be read (read those another way). None without the native library."""
    lib = _LIB or _load()
    if lib is None:
        return None
    n = len(data)
    hw = np.zeros((n, 2), np.int32)
    if n:
        sizes = np.fromiter(map(len, data), f"u{ctypes.sizeof(ctypes.c_ulong)}", n)  # C's unsigned long
        lib.ff_jpeg_info_many((ctypes.c_char_p * n)(*data), sizes.ctypes.data, n, hw.ctypes.data)
    return hw


def scan_clean_many(data: list) -> np.ndarray | None:
    """Whether each of `data` (bytes objects: JPEGs) holds no impossible marker (FF 01..BF) from its first scan header
    to its end, as a bool array, in one native call (accel/header_sizes.py `scan_is_clean` is the reference and the
    fallback). None without the native library."""
    lib = _LIB or _load()
    if lib is None:
        return None
    n = len(data)
    clean = np.zeros(n, np.int32)
    if n:
        sizes = np.fromiter(map(len, data), f"u{ctypes.sizeof(ctypes.c_ulong)}", n)  # C's unsigned long
        lib.ff_jpeg_scan_clean_many((ctypes.c_char_p * n)(*data), sizes.ctypes.data, n, clean.ctypes.data)
    return clean.astype(bool)


# Scaled-image pixels read around a fractional box: the bilinear filter's support at a downscale of
# at most 2x (the reduction keeps the window at least the output size) is 2 pixels.
MARGIN = 2


def scaled_region(height: int, width: int, window, r: int):
    """Where the window (top, left, h, w; whole or fractional pixels) of a height x width image lies in the
    image scaled by 1/r (libjpeg's scaled size: ceil(size / r)): ((y0, x0, y1, x1), the whole scaled pixels
    to decode, with a margin of MARGIN; the window's exact fractional box (x0, y0, x1, y1) in them; the
    scaled (height, width)). The window decoder and Pillow's draft() fallback both decode this region."""
    top, left, h, w = window
    rh, rw = -(-height // r), -(-width // r)
    sx, sy = rw / width, rh / height
    fx0, fy0, fx1, fy1 = left * sx, top * sy, (left + w) * sx, (top + h) * sy
    x0, y0 = max(0, math.floor(fx0) - MARGIN), max(0, math.floor(fy0) - MARGIN)
    x1, y1 = min(rw, math.ceil(fx1) + MARGIN), min(rh, math.ceil(fy1) + MARGIN)
    return (y0, x0, y1, x1), (fx0 - x0, fy0 - y0, fx1 - x0, fy1 - y0), (rh, rw)


def decode_scaled_window(data: bytes, height: int, width: int, window, r: int):
    """The `scaled_region` of a height x width JPEG's window decoded at DCT scale 1/r: (uint8 HWC array,
    the window's exact fractional box (x0, y0, x1, y1) in that array)."""
    if not can_scale():  # nvImageCodec: no DCT scaling; the caller decodes the region with Pillow's draft
        raise WindowDecodeError("this window decoder cannot decode at a reduced scale")
    (y0, x0, y1, x1), box, size = scaled_region(height, width, window, r)
    arr, scaled = decode_window(data, y0, x0, y1 - y0, x1 - x0, (1, r))
    if scaled != size or arr.shape[:2] != (y1 - y0, x1 - x0):
        raise WindowDecodeError(f"scaled size {scaled} != {size}")
    return arr, box


def decode_window(
    data: bytes, top: int, left: int, height: int, width: int, scale: tuple[int, int] = (1, 1)
) -> tuple[np.ndarray, tuple[int, int]]:
    """The RGB pixels of rows [top, top+height) x columns [left, left+width) of the image scaled by
    scale[0]/scale[1] (coordinates in the scaled image, clipped to it), and the scaled image's
    (height, width)."""
    lib = _LIB or _load()
    if lib is None:
        return _nv_decode_window(data, top, left, height, width, scale)
    out = np.empty((height, width, 3), np.uint8)
    dims = (ctypes.c_int * 4)()
    err = ctypes.create_string_buffer(_ERRLEN)
    rc = lib.ff_jpeg_decode_window(
        data,
        len(data),
        scale[0],
        scale[1],
        top,
        left,
        height,
        width,
        out.ctypes.data,
        width * 3,
        height,
        dims,
        err,
        _ERRLEN,
    )
    if rc != 0:
        raise WindowDecodeError(err.value.decode(errors="replace"))
    return out[: dims[2], : dims[3]], (dims[0], dims[1])


def _nv_decode_window(data, top, left, height, width, scale):
    nv = _nvimgcodec()
    if nv is None:
        raise WindowDecodeError("no window decoder")
    if scale[0] != scale[1]:
        raise WindowDecodeError("nvImageCodec decodes at full scale only")
    _, mod, dec, params = nv
    try:
        stream = mod.CodeStream(data)
        full = (stream.height, stream.width)
        if stream.num_channels not in (1, 3):
            raise WindowDecodeError(f"{stream.num_channels} channels (CMYK/YCCK): decoded by Pillow")
        y1, x1 = min(top + height, full[0]), min(left + width, full[1])
        region = mod.Region(max(0, top), max(0, left), y1, x1)
        img = dec.decode(stream.get_sub_code_stream(region=region), params=params)
    except WindowDecodeError:
        raise
    except Exception as exc:
        raise WindowDecodeError(f"nvImageCodec: {exc}") from None
    if img is None:  # nvImageCodec reports a corrupt stream as None (and logs it)
        raise WindowDecodeError("nvImageCodec could not decode the stream")
    arr = np.asarray(img.cpu())
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise WindowDecodeError(f"nvImageCodec returned {arr.shape}")
    return arr, full
