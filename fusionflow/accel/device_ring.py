"""The accelerator's half of the batch ring on the GPU: [depth, batch, C, H, W] device memory,
allocated once, that DALI's GPU outputs are copied into (positions of a tiny-batch are contiguous),
and its streams and events (the ring's host registration and the copy events of CPU-made batches are
runtime/cuda_host.py's).

Streams and events (one device: the loader's, resolved to an index once, made current with a
`torch.cuda.device` guard around every CUDA call, whatever device the calling thread has):
  * the accelerator copies DALI's output on its own stream (`DeviceRing.stream`), never on the
    legacy default stream, so it does not serialise behind training; DALI hands its outputs over
    ordered on that stream (`DaliPolicyPipeline.collect(stream)`), so the host waits for DALI's work
    on the device only through a blocking event (`wait_for_outputs`: asleep, where DALI's own host
    order spins), outside the ring write, within the accelerator's stall bound;
  * after a copy it records a blocking event on that stream and waits for it on the host (its own
    thread; a blocking event sleeps instead of spinning a core): DALI may free or reuse its output
    buffer once `run()`'s result is dropped, which DALI orders on its streams, not on ours;
  * the event is also kept per ring slot, and the loader makes the training stream wait for it
    before it reads the slot (`wait_slot`), so the training stream is ordered after the copy by
    CUDA itself.
"""

from __future__ import annotations

import logging

import torch

from fusionflow.runtime.shm import RingLayout

log = logging.getLogger(__name__)
_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


def copy_out(out, dst: torch.Tensor, stream) -> None:
    """Copy a DALI GPU TensorList into `dst` on `stream` (asynchronously)."""
    from nvidia.dali.plugin.pytorch import feed_ndarray

    feed_ndarray(out.as_tensor(), dst, cuda_stream=stream)


class DeviceRing:
    def __init__(self, layout: RingLayout, device: torch.device, alloc_device: torch.device | None = None):
        """`device` must carry its index; `alloc_device` is where the buffer lives (the same device;
        the tests run the CUDA protocol against a fake torch.cuda with the buffer on the CPU)."""
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"device={device!r}: DeviceRing needs a CUDA device with an index, e.g. cuda:0")
        self.device, self.index = device, device.index
        with torch.cuda.device(self.index):
            self.images = torch.empty(
                (layout.depth, layout.batch_size, *layout.sample_shape),
                dtype=_DTYPES[layout.dtype],
                device=alloc_device or device,
            )
            self.stream = torch.cuda.Stream(device=device)
        self.ready = [None] * layout.depth  # per slot: the event of the accelerator's last copy into it

    def wait_for_outputs(self) -> None:
        """Wait on the host, asleep (a blocking event), until the ring's stream reaches what was queued on it:
        after `collect(stream)`, the DALI run whose outputs were ordered on it is done on the device."""
        with torch.cuda.device(self.index):
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        event.synchronize()

    def write(self, slot, positions, out) -> None:
        """Copy a DALI GPU TensorList (one sample per position, in order) into the ring; returns once
        the copy is complete (the slots may then be reported done). `slot`: the ring slot, or each
        sample's (a run holding the shares of several mini-batches)."""
        slots = [slot] * len(positions) if isinstance(slot, int) else list(slot)
        runs = _runs_in_order(positions, slots)
        with torch.cuda.device(self.index):
            if len(runs) == 1:  # one tiny-batch, or adjacent ones of one slot
                s, a, b = runs[0]
                copy_out(out, self.images[s, a:b], self.stream)
            else:  # staged, then a device copy per run of positions
                with torch.cuda.stream(self.stream):  # the staging block belongs to the accelerator's stream
                    staged = torch.empty(
                        (len(positions), *self.images.shape[2:]), dtype=self.images.dtype, device=self.images.device
                    )
                    copy_out(out, staged, self.stream)
                    k = 0
                    for s, a, b in runs:
                        self.images[s, a:b].copy_(staged[k : k + b - a], non_blocking=True)
                        k += b - a
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        event.synchronize()
        for s in set(slots):
            self.ready[s] = event

    def wait_slot(self, slot: int, stream) -> None:
        """Order `stream` (the training stream) after every accelerator copy into `slot` so far
        (copies on one stream complete in order: the last event covers them all)."""
        event = self.ready[slot]
        if event is not None:
            stream.wait_event(event)


def accel_runs(positions) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive positions (the accelerator's tiny-batches, merged where
    adjacent): the merged delivery copies slices, so it needs no index tensor on the device."""
    return [(a, b) for _, a, b in _runs_in_order(sorted(positions))]


def _runs_in_order(positions, slots=None) -> list[tuple[int, int, int]]:
    """(slot, start, stop) runs of consecutive positions of one slot, in the order given (a DALI run's
    samples); `slots`: each position's slot (all 0 when None)."""
    runs: list[list[int]] = []
    for p, s in zip(positions, slots if slots is not None else [0] * len(positions)):
        if runs and runs[-1][0] == s and runs[-1][2] == p:
            runs[-1][2] = p + 1
        else:
            runs.append([s, p, p + 1])
    return [(s, a, b) for s, a, b in runs]
