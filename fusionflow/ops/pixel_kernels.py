"""fusionflow/kernels/pixel_ops.cc, loaded with ctypes: the fast mode's kernels for the ops where no
library call is fast on 224x224 interleaved RGB (nearest affine warps, Equalize, AutoContrast; the
measurements are experiments/bench_ops.py's). Each call returns the new array, or None when the
kernel is unavailable (no compiler: one log line, once per process) or declines; the caller then
runs its OpenCV kernel."""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

log = logging.getLogger("fusionflow")

_LIB = None
_WHY_NOT: str | None = None


def _load():
    global _LIB, _WHY_NOT
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    if os.environ.get("FUSIONFLOW_PIXEL_KERNELS", "1") == "0":
        _WHY_NOT = "turned off by FUSIONFLOW_PIXEL_KERNELS=0"
        return None
    from fusionflow import native

    try:
        # No FMA contraction: AutoContrast's table must round as Python's float64 arithmetic does.
        path = native.build("ff_pixel_ops", [native.KERNELS / "pixel_ops.cc"], ["-ffp-contract=off"])
        lib = ctypes.CDLL(str(path))
    except (native.NativeBuildError, OSError) as exc:
        _WHY_NOT = str(exc).splitlines()[0]
        log.warning("fusionflow: the native pixel kernels are unavailable (%s); using OpenCV's", _WHY_NOT)
        return None
    vp, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.ff_affine_nearest.restype = i
    lib.ff_affine_nearest.argtypes = [vp, i, i, vp, i, i, vp, vp]
    for fn in (lib.ff_equalize, lib.ff_autocontrast):
        fn.restype = i
        fn.argtypes = [vp, vp, i64]
    _LIB = lib
    return lib


def available() -> bool:
    return _load() is not None


def why_unavailable() -> str | None:
    _load()
    return _WHY_NOT


def _rgb(arr: np.ndarray) -> bool:
    return arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3 and arr.flags.c_contiguous


def affine_nearest(arr: np.ndarray, matrix, fill) -> np.ndarray | None:
    """Pillow's Image.transform(AFFINE, matrix, NEAREST, fillcolor=fill) on an HWC array, same size."""
    lib = _load()
    if lib is None or not _rgb(arr):
        return None
    h, w = arr.shape[:2]
    out = np.empty_like(arr)
    m = np.asarray(matrix[:6], np.float64)
    f = np.asarray(fill, np.uint8)
    if lib.ff_affine_nearest(arr.ctypes.data, h, w, out.ctypes.data, h, w, m.ctypes.data, f.ctypes.data):
        return None
    return out


def _tables(fn_name: str, arr: np.ndarray) -> np.ndarray | None:
    lib = _load()
    if lib is None or not _rgb(arr):
        return None
    out = np.empty_like(arr)
    getattr(lib, fn_name)(arr.ctypes.data, out.ctypes.data, arr.shape[0] * arr.shape[1])
    return out


def equalize(arr: np.ndarray) -> np.ndarray | None:
    """ImageOps.equalize on an HWC array: the same pixels."""
    return _tables("ff_equalize", arr)


def autocontrast(arr: np.ndarray) -> np.ndarray | None:
    """ImageOps.autocontrast (no cutoff) on an HWC array: the same pixels."""
    return _tables("ff_autocontrast", arr)
