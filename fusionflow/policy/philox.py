"""The draw's uniforms for many samples at once: numpy's Philox4x64 streams (policy/sampling.py keys them) computed
by fusionflow/kernels/philox.cc in one call, or by numpy itself, sample by sample, where the kernel cannot be built.

Positioning numpy's generator at a sample's stream means assigning its state dict: ~9 us of Python a sample, about
half of a RandAugment draw. The kernel computes the same words (tests/test_sampling.py checks them against numpy)
for a whole run or tiny-batch in one ctypes call, ~1 us a sample.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

log = logging.getLogger("fusionflow")

_lib = None  # the loaded kernel, or False once it proved unavailable in this process
_lock = threading.Lock()


def _new_lock() -> None:  # a child forked while another thread held the lock (building) must not wait for it
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)
_local = threading.local()  # the fallback's numpy Philox, one per thread, re-keyed per sample


def _load():
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _build()
    return _lib or None


def _build():
    if os.environ.get("FUSIONFLOW_NATIVE_PHILOX", "1") == "0":
        return False
    from fusionflow import native

    try:
        lib = ctypes.CDLL(str(native.build("ff_philox", [native.KERNELS / "philox.cc"], [])))
    except (native.NativeBuildError, OSError) as exc:
        log.info("fusionflow: the native Philox kernel is unavailable (%s); numpy draws instead", exc)
        return False
    u64, i64, vp = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
    lib.ff_philox_uniforms.restype = None
    lib.ff_philox_uniforms.argtypes = [u64, u64, u64, vp, vp, i64, i64, i64, vp]
    return lib


def native() -> bool:
    """Whether the kernel computes the uniforms in this process."""
    return _load() is not None


def uniforms_many(key: tuple[int, int], epoch: int, indices, copies, first: int, count: int) -> np.ndarray:
    """(n, count) float64: row i holds uniforms first .. first+count of the stream of (indices[i], copies[i]) in
    `epoch` under the 128-bit `key` (two 64-bit words); `first` a multiple of 4 (a whole Philox block)."""
    if first < 0 or first % 4 or count < 0:
        raise ValueError(f"first={first} must be a non-negative multiple of 4 and count={count} non-negative")
    idx = np.ascontiguousarray(indices, np.uint64)
    cps = np.ascontiguousarray(copies, np.uint64)
    if idx.shape != cps.shape or idx.ndim != 1:
        raise ValueError(f"indices {idx.shape} and copies {cps.shape} must be two vectors of one length")
    out = np.empty((len(idx), count), np.float64)
    lib = _load()
    if lib is not None:
        if len(idx):
            lib.ff_philox_uniforms(
                *key, epoch, idx.ctypes.data, cps.ctypes.data, len(idx), first, count, out.ctypes.data
            )
        return out
    for i, (index, copy) in enumerate(zip(idx.tolist(), cps.tolist())):
        out[i] = numpy_generator(key, epoch, index, copy, first).random(count)
    return out


def numpy_generator(key: tuple[int, int], epoch: int, index: int, copy: int, first: int = 0) -> np.random.Generator:
    """numpy's Philox4x64 positioned at uniform `first` (a multiple of 4) of the sample's stream: counter =
    (first / 4, copy, index, epoch), nothing buffered (the next word is the next block's first)."""
    gen = getattr(_local, "gen", None)
    if gen is None:
        gen = _local.gen = np.random.Generator(np.random.Philox(key=0))
    gen.bit_generator.state = {
        "bit_generator": "Philox",
        "state": {
            "counter": np.array([first // 4, copy, index, epoch], np.uint64),
            "key": np.array(key, np.uint64),
        },
        "buffer": np.zeros(4, np.uint64),
        "buffer_pos": 4,
        "has_uint32": 0,
        "uinteger": 0,
    }
    return gen
