"""Window decoding of JPEGs with libjpeg-turbo (fusionflow/kernels/jpeg_roi.cc), loaded with ctypes.

`decode_window(data, top, left, height, width, (num, denom))` returns only the pixels of that
window of the image scaled by num/denom (libjpeg-turbo: 1/8 .. 8/8 in eighths; 1/1, 1/2, 1/4, 1/8
have SIMD IDCTs) as uint8 HWC RGB: rows below the window are never decoded,
rows above it are only entropy-decoded, columns outside it are not transformed or colour-converted.

The library is compiled on first use with the host C++ compiler against the system's libjpeg-turbo
(`jpeglib.h`, e.g. Debian's libjpeg62-turbo-dev) and cached like the allocator bridge's kernels.
If it cannot be built, `available()` is False, the reason is logged once, and the caller decodes
with Pillow as before (slower, same pixels in the exact mode).
"""
from __future__ import annotations

import ctypes
import logging
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
    global _LIB, _WHY_NOT
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    if os.environ.get("FUSIONFLOW_JPEG_WINDOW", "1") == "0":
        _WHY_NOT = "turned off by FUSIONFLOW_JPEG_WINDOW=0"
        return None
    from fusionflow.memory import native
    try:
        path = native._build("ff_jpeg_roi", [native.KERNELS / "jpeg_roi.cc"], ["-ljpeg"])
        lib = ctypes.CDLL(str(path))
    except (native.NativeBuildError, OSError) as exc:
        _WHY_NOT = str(exc).splitlines()[0]
        log.warning("fusionflow: JPEG window decoding unavailable (%s); decoding whole images with Pillow. "
                    "Install libjpeg-turbo's headers (Debian/Ubuntu: apt-get install libjpeg-turbo8-dev or "
                    "libjpeg62-turbo-dev) and a C++ compiler for the fast path.", _WHY_NOT)
        return None
    p, ul, i, ip, s = ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p
    lib.ff_jpeg_info.restype = i
    lib.ff_jpeg_info.argtypes = [p, ul, ip, s, i]
    lib.ff_jpeg_decode_window.restype = i
    lib.ff_jpeg_decode_window.argtypes = [p, ul, i, i, i, i, i, i, ctypes.c_void_p, i, i, ip, s, i]
    _LIB = lib
    return lib


def available() -> bool:
    return _load() is not None


def why_unavailable() -> str | None:
    _load()
    return _WHY_NOT


def is_complete_jpeg(data) -> bool:
    """Starts with SOI and ends with EOI (trailing padding allowed): truncated files go to Pillow,
    which reports them as it always has."""
    if len(data) < 4 or bytes(data[:2]) != SOI:
        return False
    tail = bytes(data[-16:]).rstrip(b"\x00\r\n ")
    return tail.endswith(EOI)


def info(data: bytes) -> tuple[int, int, int]:
    """(height, width, components) from the JPEG header."""
    dims = (ctypes.c_int * 3)()
    err = ctypes.create_string_buffer(_ERRLEN)
    if (_LIB or _load()).ff_jpeg_info(data, len(data), dims, err, _ERRLEN) != 0:
        raise WindowDecodeError(err.value.decode(errors="replace"))
    return dims[0], dims[1], dims[2]


def decode_window(data: bytes, top: int, left: int, height: int, width: int,
                  scale: tuple[int, int] = (1, 1)) -> tuple[np.ndarray, tuple[int, int]]:
    """The RGB pixels of rows [top, top+height) x columns [left, left+width) of the image scaled by
    scale[0]/scale[1] (coordinates in the scaled image, clipped to it), and the scaled image's
    (height, width)."""
    out = np.empty((height, width, 3), np.uint8)
    dims = (ctypes.c_int * 4)()
    err = ctypes.create_string_buffer(_ERRLEN)
    rc = (_LIB or _load()).ff_jpeg_decode_window(data, len(data), scale[0], scale[1], top, left, height, width,
                                    out.ctypes.data, width * 3, height, dims, err, _ERRLEN)
    if rc != 0:
        raise WindowDecodeError(err.value.decode(errors="replace"))
    return out[:dims[2], :dims[3]], (dims[0], dims[1])
