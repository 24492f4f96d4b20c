"""DaliPolicyPipeline's dealings with DALI beyond its graph: the threads DALI starts (their priority), its shutdown,
its error texts, and the JPEG of a pipeline's sizing run (dali_graph.py `_sizing_run`)."""

from __future__ import annotations

import functools
import io
import os
import re
import threading

import numpy as np


@functools.cache
def sizing_jpeg() -> tuple[bytes, tuple[int, int]]:
    """The sizing run's sample: a 256 x 256 baseline JPEG (4:2:0, as most photos), and its (height, width)."""
    from PIL import Image

    ramp = np.add.outer(np.arange(256), np.arange(256)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([ramp, ramp.T, 255 - ramp], axis=2)).save(buf, "JPEG", quality=90)
    return buf.getvalue(), (256, 256)


def thread_ids() -> set[int]:
    """This process's threads (Linux: /proc/self/task; elsewhere none are known)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def lower_priority(threads: set[int], nice: int) -> None:
    """Raise by `nice` the nice value of `threads`, those that appeared while DALI built a pipeline: DALI's
    (each names itself "[DALI]..." once it runs, maybe only after the build returned, so they are known
    by when they appeared, not by name; a thread another part of the process started in that instant
    would be lowered too). Linux's nice is per thread; raising it needs no privilege. A thread gone
    already is skipped."""
    for tid in threads - {threading.get_native_id()}:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            continue


def shutdown(pipe) -> None:
    """DALI 2.4 has no public close: `Pipeline._shutdown` is what its `__del__` runs."""
    if pipe is not None:
        close = getattr(pipe, "_shutdown", None)
        if close is not None:
            close()


# DALI's executor rethrows an operator's std::bad_alloc (its CUDABadAlloc: "CUDA allocation failed", "Can't allocate N
# bytes on device D.") as a std::runtime_error (PropagateError): a RuntimeError here, told by its text, as are CUDA's
# and nvJPEG's own out-of-memory codes; a bad_alloc outside an operator arrives as MemoryError
OUT_OF_MEMORY = re.compile(
    r"CUDA allocation failed|Can't allocate \d+ bytes|std::bad_alloc|out of memory|cudaErrorMemoryAllocation"
    r"|CUDA_ERROR_OUT_OF_MEMORY|ALLOCATOR_FAILURE",
    re.IGNORECASE,
)


def last_line(exc: BaseException) -> str:
    """DALI's cause in its message: the last line that names an error, else the last line ("Current pipeline object
    is no longer valid." closes a decoder's failure, whose cause -- a PNG parser's error, say -- comes before it)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if "no longer valid" not in ln] or lines
    named = [ln for ln in lines if "rror" in ln]
    return (named or lines)[-1] if lines else type(exc).__name__
