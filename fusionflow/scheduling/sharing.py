"""Choosing how the accelerator shares the GPU with training (`gpu_sharing="auto"`). Pure.

The loader profiles the first iterations in each mode -- temporal (prep waits for the training
step's GPU work) then spatial (prep runs concurrently) -- recording the iteration time (between
successive next() calls) and the least free GPU memory seen. Spatial wins only if it was faster
and left headroom; otherwise temporal: prep then runs only inside next(), never alongside a training
step's kernels. That does not make an out-of-memory impossible: DALI's own pool keeps what it grew
across steps (the allocator bridge, accel/bridge/memory_bridge.py, gives it one arena of PyTorch's memory instead).
"""

from __future__ import annotations

from statistics import median


def choose_sharing(
    temporal_iter_s, spatial_iter_s, spatial_min_free_bytes: int, total_bytes: int, headroom: float = 0.05
) -> str:
    if not temporal_iter_s or not spatial_iter_s:
        return "temporal"
    if spatial_min_free_bytes < headroom * total_bytes:
        return "temporal"  # running both at once came too close to the memory limit
    return "spatial" if median(spatial_iter_s) < median(temporal_iter_s) else "temporal"
