"""The CUDA side of the host batch ring, used by every delivery path (CPU-made batches and those the
accelerator made partly on the GPU): the ring page-locked for CUDA (`register_host`, cudaHostRegister
with CUDA's last error reset on failure) and the event recorded after a batch's copies out of the
ring, which frees its slot (`record_copies`). Imports torch; touches CUDA only when called."""

from __future__ import annotations

import ctypes

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: the pages count as pinned for every CUDA context


def _cudart():
    """The libcudart torch loaded (the last error is per runtime instance and thread)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcudart.so" in path:
                return ctypes.CDLL(path)
    return None


def clear_last_error() -> bool:
    """Reset CUDA's last error on this thread (a failed cudaHostRegister leaves it set, and
    PyTorch's check after the next kernel launch would report it). False if it could not be."""
    try:
        lib = _cudart()
        if lib is None:
            return False
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError()
        return True
    except OSError:
        return False


def register_host(ptr: int, nbytes: int, device_index: int) -> bool:
    """Page-lock [ptr, ptr + nbytes) for CUDA (portable: pinned for every context), with the
    loader's device current. On failure CUDA's last error is cleared, so no later, unrelated
    launch fails on it; if it cannot be cleared, a FusionFlowError says so."""
    from fusionflow.errors import FusionFlowError

    with torch.cuda.device(device_index):
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
        if rc == 0:
            return True
        if not clear_last_error():
            raise FusionFlowError(
                f"cudaHostRegister of the {nbytes}-byte batch ring failed (CUDA error {rc}) and "
                "CUDA's last error could not be reset (libcudart not found among the loaded "
                "libraries): a later kernel launch would report it; use device='cpu' or fix "
                "the registration (e.g. ulimit -l)"
            )
    return False


def record_copies(stream, mgr):
    """A blocking event (the host sleeps on it instead of spinning) recorded on `stream` after a
    batch's copies out of the ring: the slot is reused, or the ring unmapped, only after it. Call it
    with the stream's device current."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    if mgr is not None:
        mgr.copy_event = event
    return event
