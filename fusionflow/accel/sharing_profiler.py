"""`gpu_sharing="auto"`: time the first iterations in each sharing mode, then keep the faster
(scheduling/sharing.py's `choose_sharing` decides; this times and switches the accelerator)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("fusionflow.accel.accelerator")
PROFILE_BATCHES = 10  # gpu_sharing="auto": iterations timed per mode before choosing


class SharingProfiler:
    """`gpu_sharing="auto"`: time `batches` iterations in temporal mode, then `batches` in spatial
    mode (watching free GPU memory), then let `choose_sharing` pick for the rest of the run."""

    def __init__(self, accel, batches: int = PROFILE_BATCHES):
        self.accel, self.batches = accel, batches
        self.times = {"temporal": [], "spatial": []}
        self.min_free = None
        self.total = None
        self.last = None
        self.chosen = None
        accel.sharing = "temporal"

    def tick(self) -> None:
        """Call at every next(): one iteration of training plus loading has passed."""
        import torch

        from fusionflow.scheduling.sharing import choose_sharing

        if self.chosen is not None:
            return
        now = time.perf_counter()
        phase = self.accel.sharing
        if self.last is not None:
            self.times[phase].append(now - self.last)
        self.last = now
        if phase == "spatial":
            free, self.total = torch.cuda.mem_get_info(self.accel.device_ring.index)
            self.min_free = free if self.min_free is None else min(self.min_free, free)
        if len(self.times[phase]) >= self.batches:
            if phase == "temporal":
                self.accel.sharing = "spatial"
                self.last = None  # the switch itself is not an iteration
            else:
                self.chosen = choose_sharing(
                    self.times["temporal"], self.times["spatial"], self.min_free or 0, self.total or 1
                )
                self.accel.sharing = self.chosen
                log.info(
                    "gpu_sharing='auto' chose %s (median iteration temporal %.1f ms, spatial %.1f ms)",
                    self.chosen,
                    1e3 * sorted(self.times["temporal"])[len(self.times["temporal"]) // 2],
                    1e3 * sorted(self.times["spatial"])[len(self.times["spatial"]) // 2],
                )
