"""Builds the allocator bridge's native parts from `kernels/` on demand and loads them with ctypes.

Two libraries:
  arena   kernels/lent_arena_capi.cc            C++ only; the sub-allocator, testable anywhere
  bridge  kernels/dali_bridge_resource.cc       DALI's device memory resource; needs the DALI
                                                wheel's headers and libdali_core, and CUDA's
                                                runtime headers and library

Each build lands in a cache directory keyed by a hash of its sources, flags and inputs
(``$FUSIONFLOW_CACHE`` or ``~/.cache/fusionflow``), written to a temporary name and renamed, so
concurrent processes never load a half-written library. A build that cannot run raises
`NativeBuildError` whose message says what is missing and how to provide it; the runtime turns
that into a logged fallback (memory_bridge="auto") or an error (memory_bridge="on").
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from fusionflow.errors import (
    BridgeError,
    NativeBuildError,
)  # defined with the other public errors; used as native.BridgeError

KERNELS = Path(__file__).resolve().parent / "kernels"  # package data (fusionflow/kernels)
ERRLEN = 512


def cache_dir() -> Path:
    return Path(os.environ.get("FUSIONFLOW_CACHE") or Path.home() / ".cache" / "fusionflow") / "kernels"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++: apt-get install g++)")
    return cxx


def dali_paths() -> tuple[Path, Path]:
    """(include dir, lib dir) of the installed DALI wheel."""
    try:
        import nvidia.dali as dali
    except ImportError as exc:
        raise NativeBuildError(f"NVIDIA DALI is not importable ({exc}): pip install nvidia-dali-cuda130") from None
    root = Path(dali.__file__).parent
    if not (root / "include" / "dali" / "core" / "mm" / "default_resources.h").exists():
        raise NativeBuildError(f"the DALI wheel at {root} ships no headers (dali/core/mm/default_resources.h)")
    if not (root / "libdali_core.so").exists():
        raise NativeBuildError(f"no libdali_core.so in {root}")
    return root / "include", root


def cuda_paths() -> tuple[Path, Path]:
    """(include dir, lib dir) holding cuda_runtime_api.h and libcudart: $CUDA_HOME, the toolkit
    around nvcc, /usr/local/cuda, then the nvidia-cuda-runtime wheel that CUDA builds of torch bring."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    roots.append("/usr/local/cuda")
    site = Path(sysconfig.get_paths()["purelib"])
    for wheel_dir in ("nvidia/cu13", "nvidia/cuda_runtime"):
        roots.append(str(site / wheel_dir))
    tried = []
    for root in filter(None, roots):
        inc = Path(root) / "include"
        if not (inc / "cuda_runtime_api.h").exists():
            tried.append(root)
            continue
        for lib in (Path(root) / "lib64", Path(root) / "lib"):
            if (lib / "libcudart_static.a").exists() or any(lib.glob("libcudart.so*")):
                return inc, lib
        tried.append(root)
    raise NativeBuildError(
        "CUDA runtime headers and libcudart not found (looked in "
        f"{', '.join(tried) or 'nothing'}): set CUDA_HOME to a CUDA toolkit"
    )


def _cudart_link(lib: Path) -> list[str]:
    if (lib / "libcudart_static.a").exists():  # as DALI itself links it: no runtime lookup needed
        return [str(lib / "libcudart_static.a"), "-lrt", "-ldl", "-lpthread"]
    so = sorted(lib.glob("libcudart.so*"))[0]
    return [str(so), f"-Wl,-rpath,{lib}"]


def build(name: str, sources: list[Path], args: list[str], extra_key: str = "") -> Path:
    missing = [str(src) for src in sources if not src.exists()]
    if missing:
        raise NativeBuildError(
            f"native sources not found ({', '.join(missing)}): they ship inside the package "
            "(fusionflow/kernels); reinstall fusionflow"
        )
    cxx = compiler()
    key = hashlib.sha256()
    for src in sources + sorted(KERNELS.glob("*.h")):
        key.update(src.name.encode() + src.read_bytes())
    key.update(repr((cxx, args, extra_key)).encode())
    out = cache_dir() / f"lib{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    cmd = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-I", str(KERNELS), *map(str, sources), "-o", tmp, *args]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeBuildError(
                f"building {name}: the compiler {cxx} could not run ({exc}); set CXX to a working C++ compiler"
            ) from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise NativeBuildError(f"building {name} failed ({' '.join(cmd[:2])} ... exit {proc.returncode}):\n{tail}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_arena() -> Path:
    return build("ff_arena", [KERNELS / "lent_arena_capi.cc"], [])


def build_bridge() -> Path:
    dali_inc, dali_lib = dali_paths()
    cuda_inc, cuda_lib = cuda_paths()
    core = (dali_lib / "libdali_core.so").stat()  # a DALI upgraded in place gets a fresh build (C++ ABI)
    return build(
        "ff_dali_bridge",
        [KERNELS / "dali_bridge_resource.cc"],
        [
            "-I",
            str(dali_inc),
            "-I",
            str(cuda_inc),
            "-L",
            str(dali_lib),
            "-ldali_core",
            f"-Wl,-rpath,{dali_lib}",
            *_cudart_link(cuda_lib),
        ],
        extra_key=f"{core.st_size}:{core.st_mtime_ns}",
    )


def _declare(lib, name: str, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)


def load_arena() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_arena()))
    u64, p, s, i = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    arr = ctypes.POINTER(ctypes.c_uint64)
    _declare(lib, "ff_arena_new", p)
    _declare(lib, "ff_arena_delete", None, p)
    _declare(lib, "ff_arena_set_accepting", None, p, i)
    _declare(lib, "ff_arena_lend", i, p, u64, u64, s, i)
    _declare(lib, "ff_arena_allocate", u64, p, u64, u64, u64, arr, s, i)
    _declare(lib, "ff_arena_deallocate", i, p, u64, u64, s, i)
    _declare(lib, "ff_arena_reclaim", i, p, arr, arr, i, s, i)
    _declare(lib, "ff_arena_stats", None, p, arr)
    return lib


_BRIDGE = None


def load_bridge() -> ctypes.CDLL:
    """The DALI bridge library, loaded once per process (DALI must be imported first so the
    libdali_core it resolves is the one DALI's Python backend uses)."""
    global _BRIDGE
    if _BRIDGE is None:
        import nvidia.dali.backend  # noqa: F401  (loads libdali_core into the process)

        path = build_bridge()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise NativeBuildError(f"loading {path} failed: {exc}") from None
        u64, s, i = ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int
        arr = ctypes.POINTER(ctypes.c_uint64)
        _declare(lib, "ff_bridge_install", i, i, s, i)
        _declare(lib, "ff_bridge_open", i, i, u64, s, i)
        _declare(lib, "ff_bridge_lend", i, i, u64, u64, s, i)
        _declare(lib, "ff_bridge_close", i, i, u64, arr, arr, i, s, i)
        _declare(lib, "ff_bridge_stats", i, i, arr, s, i)
        _declare(lib, "ff_bridge_pause", i, i, i, s, i)
        _BRIDGE = lib
    return _BRIDGE


def call(fn, *args):
    """Call a native entry point whose last two arguments are (err, errlen); raise on -1."""
    err = ctypes.create_string_buffer(ERRLEN)
    rc = fn(*args, err, ERRLEN)
    if isinstance(rc, int) and rc < 0:
        raise BridgeError(f"{fn.__name__}: {err.value.decode(errors='replace')}")
    return rc
