"""What FusionFlowLoader's arguments ask of the machine, resolved and checked for `resolve_config`
(fusionflow/loader/config.py), against the `Host` (runtime/host.py, with the device and pinned memory):
the accelerator (a string form with its loose arguments, or a fusionflow.DaliAccelerator: the same
fields either way) and GPU sharing, the memory bridge, the job whose loaders lend
workers to each other, and remote workers. Each function takes the arguments it needs and returns
resolved values or raises the ValueError/TypeError that names the value and the fix; nothing here
initialises CUDA or imports DALI unless an argument needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fusionflow.accel.config import (
    ARGUMENT_OF,
    BRIDGE,
    RUN_SAMPLES,
    SHARING,
    DaliAccelerator,
    auto_runs_in_flight,
    auto_threads,
)
from fusionflow.accel.declines import accelerator_declines
from fusionflow.runtime.cores import rank_cores
from fusionflow.runtime.host import Host

ACCELERATORS = (None, "dali-cpu", "dali-gpu")
# the loose accelerator arguments' defaults (FusionFlowLoader's signature; a test holds them equal):
# beside a DaliAccelerator, any other value is refused
LOOSE_DEFAULTS = {"gpu_sharing": "auto", "aot": True, "taas": True, "taas_last_k": True, "memory_bridge": "auto"}
log = logging.getLogger("fusionflow.loader")


def unpack_accelerator(accelerator, loose: dict) -> tuple[Any, dict]:
    """(accelerator, loose arguments) in the string form: a DaliAccelerator becomes the strings it stands
    for (`loose`: gpu_sharing, aot, taas, taas_last_k, memory_bridge as given). The object holds the
    accelerator's settings, so a loose one given beside it is refused rather than silently dropped."""
    if isinstance(accelerator, type) and issubclass(accelerator, DaliAccelerator):
        raise TypeError("accelerator=DaliAccelerator is the class: build one, e.g. accelerator=DaliAccelerator('gpu')")
    if not isinstance(accelerator, DaliAccelerator):
        return accelerator, loose
    for name, value in loose.items():
        if value != LOOSE_DEFAULTS[name]:
            field = next(f for f, argument in ARGUMENT_OF.items() if argument == name)
            raise ValueError(
                f"{name}={value!r} beside accelerator={accelerator!r}: a DaliAccelerator holds the accelerator's "
                f"settings, so set it there -- DaliAccelerator(..., {field}={value!r}) -- and leave {name} unset"
            )
    arguments = accelerator.loader_arguments()
    return arguments.pop("accelerator"), arguments


def resolve_dali(
    accelerator, loose: dict, device, resolved: torch.device, num_workers: int, host: Host, policy, notes: list
):
    """The accelerator's LoaderConfig fields (accelerator, gpu_sharing, aot, taas, taas_last_k, memory_bridge,
    bridge_why_off, dali_threads, dali_run_samples, dali_runs_in_flight, dali_hw_decoder_load) from the loader's
    `accelerator` -- a string form or a DaliAccelerator -- and its loose arguments (`loose`, by name): the object is
    resolved as the strings it stands for. DALI threads above this rank's cores are a note, as num_workers above them
    is."""
    given = accelerator if isinstance(accelerator, DaliAccelerator) else None
    accelerator, loose = unpack_accelerator(accelerator, loose)
    for name in ("aot", "taas", "taas_last_k"):  # as DaliAccelerator checks its own: 'false' is truthy
        if not isinstance(loose[name], bool):
            raise TypeError(f"{name}={loose[name]!r} must be True or False")
    gpu_sharing, memory_bridge = loose["gpu_sharing"], loose["memory_bridge"]
    accelerator = resolve_accelerator(accelerator, gpu_sharing, device, resolved, num_workers, host, policy, given)
    check_memory_bridge(memory_bridge, accelerator, gpu_sharing, device, given)
    why_off = bridge_off_reason(memory_bridge, accelerator)
    threads, cores = (given.threads if given is not None else "auto"), rank_cores(host.cores())
    if threads == "auto":
        threads = auto_threads(accelerator, cores, num_workers)  # the node's other ranks too
    elif accelerator is not None and threads > cores:
        notes.append(
            f"{given!r}: threads={threads} exceeds this rank's {cores} CPU cores; DALI's threads then share cores "
            f"(with the CPU workers too): use threads<={cores}, or threads='auto'"
        )
    depth = given.runs_in_flight if given is not None else "auto"
    return {
        **loose,
        "accelerator": accelerator,
        "gpu_sharing": gpu_sharing,
        "bridge_why_off": why_off,
        "dali_threads": threads,
        "dali_run_samples": given.run_samples if given is not None else RUN_SAMPLES,
        "dali_runs_in_flight": auto_runs_in_flight(accelerator) if depth == "auto" else depth,
        "dali_hw_decoder_load": given.hw_decoder_load if given is not None else None,
    }


def resolve_accelerator(
    accelerator, gpu_sharing, device, resolved: torch.device, num_workers: int, host: Host, policy=None, given=None
):
    """The accelerator to run (None, 'dali-cpu', 'dali-gpu'): 'auto' is DALI on the GPU when the
    device is CUDA; gpu_sharing='off' turns any accelerator off. `device` is the argument as given
    (for the messages), `resolved` the device; `given`: the DaliAccelerator the strings came from, named
    in the messages instead of them. A policy DALI cannot run (accelerator_declines) turns it off with one log
    line: the CPU workers take every tiny-batch, and the policy means the same pixels."""
    if gpu_sharing not in SHARING:
        raise ValueError(f"gpu_sharing={gpu_sharing!r} must be one of {SHARING}")
    if accelerator == "auto":
        accelerator = "dali-gpu" if resolved.type == "cuda" and gpu_sharing != "off" and host.has_dali() else None
    if accelerator not in ACCELERATORS:
        raise ValueError(
            f"accelerator={accelerator!r} must be one of {ACCELERATORS} ('auto': DALI on the "
            "GPU when device is CUDA, none otherwise), or fusionflow.DaliAccelerator(...)"
        )
    shown = accelerator if given is None else given
    if accelerator == "dali-gpu" and resolved.type != "cuda":
        fix = "use accelerator='dali-cpu' or None"
        if given is not None:
            fix = "pass device='cuda[:N]', or use DaliAccelerator('cpu') (DALI's CPU backend) or accelerator=None"
        raise ValueError(f"accelerator={shown!r} needs a CUDA device, got device={device!r}; {fix}")
    if accelerator is not None and not host.has_dali():
        raise ValueError(f"accelerator={shown!r} needs NVIDIA DALI: pip install nvidia-dali-cuda130")
    if accelerator is not None and num_workers == 0 and gpu_sharing != "off":  # ("off": no accelerator, as documented)
        raise ValueError(f"accelerator={shown!r} shares mini-batches with CPU workers: use num_workers >= 1")
    why = accelerator_declines(policy) if accelerator is not None and gpu_sharing != "off" else None
    if why is not None:
        log.warning(
            "FusionFlowLoader: accelerator=%r declines policy %r: %s; the CPU workers take every tiny-batch",
            shown,
            policy.name,
            why,
        )
        return None
    return None if gpu_sharing == "off" else accelerator


def check_memory_bridge(memory_bridge, accelerator, gpu_sharing, device, given=None) -> None:
    """`accelerator` resolved; `given`: the DaliAccelerator it came from (named in the message), or None."""
    if memory_bridge not in BRIDGE:
        raise ValueError(f"memory_bridge={memory_bridge!r} must be one of {BRIDGE}")
    if memory_bridge == "on" and accelerator != "dali-gpu" and given is not None:
        raise ValueError(
            f"memory_bridge='on' lends DALI GPU memory carved from PyTorch's allocator, but accelerator={given!r} "
            f"resolved to {accelerator!r} (device={device!r}): use DaliAccelerator('gpu', memory_bridge='on') "
            "with a CUDA device, or memory_bridge='auto'/'off'"
        )
    if memory_bridge == "on" and accelerator != "dali-gpu":
        raise ValueError(
            f"memory_bridge='on' lends DALI GPU memory carved from PyTorch's allocator, but "
            f"accelerator={accelerator!r} (device={device!r}, gpu_sharing={gpu_sharing!r}): use "
            "accelerator='dali-gpu' with a CUDA device, or memory_bridge='auto'/'off'"
        )


def bridge_off_reason(memory_bridge, accelerator) -> str | None:
    """Why the allocator bridge is off, or None. It lends DALI one arena for the accelerator's life under either
    GPU sharing mode; whether its native part builds is found out at the first iteration, when the accelerator
    starts ('on': an error naming what is missing)."""
    if memory_bridge == "off":
        return "memory_bridge='off'"
    return None if accelerator == "dali-gpu" else "no DALI GPU accelerator"


def resolve_job(global_manager, num_workers: int, job_key: Callable[[], Any]):
    """The job whose loaders lend workers to each other, or None (no lending; always None without workers)."""
    if global_manager is not None and not isinstance(global_manager, str):
        raise ValueError(f"global_manager={global_manager!r} must be 'auto', a job name (str) or None")
    if global_manager == "auto":
        global_manager = job_key()
    elif global_manager is not None and not global_manager:
        raise ValueError(
            "global_manager='' : name the job (any string shared by the loaders that may lend "
            "workers to each other), or pass None"
        )
    return global_manager if num_workers > 0 else None


def check_remote_workers(remote_workers, num_workers: int, persistent_workers: bool, notes: list) -> None:
    """remote_workers: None or a RayWorkers beside at least one local worker process."""
    if remote_workers is None:
        return
    from fusionflow.remote.config import RayWorkers

    if not isinstance(remote_workers, RayWorkers):
        raise TypeError(
            f"remote_workers={remote_workers!r} must be None or fusionflow.RayWorkers(...) "
            "(e.g. remote_workers=RayWorkers(8, address='auto'))"
        )
    if num_workers == 0:
        raise ValueError(
            "remote_workers needs num_workers >= 1: remote workers join the local worker processes "
            "(num_workers=0 runs everything in the training process)"
        )
    if not persistent_workers:
        notes.append(
            "remote_workers without persistent_workers=True starts its Ray actors (and sends them the "
            "dataset, and starts a local Ray instance if FusionFlow started one) again every epoch; pass "
            "persistent_workers=True"
        )
