"""Task-affinity-aware scheduling (TAAS): which end of a mini-batch's sorted tiny-batch list each
kind of worker takes. CPU workers take the smallest; the accelerator the largest, K of them reserved
for it per mini-batch. K is the split rule's G in tiny-batches (scheduling/split.py: from measured
rates). It replaced an online search that moved K by one after "which side finished last", a
latency signal that drove K to 0 on the GPU (docs/experiments-log.md, 2026-11-24).
"""

from __future__ import annotations


def cpu_may_take(remaining: int, reserved: int) -> bool:
    """CPU workers take a mini-batch's smallest remaining tiny-batch unless only the `reserved`
    largest (the GPU's) are left."""
    return remaining > reserved
