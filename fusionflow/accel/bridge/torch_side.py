"""The allocator bridge, PyTorch side: carve DALI's arena out of PyTorch's caching allocator once, and
give it back at the end.

The arena is one request to the caching allocator on the training stream (`torch.cuda.caching_allocator_alloc`):
PyTorch serves it from its free cached blocks by best fit, or maps a new segment. Either way PyTorch's
allocator owns the memory (`torch.cuda.memory_reserved` and `memory_allocated` count it, and its
out-of-memory handling can free its other cached blocks to make room) and nothing in PyTorch can be handed
it until it comes back. One piece, so a DALI allocation of any size up to the arena fits (the native
arena never merges separate regions). It asks for at most half the memory free on the device, so PyTorch's
out-of-memory path -- which frees its whole cache, synchronising the device, and counts an OOM -- is not
taken in the normal case; if PyTorch still cannot find it, the request is halved while it stays at or above
MIN_ARENA, else nothing is lent and DALI keeps its own pool.

Until 2026-11-28 the bridge lent every free cached block for each temporal prep window and took them back
at its end: on an H100 that cost ~54 ms a window (a snapshot of the allocator, ~58 requests) and 24% of the
throughput at batch 256, while DALI used at most 14 MB of the 3.7 GB lent (docs/experiments-log.md).
"""

from __future__ import annotations

import logging

from fusionflow.accel.bridge.ledger import Block

log = logging.getLogger(__name__)
MIN_ARENA = 64 << 20  # smaller than this, an arena is not worth PyTorch's blocks: DALI keeps its own pool


class TorchLender:
    """Carves one arena out of PyTorch's caching allocator on one device and gives it back."""

    def __init__(self, device, min_arena: int = MIN_ARENA):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.min_arena = min_arena
        self.refused = 0  # requests PyTorch could not serve (out of memory): each halved the next

    def carve(self, size: int, stream) -> list[Block]:
        """[the arena] of at most `size` bytes (and half the device's free memory) from PyTorch's allocator on
        `stream`, halved while PyTorch runs out of memory and it stays >= MIN_ARENA; [] when none can be had."""
        cuda = self.torch.cuda
        size = min(size, cuda.mem_get_info(self.index)[0] // 2)
        while size > 0:
            try:
                return [Block(cuda.caching_allocator_alloc(size, self.index, stream), size, self.index)]
            except self.torch.OutOfMemoryError:
                self.refused += 1
                if size // 2 < self.min_arena:
                    return []
                log.info("allocator bridge: PyTorch could not give a %d-byte arena; asking for half", size)
                size //= 2
        return []

    def take_back(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.torch.cuda.caching_allocator_delete(block.address)
