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
  * it reads DALI's outputs in place (`dali_view`: their CUDA array interface, no further synchronisation;
    DALI's copy_to_external would also wait for the later runs' queued work), copies them
    into the ring slice by slice, records a blocking event on its stream and waits for it on the host
    (its own thread; a blocking event sleeps instead of spinning a core) before it lets DALI's buffer
    go: DALI would free it ordered on its own streams, not on ours;
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


def dali_view(out) -> torch.Tensor:
    """A DALI GPU TensorList (dense) as a torch tensor sharing its memory, with no synchronisation: taken
    through its CUDA array interface (version 2: no stream, so neither side waits), on the device its pointer
    is on (DALI's, the ring's). `DaliPolicyPipeline.collect(stream)` has already made the ring's
    stream wait for the run's completion event, which is all a copy on that stream must wait for. The view
    holds DALI's tensor (and its buffer) until it is dropped; DALI then frees the buffer ordered on its own
    stream, so the caller drops it only after its copies are complete (`DeviceRing.write`). Not DLPack: DALI
    parks every buffer a DLPack tensor let go in a thread that calls cudaDeviceSynchronize before freeing it
    (its DLTensorGraveyard) -- a wait for the training step's kernels too, a core spun for it, and DALI's
    memory held longer. Not `copy_to_external` either: it makes the copy wait for everything queued on the
    output's stream so far, the later runs' work too with several runs in flight."""
    return torch.as_tensor(out.as_tensor())


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
        """Copy a DALI GPU TensorList (one sample per position, in order) into the ring on the ring's stream, a
        device copy per run of adjacent positions; returns once the copies are complete (the slots may then be
        reported done, and DALI's buffer let go). `slot`: the ring slot, or each sample's (a run holding the
        shares of several mini-batches)."""
        slots = [slot] * len(positions) if isinstance(slot, int) else list(slot)
        with torch.cuda.device(self.index):
            view, event = dali_view(out), torch.cuda.Event(blocking=True)
            try:
                want = (len(positions), *self.images.shape[2:])
                if tuple(view.shape) != want or view.dtype != self.images.dtype:
                    raise ValueError(
                        f"DALI gave {tuple(view.shape)} {view.dtype}, the ring takes {want} {self.images.dtype}"
                    )
                with torch.cuda.stream(self.stream):
                    k = 0
                    for s, a, b in runs_in_order(positions, slots):
                        self.images[s, a:b].copy_(view[k : k + b - a], non_blocking=True)
                        k += b - a
            finally:  # DALI's buffer goes only once the copies that read it are done, a failed write's too
                event.record(self.stream)
                event.synchronize()
                del view
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
    return [(a, b) for _, a, b in runs_in_order(sorted(positions))]


def runs_in_order(positions, slots=None) -> list[tuple[int, int, int]]:
    """(slot, start, stop) runs of consecutive positions of one slot, in the order given (a DALI run's
    samples); `slots`: each position's slot (all 0 when None)."""
    runs: list[list[int]] = []
    for p, s in zip(positions, slots if slots is not None else [0] * len(positions)):
        if runs and runs[-1][0] == s and runs[-1][2] == p:
            runs[-1][2] = p + 1
        else:
            runs.append([s, p, p + 1])
    return [(s, a, b) for s, a, b in runs]
