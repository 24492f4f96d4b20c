"""What the machine offers this process, asked only when an argument needs it (`Host`: cores, CUDA,
DALI, the torchrun job, the seed for seed=None), and the device arguments every front resolves against it:
`resolve_device` (FusionFlowLoader, SharedLoaderClient) and `resolve_pin_memory`. The loader's own
arguments (the accelerator, the bridge, the job, remote workers) are resolved in loader/host.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _job_key():
    from fusionflow.runtime.gm.tables import job_key

    return job_key()


@dataclass(frozen=True)
class Host:
    """What resolution reads from this process, each asked only when an argument needs it (a CPU
    loader never initialises CUDA or imports DALI). The callables are looked up when called, so a
    test's monkeypatched torch.cuda is seen; tests/test_loader_config.py passes stand-ins."""

    cores: Callable[[], int] = lambda: len(os.sched_getaffinity(0))
    cuda_available: Callable[[], bool] = lambda: torch.cuda.is_available()
    current_device: Callable[[], int] = lambda: torch.cuda.current_device()
    device_count: Callable[[], int] = lambda: torch.cuda.device_count()
    has_dali: Callable[[], bool] = lambda: _has_dali()
    job_key: Callable[[], Any] = lambda: _job_key()  # the torchrun job (global_manager="auto"), or None


def resolve_device(device, host: Host, who: str = "FusionFlowLoader") -> torch.device:
    """'cpu', or 'cuda' with one device index, resolved now, for every CUDA call after."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):  # a name or type torch does not know ("tpu", 3.5)
        raise ValueError(f"device={device!r}: {who} delivers to 'cpu' or 'cuda[:N]'") from None
    if resolved.type == "cuda" and not host.cuda_available():
        raise ValueError(f"device={device!r} but CUDA is not available here: use device='cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: {who} delivers to 'cpu' or 'cuda[:N]'")
    if resolved.type == "cuda":
        if resolved.index is None:
            resolved = torch.device("cuda", host.current_device())
        if resolved.index >= host.device_count():
            raise ValueError(f"device={device!r}: this process sees {host.device_count()} CUDA device(s)")
    return resolved


def resolve_pin_memory(pin_memory, device: torch.device, cuda_available: Callable[[], bool], notes: list) -> bool:
    """pin_memory only means something for CPU delivery, and only where CUDA is."""
    pin = bool(pin_memory) and device.type == "cpu"
    if pin and not cuda_available():
        notes.append("pin_memory=True but CUDA is not available: batches are returned unpinned")
        pin = False
    return pin
