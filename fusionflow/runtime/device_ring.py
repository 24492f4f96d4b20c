"""The accelerator's half of the batch ring on the GPU: [depth, batch, C, H, W] device memory,
allocated once, that DALI's GPU outputs are copied into (positions of a tiny-batch are contiguous)."""
from __future__ import annotations

import torch

from fusionflow.runtime.shm import RingLayout

_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


class DeviceRing:
    def __init__(self, layout: RingLayout, device: torch.device):
        self.images = torch.empty((layout.depth, layout.batch_size, *layout.sample_shape),
                                  dtype=_DTYPES[layout.dtype], device=device)

    def write(self, slot: int, positions, out) -> None:
        """Copy a DALI GPU TensorList (one sample per position, in order) into the ring."""
        from nvidia.dali.plugin.pytorch import feed_ndarray
        first = positions[0]
        dst = self.images[slot, first:first + len(positions)]
        feed_ndarray(out.as_tensor(), dst, cuda_stream=torch.cuda.current_stream(dst.device))
        torch.cuda.current_stream(dst.device).synchronize()  # the slot is complete before we report it
