"""The allocator bridge, PyTorch side: find the blocks PyTorch's caching allocator holds free, take
them out of its cache for a prep window (so nothing in PyTorch can be handed them meanwhile), and
put them back after.

Lending a block = asking the caching allocator for exactly that block's size on the stream its
segment belongs to: best fit serves it from that free block, without cudaMalloc. The reserved byte
count is checked around each request; if it grew (a `roundup_power2_divisions` setting rounded the
size up, say, and a new segment was mapped), that allocation is given back at once and lending stops
for the window. The new segment then stays in PyTorch's cache (reserved, free for PyTorch's own
use): at most one segment per window, reported as `refused`.

Blocks go out in pieces of at most 64 MiB (`plan_requests`), so a DALI allocation that outlives the
window pins one piece, not a whole block. Only the default pool's large segments are lent (blocks of >= 2 MiB by
default: what DALI's batch
buffers need): not private pools (CUDA graphs, torch.compile's reduce-overhead), which a plain
request can never reach, and not expandable segments (they map and unmap pages under the
allocator's own control).
"""

from __future__ import annotations

import logging

from fusionflow.accel.bridge.ledger import Block, select_blocks

log = logging.getLogger(__name__)
MIN_BLOCK = 2 << 20
CHUNK = 64 << 20


def free_cached_blocks(segments: list[dict], device: int, stream: int, min_block: int = MIN_BLOCK) -> list[Block]:
    """Free ("inactive") blocks of at least `min_block` bytes in the default pool's large,
    non-expandable segments of `device` that belong to `stream`, from `torch.cuda.memory_snapshot()`.
    Pure."""
    out = []
    for seg in segments:
        if (
            seg.get("device") != device
            or seg.get("stream") != stream
            or seg.get("segment_type") != "large"
            or seg.get("is_expandable")
            or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        ):
            continue
        address = seg["address"]
        for blk in seg["blocks"]:
            start = blk.get("address", address)  # older snapshots: blocks are contiguous from the segment start
            if blk["state"] == "inactive" and blk["size"] >= min_block:
                out.append(Block(start, blk["size"], device))
            address = start + blk["size"]
    return out


def plan_requests(blocks: list[Block], chunk: int = CHUNK, min_block: int = MIN_BLOCK) -> list[int]:
    """Request sizes that take `blocks` out of the cache in pieces of at most `chunk` bytes, largest
    first (pure). A long-lived DALI allocation then pins one piece, not a whole PyTorch block
    (which can be gigabytes); the caching allocator splits a large free block for each request and
    merges the pieces again when they come back. A tail under `min_block` stays in the cache."""
    sizes = []
    for b in blocks:
        whole, tail = divmod(b.size, chunk)
        sizes += [chunk] * whole + ([tail] if tail >= min_block else [])
    return sorted(sizes, reverse=True)


def snapshot() -> list[dict]:
    import torch

    try:
        return torch.cuda.memory_snapshot(include_traces=False)  # no stack traces: cheap
    except TypeError:  # older torch
        return torch.cuda.memory_snapshot()


class TorchLender:
    """Takes free cached blocks out of PyTorch's caching allocator on one device and puts them back."""

    def __init__(self, device, min_block: int = MIN_BLOCK, chunk: int = CHUNK):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.min_block, self.chunk = min_block, chunk
        self.refused = 0  # lends undone because the allocator would have reserved new memory

    def lend(self, budget: int | None, stream) -> list[Block]:
        """Lend free cached blocks of `stream` in pieces of at most `chunk` bytes, largest blocks
        first, up to `budget` bytes (None: all)."""
        cuda = self.torch.cuda
        free = free_cached_blocks(snapshot(), self.index, stream.cuda_stream, self.min_block)
        chosen = select_blocks(free, sum(b.size for b in free) if budget is None else budget)
        lent = []
        try:
            for size in plan_requests(chosen, self.chunk, self.min_block):
                before = cuda.memory_reserved(self.index)
                ptr = cuda.caching_allocator_alloc(size, self.index, stream)
                if cuda.memory_reserved(self.index) > before:
                    cuda.caching_allocator_delete(ptr)
                    self.refused += 1
                    log.info(
                        "allocator bridge: a %d-byte request would have grown PyTorch's reservation; "
                        "stopped lending for this window",
                        size,
                    )
                    break
                lent.append(Block(ptr, size, self.index))
        except BaseException:
            self.take_back(lent)  # nothing half-lent stays out of PyTorch's cache
            raise
        return lent

    def take_back(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.torch.cuda.caching_allocator_delete(block.address)
