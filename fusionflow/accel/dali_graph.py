"""A policy as one prebuilt DALI pipeline: decode+crop -> resize -> flip -> op slots -> layout.

One pipeline per policy, with per-sample conditionals (DALI's `enable_conditionals`): slot k of a
sample runs the op its draw names, so a single graph covers every op combination and nothing is
built after start-up. Randomness never comes from DALI: the host computes each sample's
`SampleDraw` for (seed, epoch, index) -- exactly as a CPU worker does -- and feeds crop window,
flip, op ids and op parameters as per-sample inputs.

EXIF orientation is ignored, as on the CPU path (Pillow) and in torchvision: DALI's decoder would
apply it by default (`adjust_orientation`), turning or mirroring the image on one path only.

The policy's `decode.mode` applies to the CPU path only: DALI decodes the crop window at full
resolution and resizes it with its own antialiased filter (its ROI decode already skips what lies
outside the window; a DCT-scaled decode is what the CPU's fast mode adds).

Works with DALI on the CPU (`device="cpu"`, device_id=None: tests and CPU-only machines) and on a
GPU (`device="gpu"`: decoding with the mixed nvJPEG decoder).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque

import numpy as np
from nvidia.dali.backend import TensorCPU, TensorListCPU  # dali_ops imports DALI at import time too

from fusionflow.accel import dali_fork
from fusionflow.accel.dali_host import OUT_OF_MEMORY, last_line, lower_priority, shutdown, sizing_jpeg, thread_ids
from fusionflow.accel.dali_ops import DaliStyle, apply_slot, erase_fragment, slot_branches
from fusionflow.accel.declines import dali_declines
from fusionflow.accel.header_sizes import image_size
from fusionflow.accel.host_inputs import HostInputs, HostLayout, op_names
from fusionflow.errors import AcceleratorError, DecodeError, DeviceOutOfMemory
from fusionflow.policy import Policy, load_policy
from fusionflow.policy.op_specs import NUM_PARAMS
from fusionflow.runtime.procs import interrupts_deferred

log = logging.getLogger(__name__)

# DALI's CPU backend yields a contended core to the loader's CPU workers: they make ~3.4x its images per
# core (1,012 against 283 img/s, bench_cooperation 2026-11-27), and beside it a worker ran 0.86-0.89 of a
# core, waiting 0.09 to be scheduled (0.92-0.95 and 0.02-0.04 with this; its effect on the rate is within
# that benchmark's noise). On a GPU its threads feed the device: left as they are.
CPU_BACKEND_NICE = 10
# A new GPU pipeline's first run is a full one (DaliPolicyPipeline._sizing_run); experiments/gpu_bench.py's `/nosize`
# variant turns it off to measure it
SIZING_RUN_ON_GPU = True


class DaliPolicyPipeline:
    """Runs `policy` on batches of up to `batch_size` encoded samples through DALI. `exec_dynamic`: DALI's dynamic
    executor, the accelerator's (outputs ordered on a CUDA stream, alive while referenced). False, its classic one,
    costs the calling thread less on the CPU backend (experiments/bench_graph.py --classic) but on a GPU waits for a
    run on the host and reuses its output buffers with no stream order: for experiments on the CPU backend only."""

    def __init__(
        self,
        policy,
        batch_size: int,
        device: str = "cpu",
        device_id: int | None = None,
        num_threads: int = 1,
        exec_dynamic: bool = True,
        depth: int = 2,
        thread_nice: int | None = None,
        hw_decoder_load: float | None = None,
        full_first_run: bool | None = None,
    ):
        _check_args(batch_size, device, device_id)
        self.policy: Policy = load_policy(policy)
        why = dali_declines(self.policy)
        if why is not None:
            raise ValueError(f"{self.policy.source}: the DALI pipeline cannot run {why}; the CPU pipeline runs it")
        aug = self.policy.augment
        self.batch_size, self.device = batch_size, device
        self.op_names = op_names(self.policy)  # local op ids: 0 is Identity (empty slot), then the policy's ops
        self.slots = self.slot_count()
        self.host = HostInputs(self.policy, self.slots)
        self.layout = HostLayout(self.slots, self.policy.erase is not None)
        augment = self.op_graph(DaliStyle(aug.interpolation, aug.fill, self.policy.size, device))
        decoder = {} if hw_decoder_load is None or device != "gpu" else {"hw_decoder_load": float(hw_decoder_load)}
        graph = _policy_graph(self.policy, device, augment, self.layout, decoder)
        self._make = lambda: graph(
            batch_size=batch_size,
            num_threads=num_threads,
            device_id=device_id,
            exec_dynamic=exec_dynamic,
            prefetch_queue_depth=depth,
        )
        self.depth = depth  # runs that may be in flight at once (submit ahead, collect in order)
        # added to the nice value of the threads DALI starts for this pipeline (None: CPU_BACKEND_NICE on the CPU)
        self.thread_nice = (CPU_BACKEND_NICE if device == "cpu" else 0) if thread_nice is None else thread_nice
        # a new pipeline's first run is a full one (`_sizing_run`): on a GPU, unless told otherwise
        self.full_first_run = device == "gpu" and SIZING_RUN_ON_GPU if full_first_run is None else full_first_run
        self._pending: deque = deque()  # (indices, what DALI reads in place) per run submitted, not collected
        self.build_guard = contextlib.nullcontext  # entered around a rebuild after a failed run
        self._consumed = None  # the last run collected: its bytes are released at the next collect
        self.rebuilds = 0
        self.sized_at = 0.0  # when the last sizing run ended (time.monotonic): the run after it starts there
        self._closed = False
        t0 = time.perf_counter()
        self._pipe = self._build()
        self.build_seconds = time.perf_counter() - t0

    # The graph's op section, as two methods so that an experiment can build another design of it
    # (experiments/bench_aot.py: one pipeline per op combination) on the same decode, feed and output.
    def slot_count(self) -> int:
        """How many op slots a sample has (its draw's ops fill the first ones, Identity the rest).
        With `op_graph`, the hooks a variant graph overrides (experiments/bench_aot.py)."""
        return self.policy.augment.max_ops

    def op_graph(self, style):
        """The op slots, as a function of the graph's images and its packed host input (`HostLayout`):
        slot k of a sample runs the op its draw names there (a per-sample conditional). It holds plain
        values, never `self`: DALI keeps the graph as long as its pipeline, which must go with this
        object's last reference."""
        from nvidia.dali import fn, types

        slots, (fragments, keys, branches) = self.slots, slot_branches(self.op_names)
        (ids, _), (params, _) = self.layout.span("op_ids"), self.layout.span("params")

        def augment(images, host):
            for k in range(slots if fragments else 0):  # no fragment: every op is Identity
                branch = fn.lookup_table(
                    fn.cast(host[ids + k], dtype=types.INT32), keys=keys, values=branches, dtype=types.INT32
                )  # 0 for an empty slot
                images = apply_slot(
                    images, branch, host[params + k * NUM_PARAMS : params + (k + 1) * NUM_PARAMS], fragments, style
                )
            return images

        return augment

    def _build(self):
        before = thread_ids()
        with interrupts_deferred():  # a Ctrl-C inside DALI's graph definition broke its pipeline stack (IndexError)
            pipe = self._make()
            dali_fork.track(pipe)  # a process forked from this one lets it go unshut (accel/dali_fork.py)
            pipe.build()
        if self.thread_nice:
            lower_priority(thread_ids() - before, self.thread_nice)
        # DALI 2.4's first schedule_run() runs `prefetch_queue_depth` iterations at once, for sources
        # that a callback fills; ours are fed one run at a time (feed_input), so every schedule_run,
        # the first included, must run exactly the one iteration just fed.
        pipe._first_iter = False
        self._fresh = True  # its decoder has not run yet (`_sizing_run`)
        return pipe

    def prepare(self, data, index: int, seed: int, epoch: int, what: str | None = None, copy: int = 0, size=None):
        """Host-side inputs for one sample: the same draw a CPU worker would make. `size`: the image's
        (height, width) when the caller knows it (else read from its header)."""
        size = size if size is not None else image_size(data, what or f"sample {index}")
        return (np.frombuffer(data, np.uint8),) + self.host.sample(index, seed, epoch, copy, size)

    def run(self, samples, indices, seed: int = 0, epoch: int = 0, copies=None):
        """Augment encoded `samples` (sample i has dataset index indices[i], and is that index's
        copies[i]-th occurrence in the epoch: all 0 when None); returns DALI's output TensorList
        (CPU or GPU), one CHW sample per input, in order. `submit` then `collect`."""
        self.submit(samples, indices, seed, epoch, copies)
        return self.collect()

    def submit(
        self, samples, indices, seed: int = 0, epoch: int = 0, copies=None, sizes=None, columns=None, keep=None
    ) -> None:
        """Feed one run and schedule it without waiting for it (at most `depth` in flight); `collect`
        returns the outputs of the runs in the order they were submitted. `sizes`: each sample's
        (height, width), when known; `columns`: the run's host inputs made already (`HostInputs.columns`:
        the accelerator's helper process), else made here sample by sample; `keep`: held as long as the samples
        (what they are views of). Raises as `run` does; a failure loses every run in flight."""
        n = len(samples)
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"got {n} samples; this pipeline takes 1..{self.batch_size} per run")
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{self.depth} runs are in flight already: collect one first")
        # DALI reads the encoded bytes in place (no_copy): they stay referenced until the run is collected.
        # As one DALI tensor list sharing them (not contiguous: no copy), made by C-level calls: DALI's feed
        # takes a tensor list whole, where a list costs ~9 interpreter calls a sample in its checks
        arrays = list(map(_bytes_as_u8, samples))
        encoded = TensorListCPU(list(map(TensorCPU, arrays)), None, False)
        if columns is None:
            copies = [0] * n if copies is None else copies
            sizes = [None] * n if sizes is None else sizes
            per_sample = (
                self.prepare(s, i, seed, epoch, copy=c, size=z) for s, i, c, z in zip(samples, indices, copies, sizes)
            )
            columns = [np.stack(col) for col in list(zip(*per_sample))[1:]]
        if self._closed:
            raise AcceleratorError(f"the DALI pipeline of {self.policy.name} is closed")
        if self._pipe is None:  # a previous batch broke the pipeline: the one rebuild off start-up
            log.warning("rebuilding the DALI pipeline of %s after a failed batch", self.policy.name)
            with self.build_guard():  # the accelerator's: its bridge paused (MemoryBridge.paused), as the decoder's
                try:  # lasting state, made at the sizing run, goes to DALI's own pool
                    self._pipe = self._build()
                except Exception as exc:
                    raise AcceleratorError(f"rebuilding the DALI pipeline of {self.policy.name} failed: {exc}") from exc
                self.rebuilds += 1
                self._sizing_run()
        if self._fresh:
            self._sizing_run()
        with self._failures(indices):
            self._feed(encoded, columns)
        self._pending.append((list(indices), (samples, arrays, encoded, keep)))

    def _feed(self, encoded, columns) -> None:
        """One run's inputs into DALI, and the run scheduled: the encoded bytes ragged, the rest packed dense."""
        names, cols = ["encoded", "host"], [encoded, self.layout.pack(columns)]
        if len(columns) > len(self.layout.spans):  # erasing with noise: a full-size image per sample
            names, cols = names + ["erase_noise"], cols + [columns[-1]]
        for name, col in zip(names, cols):
            self._pipe.feed_input(name, col)
        self._pipe.schedule_run()

    def _sizing_run(self) -> None:
        """A new pipeline's first run, with `full_first_run`: batch_size (the run cap) copies of a small JPEG, run
        and dropped.

        nvImageCodec, under DALI's mixed decoder, sets once, at the decoder's first run, how many of a run's samples
        its hardware JPEG decoder takes: round(hw_decoder_load x that run's samples) (DALI asks for its FIXED
        load-hint policy), and it gives them the run's largest images; the rest go to the hybrid decoder, whose
        Huffman stage runs on DALI's few CPU threads for crops under a megapixel. DALI alone's first batch is a full
        one; the accelerator's first run is a first share, often small, so its hardware decoder took a handful of
        each later run and DALI's threads the rest (on an H200, 2026-11-30, the graph moved 0.57 GB/s of JPEG in the
        loader and 0.87 fed whole batches). Run on the caller's thread after the bridge lent its arena, like any run
        (a rebuild's inside its build guard, the bridge paused: the decoder's lasting state made here is not the
        arena's)."""
        self._fresh = False
        if not self.full_first_run:
            return
        n, (data, hw) = self.batch_size, sizing_jpeg()
        arrays = [np.frombuffer(data, np.uint8) for _ in range(n)]
        encoded = TensorListCPU(list(map(TensorCPU, arrays)), None, False)
        columns = self.host.columns(np.arange(n), None, [hw] * n, seed=0, epoch=0)
        with self._failures(None):
            self._feed(encoded, columns)
            self._pipe.outputs()
        self._consumed = ([], (arrays, encoded))  # DALI's reads of fed memory end with the next run's outputs
        self.sized_at = time.monotonic()

    def collect(self, stream=None):
        """The outputs of the oldest run in flight (waits for DALI to have launched all its work). On a GPU
        with `stream` (where they will be copied: a torch.cuda.Stream), ordered on that stream: this call
        does not wait for the run's GPU work, which DALI's host order does with a cudaEventSynchronize (a
        spinning wait under CUDA's default scheduling); the caller waits asleep if it must
        (`DeviceRing.wait_for_outputs`). The outputs' memory lives while `out` does."""
        if not self._pending:
            raise RuntimeError("no run in flight: submit one first")
        on_stream = stream is not None and self.device == "gpu"
        with self._failures(self._pending[0][0]):
            (out,) = self._pipe.outputs(cuda_stream=stream) if on_stream else self._pipe.outputs()
        # its bytes stay referenced one run more: DALI may read fed memory until its outputs are consumed
        self._consumed = self._pending.popleft()
        return out

    @property
    def in_flight(self) -> int:
        """Runs submitted and not yet collected."""
        return len(self._pending)

    def forget_last_run(self) -> None:
        """With no run in flight: let the last collected run's bytes go (DALI's host stages read them before its
        outputs came; `collect` keeps them one run more only because a next run may follow at once)."""
        if not self._pending:
            self._consumed = None

    @property
    def idle(self) -> bool:
        """Built, open and with no run in flight: it can run again for another accelerator as it is."""
        return not self._closed and self._pipe is not None and not self._pending

    @property
    def graph_nodes(self) -> int | None:
        """The DALI operators of the built pipeline (conditionals' splits and merges included): what
        DALI's `Run` walks in the calling thread every run, whatever its size. None while there is no
        pipeline (closed, or discarded after a failed run until the next submit rebuilds it)."""
        return None if self._pipe is None else len(self._pipe._ops)

    @contextlib.contextmanager
    def _failures(self, indices):
        """DALI's errors as ours; the pipeline is discarded (and the runs in flight with it). `indices`: the run's
        samples, or None for the sizing run (`_sizing_run`), whose failure other than memory retires the accelerator:
        DALI cannot run a JPEG made here, so it would fail again after every rebuild."""
        what = f"samples {list(indices)}" if indices is not None else "its first run (copies of a small JPEG)"
        try:
            yield
        except (MemoryError, RuntimeError) as exc:  # DALI reports decode faults as RuntimeError, unusable after
            self._discard()
            if isinstance(exc, MemoryError) or OUT_OF_MEMORY.search(str(exc)):
                raise DeviceOutOfMemory(f"DALI ran out of memory on {what} ({self.device}): {last_line(exc)}") from exc
            if indices is None:
                raise AcceleratorError(f"DALI could not run {what}: {last_line(exc)}") from exc
            raise DecodeError(
                f"DALI could not process {what} (one is likely corrupt or truncated): {last_line(exc)}"
            ) from exc

    def reset(self) -> None:
        """Drop the pipeline and the runs in flight (after a failure outside DALI); the next submit rebuilds."""
        self._discard()

    def _discard(self) -> None:
        """Shut down DALI's pipeline now (a failed one is never run again; the next run rebuilds)."""
        pipe, self._pipe = self._pipe, None
        shutdown(pipe)  # before the fed bytes are let go
        self._pending.clear()
        self._consumed = None

    def close(self) -> None:
        """Shut DALI's pipeline down now (its threads, streams and memory), not whenever the last
        reference goes. Idempotent; the pipeline cannot run after."""
        self._closed = True
        self._discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_bytes_as_u8 = functools.partial(np.frombuffer, dtype=np.uint8)


def _check_args(batch_size: int, device: str, device_id: int | None) -> None:
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device={device!r} must be 'cpu' or 'gpu'")
    if device == "gpu" and device_id is None:
        raise ValueError("device='gpu' needs a device_id (the CUDA device index)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")


def _policy_graph(policy: Policy, device: str, augment, layout: HostLayout, decoder: dict):
    """The pipeline definition (DALI's `pipeline_def`): feed -> decode+crop -> resize -> flip ->
    `augment` (the op slots) -> normalize or transpose to CHW -> erase. Two inputs (three when erasing
    with noise): the encoded bytes and each sample's packed host row (`layout`). `decoder`: more arguments of the
    decoder. It holds plain values, never the DaliPolicyPipeline: DALI keeps the graph as long as its pipeline."""
    from nvidia.dali import fn, pipeline_def, types

    out_h, out_w = policy.size
    normalize, erase = policy.normalize, policy.erase

    @pipeline_def(enable_conditionals=True)
    def graph():
        # read in place: DaliPolicyPipeline keeps each run's bytes referenced until the run is collected
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, no_copy=True)
        host = fn.external_source(name="host", dtype=types.FLOAT, ndim=1)
        part = lambda name: host[slice(*layout.span(name))]  # noqa: E731
        images = fn.decoders.image_slice(
            encoded,
            part("anchor"),
            part("shape"),
            device="mixed" if device == "gpu" else "cpu",
            output_type=types.RGB,
            normalized_anchor=False,
            normalized_shape=False,
            axis_names="WH",
            adjust_orientation=False,
            **decoder,
        )
        images = fn.resize(images, resize_x=out_w, resize_y=out_h, interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.flip(images, horizontal=fn.cast(host[layout.span("flip")[0]], dtype=types.INT32))
        images = augment(images, host)
        if normalize:
            mean, std = normalize
            images = fn.crop_mirror_normalize(
                images,
                dtype=types.FLOAT,
                output_layout="CHW",
                mean=[255.0 * m for m in mean],
                std=[255.0 * s for s in std],
            )
        else:
            images = fn.transpose(images, perm=[2, 0, 1], output_layout="CHW")
        if erase is not None:
            images = erase_fragment(images, erase, device, part("erase_anchor"), part("erase_shape"))
        return images

    return graph
