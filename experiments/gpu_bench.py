"""Issue 4's evidence, one run on a GPU machine: training throughput with each input pipeline.

ResNet-18 and ResNet-50 (torchvision, AMP bf16, channels_last), RandAugment N=2 M=9, 224-px crops of
JPEGs of mixed sizes (made here, 200-1000 px), CPU workers 4 (CPU-poor, the paper's setting) and 15:
  (a) dataloader_tv   torch DataLoader + torchvision.transforms.v2
  (b) dali            DALI alone: its auto_aug RandAugment pipeline on the GPU
  (c) ff_cpu          FusionFlowLoader, CPU workers only
  (d) ff_cpu_gpu      FusionFlowLoader, CPU workers + DALI accelerator on the GPU (TAAS)
  (e) staged          training on batches already on the GPU (the no-stall ceiling): t = 1/staged
  (f) dali_only       DALI alone's pipeline without training: its augmentation time g = 1/dali_only
  (g) ours            FusionFlow's DALI graph (the accelerator's) fed whole mini-batches as DALI alone is, two
                      in flight also while training steps (DALI alone's prefetch queue), its draws made before
                      the clock (the loader's helpers make them): the graph beside training without the loader
                      around it (graph against integration)
  ff_cpu_gpu@N/dK     (d) with DaliAccelerator(run_samples=N, runs_in_flight=K), either part optional
  .../small           (d) with the accelerator's share made of each mini-batch's smallest samples, not its largest
                      (DaliAccelerator(taas=False)): the CPU workers' DCT-scaled decode gains most on large images,
                      nvJPEG's full-resolution window decode does not (on DALI's CPU backend smallest-first lost)
  .../pN, .../tN      (d) with N ring slots (prefetch_factor=N; the accelerator's default 4), with N DALI threads
  .../nobridge        (d) with DaliAccelerator(memory_bridge="off"): DALI's own pool (the H200, 2026-11-30: DALI's
                      runs in the loader moved ~0.57 GB/s of JPEG, its graph alone beside training ~0.87)
  .../hwNN            (d) with DaliAccelerator(hw_decoder_load=NN/100): the share of a full run nvImageCodec's hardware
                      JPEG decoder takes (DALI's default 0.65), the largest images; the rest DALI's hybrid decoder
  .../nosize          (d) without the sizing run (a new pipeline's first run a full one, dali_graph.py `_sizing_run`):
                      as before session 50, nvImageCodec then fixed the hardware decoder's count from the first share
  .../copyext         (d) landing DALI's outputs as before session 31: DALI's copy_to_external into a staging block
                      (its copy waits for everything queued on DALI's stream at the call: with runs in flight, the
                      later runs' work), then slices; against the device ring's DLPack read, in the same call
and, from t, g and ff_cpu's rate c, issue 41's model bound R = (1 + c*g)/(t + g) (CPU workers and
DALI sharing each mini-batch, the GPU running training and DALI) with each FusionFlow rate's share of it,
the host bound min(staged, c + dali_only) for where DALI's host threads, not GPU time, hold dali_only,
plus per-op agreement of FusionFlow's DALI GPU ops with its CPU ops, and the AoT-design numbers.
Each variant's `_window_waits`, per repeat: its timed window's next() waits (median, p95, longest, their share
of the window: a steady loss or one long wait). Medians over timed iterations after warm-up, synchronised, and
over `--repeats` runs of each variant (the
order rotating: one run of 20 iterations varied +-15% on the H100); JSON to $OUT (or --out), each row as it
lands. `--trace DIR`: each FusionFlow variant's timeline there (its first repeat). From the repository root
(on the device machine: experiments/gpu_run.sh bench ARGS):

    export PYTHONPATH=/tmp/site; python3 -m experiments.gpu_bench --out $OUT/gpu_bench.json
    .venv/bin/python -m experiments.gpu_bench --cpu-smoke      # tiny run of every code path without a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import statistics
import time
import traceback
import warnings

import numpy as np

from experiments.harness import RESULTS, mixed_jpegs, provenance, result_path, write_json
from fusionflow.accel.sharing_profiler import PROFILE_BATCHES
from fusionflow.loader.config import ACCELERATOR_PREFETCH

DALI_PREFETCH = 2  # batches DALI runs ahead (its pipelines' default)
# the last train_rate's timed window: each iteration's wait in next() (s) and the window's wall time (s)
WINDOW: dict = {"waits": [], "seconds": 0.0}
TV_PREFETCH = 2  # DataLoader's prefetch_factor (its default): workers x 2 batches buffered


class TvDataset:
    def __init__(self, data, classes=1000):
        self.data, self.classes, self.tf = data, classes, None

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import torchvision.transforms.v2 as T
        from PIL import Image

        if self.tf is None:
            self.tf = T.Compose(
                [
                    T.RandomResizedCrop(224, antialias=True),
                    T.RandomHorizontalFlip(),
                    T.RandAugment(num_ops=2, magnitude=9),
                    T.PILToTensor(),
                ]
            )
        return self.tf(Image.open(io.BytesIO(self.data[i])).convert("RGB")), i % self.classes


def dali_batches(data, batch_size, device, num_threads, iters, classes=1000, size=224):
    """DALI alone: external source of encoded bytes -> random crop decode -> resize -> flip ->
    auto_aug RandAugment (n=2, m=9) -> CHW uint8, yielded as torch tensors on the device. The
    source is a callback and the pipeline prefetches DALI_PREFETCH batches, so DALI works ahead of
    the training step as its own framework iterators run it."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment

    gpu = device.type == "cuda"
    order: list[list[int]] = []

    def source(info):  # batch_info: DALI asks for batches in order, ahead of run()
        idx = cyclic_run(info.iteration, batch_size, len(data))
        order.append(idx)
        return [np.frombuffer(data[i], np.uint8) for i in idx]

    @pipeline_def(
        enable_conditionals=True,
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=0 if gpu else None,
        seed=0,
        prefetch_queue_depth=DALI_PREFETCH,
    )
    def pipe():
        enc = fn.external_source(source=source, batch=True, batch_info=True, dtype=types.UINT8, ndim=1)
        img = fn.decoders.image_random_crop(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)
        img = fn.resize(img, resize_x=size, resize_y=size, antialias=True)
        img = fn.flip(img, horizontal=fn.random.coin_flip())
        img = rand_augment.rand_augment(img, n=2, m=9, shape=[size, size])
        return fn.transpose(img, perm=[2, 0, 1])

    p = pipe()
    p.build()
    for _ in range(iters):
        (out,) = p.run()
        yield land_batch(out, order.pop(0), device, classes)


def cyclic_run(b: int, batch_size: int, n: int) -> list[int]:
    """Run b's samples when runs of `batch_size` take `n` samples cyclically: b*batch_size.. mod n."""
    return [(b * batch_size + j) % n for j in range(batch_size)]


def host_columns(pipe, data: list, batch_size: int) -> list:
    """The host inputs of the runs of `pipe` (a DaliPolicyPipeline) over `data`, run b taking samples
    b*batch_size.. cyclically, for one whole cycle of runs (after it run b is run b - cycle again), as the
    accelerator's helpers make them (HostInputs.columns)."""
    from fusionflow.accel.header_sizes import image_size

    sizes = [image_size(d) for d in data]
    out = []
    for b in range(len(data) // math.gcd(len(data), batch_size)):
        idx = cyclic_run(b, batch_size, len(data))
        out.append(pipe.host.columns(idx, None, [sizes[i] for i in idx], seed=0, epoch=0))
    return out


def ours_batches(pipe, data: list, host: list, batch_size: int, batches: int, device):
    """`batches` runs of `pipe` over `data` (run b takes samples b*batch_size.. cyclically, with host columns
    `host[b % len(host)]`: host_columns' cycle), each landed and yielded as DALI alone's batches are, with
    `pipe.depth` runs in flight also while the consumer trains on a batch -- run b + depth is submitted once b
    is landed, before b is yielded -- as DALI alone's pipeline keeps its prefetch queue full. On a GPU a run's
    outputs are ordered on the current stream, the one its copy goes on (DALI may reuse their memory once
    they are dropped, in that stream's order)."""
    import torch

    runs = [cyclic_run(b, batch_size, len(data)) for b in range(batches)]
    on_gpu = torch.device(device).type == "cuda"

    def submit(b: int) -> None:
        pipe.submit([data[i] for i in runs[b]], runs[b], columns=host[b % len(host)])

    for b in range(min(pipe.depth, len(runs))):
        submit(b)
    for b, idx in enumerate(runs):
        landed = land_batch(pipe.collect(torch.cuda.current_stream(device) if on_gpu else None), idx, device)
        if b + pipe.depth < len(runs):
            submit(b + pipe.depth)
        yield landed


def land_batch(out, idx: list, device, classes: int = 1000):
    """A DALI batch (`out`, one TensorList of CHW uint8) and its labels (samples `idx`) as torch tensors on
    `device`: a host copy on the CPU, a device copy on the current stream on a GPU."""
    import torch

    t = out.as_tensor()
    if torch.device(device).type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        x = torch.empty(t.shape(), dtype=torch.uint8, device=device)
        feed_ndarray(t, x, cuda_stream=torch.cuda.current_stream())
    else:
        x = torch.from_numpy(np.array(t))
    return x, torch.tensor([i % classes for i in idx], device=device)


def ff_warmup(warmup: int, profiling: bool) -> int:
    """Warm-up iterations of a FusionFlow run: with gpu_sharing="auto" on the GPU, also the
    next() calls it needs to choose (PROFILE_BATCHES timed intervals per mode, each mode's first
    call only starting its clock), so the choice is made before the timed window opens."""
    return warmup + (2 * PROFILE_BATCHES + 2 if profiling else 0)


def train_rate(make_batches, model_name, device, iters, warmup, batch_size):
    """img/s of training on the batches the generator yields: the timed window's images over its
    wall time (synchronised at both ends), after `warmup` iterations.

    The mean over the window, not a median of per-iteration intervals: a loader that buffers B
    batches hands out B of them at the GPU's pace after any slow start, so the interval median of a
    short window measures the buffer, not the loader (the first GPU run read 11k img/s from 4
    DataLoader workers that way). Callers size `warmup` to drain the loader's buffer first."""
    import torch
    import torchvision

    model = getattr(torchvision.models, model_name)(num_classes=1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    it = make_batches()
    t_start, waits = None, []
    for k in range(warmup + iters):
        if k == warmup:
            sync()
            t_start = time.perf_counter()
        t_ask = time.perf_counter()
        x, y = next(it)
        if t_start is not None:
            waits.append(time.perf_counter() - t_ask)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        x = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with amp:
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync()
    WINDOW.update(waits=waits, seconds=time.perf_counter() - t_start)
    return iters * batch_size / WINDOW["seconds"]


def window_waits() -> dict:
    """The last timed window's next() waits: median, p95 and longest (ms), and their sum's share of the window --
    a loss spread over every iteration (a steady-state rate) against one long wait (a start-up or a stall)."""
    waits = sorted(WINDOW["waits"])
    if not waits:
        return {}
    return {
        "median_ms": 1e3 * statistics.median(waits),
        "p95_ms": 1e3 * waits[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)],
        "max_ms": 1e3 * waits[-1],
        "share": sum(waits) / WINDOW["seconds"],
    }


def drain_warmup(warmup: int, buffered: int) -> int:
    """Warm-up iterations that also drain a loader's buffer of `buffered` batches (filled while the
    model's first iterations were slow): twice its depth, so the timed window sees the loader's
    steady rate."""
    return warmup + 2 * buffered


def epoch_of(data: list, batches: int, batch_size: int) -> list:
    """The dataset repeated (references, not copies) so one epoch holds `batches` batches: the timed
    window then crosses no epoch boundary, as at ImageNet scale (5,000 batches per epoch)."""
    reps = max(1, -(-batches * batch_size // len(data)))
    return data * reps


def endless(loader, set_epoch=None):
    epoch = 0
    while True:
        if set_epoch:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def ff_loader(data, batches: int, batch_size: int, workers: int, device, **accelerator):
    """The benchmarks' FusionFlowLoader: RandAugment over `batches` mini-batches of `data`, persistent
    workers, tiny-batches of 4; `accelerator` holds accelerator= and its loose arguments."""
    from fusionflow import FusionFlowLoader
    from fusionflow.tools.synthetic import EncodedImages

    return FusionFlowLoader(
        EncodedImages(epoch_of(data, batches, batch_size), classes=1000),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        policy="randaugment",
        persistent_workers=True,
        drop_last=True,
        device=device,
        tiny_batch_size=4,
        **accelerator,
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each variant per row, interleaved: medians")
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--workers", default="4,15")
    ap.add_argument(
        "--variants",
        default="staged,dali_only,dataloader_tv,dali,ff_cpu,ff_cpu_gpu",
        help="ff_cpu_gpu@N: ff_cpu_gpu with DaliAccelerator(run_samples=N); ff_cpu_gpu/dK: with runs_in_flight=K; "
        "both: ff_cpu_gpu@N/dK (several allowed: a sweep); a /copyext suffix: landing by DALI's copy_to_external; "
        "/small: the accelerator takes each mini-batch's smallest samples",
    )
    ap.add_argument(
        "--gpu-sharing",
        default="auto",
        choices=["auto", "temporal", "spatial"],
        help="ff_cpu_gpu's gpu_sharing; 'auto' profiles both modes during an extended warm-up",
    )
    ap.add_argument(
        "--dali-threads",
        type=lambda s: s if s == "auto" else int(s),
        default=1,
        help="ff_cpu_gpu's DaliAccelerator(threads=...): a number or 'auto'",
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny run on the CPU (DALI CPU backend) to check the script"
    )
    ap.add_argument("--trace", default=None, help="a folder: a Perfetto timeline of each FusionFlow row there")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def staged_rate(model_name, device, args) -> float:
    """Training on one batch already on the device, again and again: the no-stall ceiling."""
    import torch

    bs = args.batch_size
    xs = torch.randint(0, 256, (bs, 3, 224, 224), dtype=torch.uint8, device=device)
    ys = torch.randint(0, 1000, (bs,), device=device)
    return train_rate(lambda: iter(lambda: (xs, ys), None), model_name, device, args.iters, args.warmup, bs)


def dataloader_rate(data, model_name, workers, device, args) -> float:
    from torch.utils.data import DataLoader

    bs = args.batch_size
    warmup = drain_warmup(args.warmup, workers * TV_PREFETCH)
    dl = DataLoader(
        TvDataset(epoch_of(data, warmup + args.iters + 1, bs)),
        batch_size=bs,
        shuffle=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
        drop_last=True,
        prefetch_factor=TV_PREFETCH,
    )
    return train_rate(lambda: endless(dl), model_name, device, args.iters, warmup, bs)


def dali_rate(data, model_name, workers, device, args) -> float:
    bs = args.batch_size
    warmup = drain_warmup(args.warmup, DALI_PREFETCH)
    batches = lambda: dali_batches(data, bs, device, workers, args.iters + warmup + 1)  # noqa: E731
    return train_rate(batches, model_name, device, args.iters, warmup, bs)


def ours_rate(data, model_name, workers, device, args) -> float:
    """Training on FusionFlow's DALI graph alone (variant `ours`), DALI threads as DALI alone's (`workers`)."""
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.policy import load_policy

    bs = args.batch_size
    warmup = drain_warmup(args.warmup, DALI_PREFETCH)
    gpu = device.type == "cuda"
    device_id = 0 if gpu else None
    pipe = DaliPolicyPipeline(
        load_policy("randaugment"), bs, device="gpu" if gpu else "cpu", device_id=device_id, num_threads=workers
    )
    try:
        host = host_columns(pipe, data, bs)
        batches = lambda: ours_batches(pipe, data, host, bs, args.iters + warmup + 1, device)  # noqa: E731
        return train_rate(batches, model_name, device, args.iters, warmup, bs)
    finally:
        pipe.close()


def dali_only_rate(data, workers, device, args) -> float:
    """DALI alone's pipeline without training (synchronised at both ends): g, its time per image."""
    import torch

    bs = args.batch_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    it = dali_batches(data, bs, device, workers, args.iters + args.warmup + 1)
    for _ in range(args.warmup):
        next(it)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        next(it)
    sync()
    return args.iters * bs / (time.perf_counter() - t0)


def model_bound(train_rate_: float, dali_rate_: float, cpu_rate: float) -> float:
    """Issue 41's bound for CPU workers (c img/s) and DALI (g s/img on the GPU) sharing mini-batches
    with training (t s/img): R = (1 + c*g) / (t + g) while the GPU bounds it, c where the CPU does."""
    t, g, c = 1 / train_rate_, 1 / dali_rate_, cpu_rate
    return min((1 + c * g) / (t + g), 1 / t) if c * t < 1 else 1 / t


def fusionflow_rate(variant, data, model_name, workers, device, args, row) -> float:
    """FusionFlowLoader's rate, CPU workers only (ff_cpu) or with the DALI accelerator (ff_cpu_gpu; ff_cpu_gpu@N/dK:
    with DaliAccelerator(run_samples=N, runs_in_flight=K), either part optional); its stats go into `row`. A run
    whose accelerator fell back to the CPU workers raises: not comparable."""
    bs = args.batch_size
    parsed = re.fullmatch(
        r"([a-z_]+)(?:@(\d+))?(?:/d(\d+))?(/copyext)?(/small)?(?:/p(\d+))?(?:/t(\d+))?(/nobridge)?(?:/hw(\d+))?(/nosize)?",
        variant,
    )
    if parsed is None:
        raise ValueError(
            f"variant {variant!r}: write ff_cpu_gpu, ff_cpu_gpu@N, ff_cpu_gpu/dK or ff_cpu_gpu@N/dK "
            "(+ /copyext, + /small, + /pN, + /tN, + /nobridge, + /hwNN, + /nosize, in that order)"
        )
    name, run_samples, depth, copyext, small, prefetch, threads, nobridge, hw_load, nosize = parsed.groups()
    accel = None if name != "ff_cpu_gpu" else ("dali-gpu" if device.type == "cuda" else "dali-cpu")
    # gpu_sharing="auto" times PROFILE_BATCHES iterations in each mode before it
    # chooses: that happens in the warm-up, never in the timed window
    profiling = accel == "dali-gpu" and args.gpu_sharing == "auto"
    slots = int(prefetch) if prefetch else ACCELERATOR_PREFETCH if accel else 2  # ring slots
    warmup = drain_warmup(ff_warmup(args.warmup, profiling), slots)
    if accel is not None:  # DALI's knobs as one object: its CPU threads have no loose argument
        from fusionflow import DaliAccelerator

        knobs = dict(sharing=args.gpu_sharing, threads=args.dali_threads)
        if run_samples:  # ff_cpu_gpu@N
            knobs["run_samples"] = int(run_samples)
        if depth:  # ff_cpu_gpu/dK
            knobs["runs_in_flight"] = int(depth)
        if small:  # ff_cpu_gpu/small: the share made of each mini-batch's smallest samples (TAAS off)
            knobs["taas"] = False
        if threads:  # ff_cpu_gpu/tN: N DALI threads, whatever --dali-threads says
            knobs["threads"] = int(threads)
        if nobridge:  # ff_cpu_gpu/nobridge: DALI's own memory pool, not an arena carved from PyTorch's
            knobs["memory_bridge"] = "off"
        if hw_load:  # ff_cpu_gpu/hwNN: the hardware JPEG decoder's share of a full run
            knobs["hw_decoder_load"] = int(hw_load) / 100
        accel = DaliAccelerator(accel.removeprefix("dali-"), **knobs)
    extra = {"prefetch_factor": int(prefetch)} if prefetch else {}  # ff_cpu_gpu/pN: N ring slots
    tag = variant.replace("@", "_run").replace("/", "_")
    trace_name = f"trace_{model_name}_w{workers}_{tag}.json"  # names a lease returns
    path = os.path.join(args.trace, trace_name) if args.trace else None
    if path and not os.path.exists(path):  # the first repeat's timeline: which side each mini-batch waited for
        extra["trace"] = path
    landing = copy_to_external_landing() if copyext else contextlib.nullcontext()
    unsized = first_run_as_given() if nosize else contextlib.nullcontext()
    with (
        landing,
        unsized,
        ff_loader(data, warmup + args.iters + 1, bs, workers, device, accelerator=accel, **extra) as ff,
    ):
        rate = train_rate(lambda: endless(ff, ff.set_epoch), model_name, device, args.iters, warmup, bs)
        stats = row[f"{variant}_stats"] = {k: v for k, v in ff.stats.summary().items()}
        stats["gpu_sharing"] = ff.stats.gpu_sharing
        stats["runs_in_flight"] = ff.config.dali_runs_in_flight if accel is not None else None
    if profiling and ff.stats.gpu_sharing is None:
        raise RuntimeError("gpu_sharing='auto' had not chosen a mode by the end of the warm-up")
    fell_back = not stats["accelerator_tiny_batches"] or stats["accelerator_retired"]
    if accel is not None and fell_back:
        raise RuntimeError(
            f"the DALI accelerator did not run (it fell back to the CPU workers: "
            f"retired={stats['accelerator_retired']!r}, "
            f"out of memory {stats['accelerator_out_of_memory']}x): not comparable"
        )
    return rate


@contextlib.contextmanager
def first_run_as_given():
    """`ff_cpu_gpu.../nosize`: new DALI pipelines skip their sizing run (their first run is the accelerator's first
    share, as before session 50), while the block runs."""
    from fusionflow.accel import dali_graph

    before, dali_graph.SIZING_RUN_ON_GPU = dali_graph.SIZING_RUN_ON_GPU, False
    try:
        yield
    finally:
        dali_graph.SIZING_RUN_ON_GPU = before


@contextlib.contextmanager
def copy_to_external_landing():
    """The device ring's landing as before session 31 (`ff_cpu_gpu.../copyext`): DALI's copy_to_external
    (feed_ndarray) into a staging block on the ring's stream, then one device copy per run of adjacent
    positions, the host waiting for the copies; DeviceRing.write is replaced while the block runs."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from fusionflow.accel import device_ring

    def write(ring, slot, positions, out):
        slots = [slot] * len(positions) if isinstance(slot, int) else list(slot)
        with torch.cuda.device(ring.index):
            with torch.cuda.stream(ring.stream):
                staged = torch.empty(
                    (len(positions), *ring.images.shape[2:]), dtype=ring.images.dtype, device=ring.images.device
                )
                feed_ndarray(out.as_tensor(), staged, cuda_stream=ring.stream)
                k = 0
                for s, a, b in device_ring.runs_in_order(positions, slots):  # runs of adjacent positions of a slot
                    ring.images[s, a:b].copy_(staged[k : k + b - a], non_blocking=True)
                    k += b - a
            event = torch.cuda.Event(blocking=True)
            event.record(ring.stream)
        event.synchronize()
        for s in set(slots):
            ring.ready[s] = event

    before = device_ring.DeviceRing.write
    device_ring.DeviceRing.write = write
    try:
        yield
    finally:
        device_ring.DeviceRing.write = before


def variant_rate(variant, data, model_name, workers, device, args, row) -> float:
    """One timed run of `variant` (FusionFlow's stats go into `row`: the last repeat's)."""
    if variant == "staged":
        return staged_rate(model_name, device, args)
    if variant == "dataloader_tv":
        return dataloader_rate(data, model_name, workers, device, args)
    if variant == "dali":
        return dali_rate(data, model_name, workers, device, args)
    if variant == "dali_only":
        return dali_only_rate(data, workers, device, args)
    if variant == "ours":
        return ours_rate(data, model_name, workers, device, args)
    return fusionflow_rate(variant, data, model_name, workers, device, args, row)


def run_row(data, model_name, workers, device, args) -> dict:
    """Every variant's rate for one model and worker count (a failed variant: None and its error),
    and the ratios between them."""
    row, variants = {}, args.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.repeats):  # the order rotates each repeat: no variant always runs first
        for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            key = f"{model_name}/w{workers}/{variant}" + (f" (repeat {rep + 1})" if args.repeats > 1 else "")
            try:
                WINDOW.update(waits=[], seconds=0.0)
                rates[variant].append(variant_rate(variant, data, model_name, workers, device, args, row))
                row.setdefault(f"{variant}_window_waits", []).append(window_waits())  # one per repeat
                print(f"{key}: {rates[variant][-1]:.0f} img/s", flush=True)
            except Exception as exc:  # one broken variant must not lose the others' numbers
                row[f"{variant}_error"] = "".join(traceback.format_exception(exc))[-2000:]
                print(f"{key}: FAILED {exc!r}", flush=True)
    for variant, got in rates.items():  # the median of the repeats that ran (None: none did)
        row[variant] = statistics.median(got) if got else None
        if args.repeats > 1:
            row[f"{variant}_repeats"] = got
    base = row.get("dataloader_tv")
    for v in ("dali", "ff_cpu", "ff_cpu_gpu"):
        if row.get(v) and base:
            row[f"{v}_vs_dataloader_tv"] = row[v] / base
    for v in [v for v in variants if v.startswith("ff_cpu_gpu") or v == "ours"]:  # and ff_cpu_gpu@N sweeps
        if row.get(v) and row.get("dali"):
            row[f"{v}_vs_dali"] = row[v] / row["dali"]
    if row.get("ff_cpu_gpu") and row.get("staged"):
        row["ff_cpu_gpu_of_staged"] = row["ff_cpu_gpu"] / row["staged"]
    if row.get("staged") and row.get("dali_only") and row.get("ff_cpu"):
        row["model_bound"] = model_bound(row["staged"], row["dali_only"], row["ff_cpu"])
        for v in ("dali", "ff_cpu", "ff_cpu_gpu"):
            if row.get(v):
                row[f"{v}_of_bound"] = row[v] / row["model_bound"]
        # where DALI without training is held by its host threads rather than GPU time (the H100, 2026-11-28:
        # 8,842 img/s without training, 8,552 with), g above overstates DALI's GPU time and R is no bound; the
        # two sides' rates added, within training's own, are the bound then
        row["host_bound"] = min(row["staged"], row["ff_cpu"] + row["dali_only"])
        if row.get("ff_cpu_gpu"):
            row["ff_cpu_gpu_of_host_bound"] = row["ff_cpu_gpu"] / row["host_bound"]
    if row.get("ff_cpu_gpu") and row.get("dali") and row.get("ff_cpu"):  # issue 41: >= max(DALI, CPU alone)
        row["ff_cpu_gpu_vs_best_alone"] = row["ff_cpu_gpu"] / max(row["dali"], row["ff_cpu"])
    stats = row.get("ff_cpu_gpu_stats") or {}
    if stats.get("accelerator_samples"):
        row["accelerator_samples_per_run"] = stats["accelerator_samples"] / max(1, stats["accelerator_runs"])
        for part in ("feed", "inputs"):  # the training process's thread; the input helper process
            row[f"accelerator_{part}_cpu_us_per_sample"] = (
                1e6 * stats[f"accelerator_{part}_cpu_seconds"] / stats["accelerator_samples"]
            )
    return row


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")

    import torch

    if args.cpu_smoke:
        args.images, args.batch_size, args.iters, args.warmup = 48, 8, 2, 1
        args.models, args.workers = "resnet18", "1"
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("experiments.gpu_bench needs a CUDA GPU (use --cpu-smoke to check the script here)")
        device = torch.device("cuda:0")
        torch.backends.cudnn.benchmark = True
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    t0 = time.time()
    data = mixed_jpegs(args.images)
    print(f"{len(data)} JPEGs made in {time.time() - t0:.0f} s", flush=True)
    result = {
        "benchmark": "gpu_bench",
        **provenance(),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "batch_size": args.batch_size,
        "dali_threads": args.dali_threads,
        "repeats": args.repeats,
        "traced": bool(args.trace),  # a timeline recorded in each FusionFlow variant's first repeat
        "runs": {},
    }
    name = "gpu_bench.json" if device.type == "cuda" else "gpu_bench_cpu_smoke.json"
    path = result_path(args.out, name, os.environ.get("OUT", RESULTS))
    for model_name in args.models.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            result["runs"][f"{model_name}/w{workers}"] = run_row(data, model_name, workers, device, args)
            write_json(result, path)  # each row as it lands: a run stopped at its time limit keeps the rows done
    if device.type == "cuda":
        try:  # the DALI GPU ops against the CPU ops on identical input (tests/test_ops_dali.py's cases)
            from experiments.dali_agreement import agreement

            result["op_agreement_gpu_vs_cpu"] = agreement("gpu")
        except Exception as exc:
            result["op_agreement_error"] = repr(exc)
    write_json(result, path)


if __name__ == "__main__":
    main()
