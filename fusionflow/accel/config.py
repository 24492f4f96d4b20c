"""`DaliAccelerator`: the DALI accelerator's settings as one object (`accelerator=` of FusionFlowLoader).

The loader has always taken them as loose arguments -- `accelerator="dali-gpu"`, `gpu_sharing`,
`memory_bridge`, `aot`, `taas`, `taas_last_k` -- and still does; the object groups them, checks
them when it is built, and stands for exactly that string form (`DaliAccelerator.loader_arguments`),
which fusionflow/loader/host.py resolves as it resolves the strings: a loader configured either way
has the same `loader.config`. Importable without torch or DALI (only the loader's first iteration
builds a pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DEVICES = ("gpu", "cpu", "auto")
SHARING = ("auto", "temporal", "spatial", "off")
BRIDGE = ("auto", "on", "off")
ACCELERATOR_OF = {"gpu": "dali-gpu", "cpu": "dali-cpu", "auto": "auto"}  # device -> the string form
# fields with no loose FusionFlowLoader argument: set on the object only
OBJECT_ONLY = ("threads", "run_samples", "runs_in_flight", "hw_decoder_load")
ARGUMENT_OF = {  # each other field -> the loose FusionFlowLoader argument it stands for
    "device": "accelerator",
    "sharing": "gpu_sharing",
    "memory_bridge": "memory_bridge",
    "aot": "aot",
    "taas": "taas",
    "taas_last_k": "taas_last_k",
}


def _device_hint(device) -> str:
    if device in ("dali-gpu", "dali-cpu"):
        return f": write device={device[5:]!r} (the 'dali-' prefix belongs to the string form accelerator={device!r})"
    if isinstance(device, str) and device.startswith("cuda"):
        return (
            ": the accelerator runs on the loader's device, so pass device='cuda[:N]' to FusionFlowLoader "
            "and device='gpu' here"
        )
    return (
        " ('gpu': DALI on the loader's CUDA device; 'cpu': DALI's CPU backend; 'auto': the GPU when the "
        "loader's device is CUDA and DALI is installed, else no accelerator)"
    )


AUTO_THREADS = 4  # threads="auto"'s most: DALI alone's threads at the benchmarks' 4 CPU workers
RUN_SAMPLES = 256  # run_samples' default: on an H100 one run of 4 took ~15 ms (AoT bench, 2026-11-24)
RUNS_IN_FLIGHT_GPU = 3  # runs_in_flight="auto" on a GPU: two stay in DALI while the thread lands one and feeds the next
RUNS_IN_FLIGHT_CPU = 2  # ... on DALI's CPU backend: a run taken ahead is work idle CPU workers can no longer steal


def auto_runs_in_flight(accelerator: str | None) -> int:
    """DALI runs in flight for runs_in_flight="auto" (see DaliAccelerator)."""
    return RUNS_IN_FLIGHT_GPU if accelerator == "dali-gpu" else RUNS_IN_FLIGHT_CPU


def auto_threads(accelerator: str | None, cores: int, num_workers: int) -> int:
    """DALI's CPU threads for threads="auto": on the GPU the cores left beside the CPU workers and the
    training loop (1 to AUTO_THREADS), on DALI's CPU backend 1."""
    if accelerator != "dali-gpu":
        return 1
    return max(1, min(AUTO_THREADS, cores - num_workers - 1))


@dataclass(frozen=True)
class DaliAccelerator:
    """The DALI accelerator: a prebuilt DALI pipeline takes each mini-batch's largest tiny-batches
    while the CPU workers take the smallest. `FusionFlowLoader(..., accelerator=DaliAccelerator())`.

    device: "gpu" (DALI on the loader's CUDA device; the loader needs device="cuda[:N]"), "cpu"
        (DALI's CPU backend), or "auto" (the GPU when the loader's device is CUDA and DALI is
        installed, else no accelerator). The string forms accelerator="dali-gpu" / "dali-cpu" / "auto".
    sharing: how DALI shares the GPU with training: "auto" (measured: both modes timed, the faster kept),
        "temporal" (only inside next(), between training steps), "spatial" (concurrently), "off" (the
        accelerator does not run). The string form's gpu_sharing.
    memory_bridge: "auto" (DALI's GPU memory is one arena carved out of PyTorch's caching allocator before the
        accelerator's first run, and given back when it stops -- bounded, counted in PyTorch's memory stats,
        nothing done per step -- when DALI runs on the GPU and the bridge's native part builds), "on"
        (required: an error says what is missing), "off" (DALI keeps a pool of its own). Either sharing mode.
    aot, taas, taas_last_k: the paper's ablations; False: a DALI pipeline built per run (DALI-Naive);
        tiny-batches first in, first out instead of the largest to DALI; no share of each mini-batch
        reserved (the split rule off: the accelerator takes one tiny-batch at a time).
    threads: DALI's CPU threads (its CPU backend's workers; on the GPU, the decoder's host stage), or
        "auto": on the GPU the cores the CPU workers leave (one kept for the training loop), at most
        AUTO_THREADS; on DALI's CPU backend 1 (its threads are the accelerator's whole compute). On an
        H100 with 4 CPU workers, 4 threads trained ResNet-18 at 4,126 img/s, 1 thread at 2,852
        (docs/experiments-log.md, 2026-11-26). No loose form: `loader_arguments` leaves it out.
    run_samples: the most samples one DALI run holds (within two mini-batches -- one under temporal sharing,
        whose runs hold one share -- and one tiny-batch at least). It bounds DALI's memory (runs_in_flight runs,
        each sized for this many samples) and how a mini-batch's share is cut: a share above it goes to DALI as
        several runs, which DALI works on at once (on an H100 two runs in flight completed at about twice one
        run's rate, 2026-11-28); above the batch size, the shares of two mini-batches may go as one run, its
        fixed cost paid once (so at batches under 256 the default sizes DALI for up to two batches: on DALI's
        CPU backend at batch 64 the accelerator's gain rose 0.97 -> 1.15). No loose form either.
    runs_in_flight: DALI runs submitted and not yet collected, at most (one under temporal sharing), or "auto":
        RUNS_IN_FLIGHT_GPU on a GPU, RUNS_IN_FLIGHT_CPU on DALI's CPU backend. DALI overlaps the runs it holds
        (on an H100 two runs in flight completed at about twice one run's rate), and while the accelerator
        thread lands a run and feeds the next (~30% of its time on an H200, 2026-11-28) one run fewer is in
        DALI: with two at most, DALI held only one 37% of that benchmark. DALI's memory grows with it (each run
        in flight is sized for run_samples). No loose form either.
    hw_decoder_load: on the GPU, the share of a full run's samples (its cap: run_samples, within two mini-batches)
        that the hardware JPEG decoder takes, the largest images (DALI's decoder argument of that name; None: DALI's
        default, 0.65, as DALI alone runs). The rest go to DALI's hybrid decoder, whose Huffman stage for crops
        under a megapixel runs on DALI's CPU threads. nvImageCodec fixes the count at a pipeline's first run, which
        is therefore a full one (dali_graph.py `_sizing_run`): a run holding fewer samples than that count goes to
        the hardware decoder whole. A GPU without a hardware JPEG decoder (A100, H100 and H200 have one) ignores it.
        No loose form.

    Frozen and checked here (the machine -- CUDA, DALI, the loader's device -- is checked by the
    loader); `dataclasses.replace(acc, sharing="spatial")` derives another, checked again.
    """

    device: str = "gpu"
    sharing: str = field(default="auto", kw_only=True)
    memory_bridge: str = field(default="auto", kw_only=True)
    aot: bool = field(default=True, kw_only=True)
    taas: bool = field(default=True, kw_only=True)
    taas_last_k: bool = field(default=True, kw_only=True)
    threads: int | str = field(default="auto", kw_only=True)
    run_samples: int = field(default=RUN_SAMPLES, kw_only=True)
    runs_in_flight: int | str = field(default="auto", kw_only=True)
    hw_decoder_load: float | None = field(default=None, kw_only=True)

    def __post_init__(self):
        device, sharing, memory_bridge = self.device, self.sharing, self.memory_bridge
        if device not in DEVICES:
            raise ValueError(f"{device=!r} must be one of {DEVICES}{_device_hint(device)}")
        if sharing not in SHARING:
            raise ValueError(f"{sharing=!r} must be one of {SHARING} (the string form's gpu_sharing)")
        if memory_bridge not in BRIDGE:
            raise ValueError(f"{memory_bridge=!r} must be one of {BRIDGE}")
        threads = self.threads
        if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r} must be an int >= 1 (DALI's CPU threads) or 'auto'")
        run = self.run_samples
        if isinstance(run, bool) or not isinstance(run, int) or run < 1:
            raise ValueError(f"run_samples={run!r} must be an int >= 1 (the most samples in one DALI run)")
        depth = self.runs_in_flight
        if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"runs_in_flight={depth!r} must be an int >= 1 (DALI runs in flight at most) or 'auto'")
        load = self.hw_decoder_load
        if load is not None and (isinstance(load, bool) or not isinstance(load, (int, float)) or not 0 <= load <= 1):
            raise ValueError(f"hw_decoder_load={load!r} must be a number in [0, 1] (DALI's), or None (DALI's default)")
        for name in ("aot", "taas", "taas_last_k"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be True or False")
        if memory_bridge == "on" and device == "cpu":
            raise ValueError(
                "memory_bridge='on' lends DALI GPU memory carved from PyTorch's allocator, but device='cpu' "
                "runs DALI's CPU backend: use device='gpu', or memory_bridge='auto'/'off'"
            )
        if memory_bridge == "on" and sharing == "off":
            raise ValueError(
                "memory_bridge='on' lends DALI GPU memory, but sharing='off' turns the accelerator off: use "
                "sharing='auto', 'spatial' or 'temporal', or memory_bridge='auto'/'off'"
            )

    def loader_arguments(self) -> dict:
        """The string form this object stands for: FusionFlowLoader's loose arguments, by name."""
        return {
            ARGUMENT_OF[f.name]: ACCELERATOR_OF[self.device] if f.name == "device" else getattr(self, f.name)
            for f in fields(self)
            if f.name not in OBJECT_ONLY
        }

    def __repr__(self) -> str:
        """The device, then every field that differs from its default: what was asked for."""
        shown = [f"device={self.device!r}"] + [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "device" and getattr(self, f.name) != f.default
        ]
        return f"DaliAccelerator({', '.join(shown)})"


def loose_defaults() -> dict:
    """The loose FusionFlowLoader arguments' defaults (gpu_sharing, aot, ...), read off DaliAccelerator's fields, which
    the loader's own defaults are (one place for both)."""
    return {
        ARGUMENT_OF[f.name]: f.default for f in fields(DaliAccelerator) if f.name in ARGUMENT_OF and f.name != "device"
    }
