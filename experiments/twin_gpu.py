"""Issue 41's machinery at GPU rates, on the CPU: a timed twin of the device.

The H100 run (experiments/README.md, "GPU benchmarks") left FusionFlow CPU + GPU at 0.50x DALI alone,
and a GPU is lent rarely. What the loader's own machinery -- the split rule, the board, the accelerator
thread's runs, merges, depth and tail runs, the ring -- makes of GPU-like rates can be measured without
one: everything here is the real FusionFlowLoader except the two things a GPU does, which are timed.

  the device   one timeline (`DeviceClock`) that training steps and DALI runs queue on, in the order
               they are issued; the issue's model treats their device times as additive, and so does this
  training     each step occupies the device `--train-us` per image and the host waits for it (a step
               that synchronises at its loss)
  DALI         `TimedPipeline` stands in for DaliPolicyPipeline: a run of n samples occupies the device
               `--run-ms` + n * `--sample-us` (a run's fixed cost and its per-sample cost), at most
               DALI's depth of runs in flight; its outputs are zeros (pixels are not what is measured);
               with `--run-latency-ms` L a run's device work starts no earlier than L after its submit
               (DALI's host stages -- its threads' decoding, its launches -- which overlap across the
               runs it holds: on an H100 two runs in flight completed at about twice one run's rate)
  CPU workers  real worker processes on tiny images (32 px in, 16 px out), each read slowed by
               `--worker-delay-ms`: `--workers` of them make the CPU side's rate (measured, not assumed)

Candidates, interleaved rounds, medians:
  dali_alone   DALI's own loop: a run of a whole mini-batch per iteration, `DALI_PREFETCH` runs ahead,
               the training step after each
  ff_cpu       FusionFlowLoader, CPU workers only, the training step after each mini-batch
  ff_twin      FusionFlowLoader, CPU workers + accelerator="dali-cpu" running `TimedPipeline`, with the
               split rule told that DALI shares the training's device (as it does on a GPU); one
               candidate ff_twin_dK per K of `--runs-in-flight` (DaliAccelerator(runs_in_flight=K))
and the model's bound for ff_twin from the measured ff_cpu rate c: the best G of a mini-batch of B,
    period(G) = max(t*B + f*runs + G*g, (B - G) / c),     R = B / min over G of period(G)
with runs = 1/MERGE where MERGE shares fit in a run of 256 (else one run or more per share), and DALI
alone's B / (t*B + f + B*g).
With `--overlap F` a fraction F of each DALI run's device time runs beside training's kernels (spatial
sharing fills what training leaves idle) and only the rest delays training, while the run still takes its
whole time to complete: the model's DALI term in training's way is then (1 - F)(f*runs + G*g), and its own
stream's f*runs + G*g must also fit the period. The split rule then reads a run's completion time as more
device time than training lost to it, and so training's own time per sample as less than it is.
Defaults: the H100 figures of issue 41 (ResNet-18's 86 us/img; DALI alone without training 10,283
img/s at runs of 256, taken as 10 ms a run + 58 us a sample; ~450 img/s per CPU worker).

    .venv/bin/python -m experiments.twin_gpu [--workers 4] [--batch-size 256] [--rounds 5]
        [--run-latency-ms 20 --runs-in-flight 2,3]
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import threading
import time
from collections import deque

import numpy as np

from experiments.bench_feeder import SlowInWorkers
from experiments.harness import provenance, result_path, rotation, write_json
from fusionflow.accel.config import RUN_SAMPLES

RUN_IMAGES = RUN_SAMPLES  # the accelerator's samples per DALI run at most (DaliAccelerator.run_samples' default)

DALI_PREFETCH = 2  # DALI alone's runs queued ahead of the one training takes (its iterators' default)
POLICY = {  # a light policy: the CPU workers' own work is small beside the delay that sets their rate
    "output": {"size": 16},
    "flip": 0.5,
    "crop": {"scale": [0.3, 1.0]},
    "augment": {
        "type": "rand",
        "num_ops": 2,
        "magnitude": 5,
        "num_bins": 11,
        "ops": {"Rotate": {"range": [0, 30], "signed": True}, "Posterize": {"range": [8, 4]}, "Equalize": {}},
    },
}


class DeviceClock:
    """One device's timeline: work occupies it in the order it is issued, except that work which may not start
    yet (`not_before`: a DALI run's host stages) leaves the time before it to work issued later (another
    stream's: training's steps), as a GPU runs kernels of several streams. Work of one stream passes its
    last end as `not_before` (the first gap that fits could lie before it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list = []  # (start, end) of the work queued, sorted
        self.busy = 0.0  # seconds of work issued

    def occupy(self, seconds: float, not_before: float = 0.0) -> float:
        """Queue `seconds` of work in the first gap from `not_before` (and now) on; returns when it ends."""
        with self._lock:
            now = time.monotonic()
            self._spans = [span for span in self._spans if span[1] > now]
            start = max(now, not_before)
            for a, b in self._spans:
                if start + seconds <= a:
                    break
                start = max(start, b)
            bisect.insort(self._spans, (start, start + seconds))
            self.busy += seconds
            return start + seconds

    def run(self, seconds: float, not_before: float, overlap: float = 0.0) -> float:
        """A DALI run of `seconds` on the device, of which the fraction `overlap` runs beside other streams' work
        (spatial sharing: its kernels fill what training's leave idle) and only the rest occupies the timeline;
        returns when the whole run is done."""
        return self.occupy((1 - overlap) * seconds, not_before) + overlap * seconds


def wait_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


class TimedOutput:
    def __init__(self, array):
        self.array = array

    def as_tensor(self):
        return self.array


def timed_pipeline(
    clock: DeviceClock, run_s: float, sample_s: float, runs: list, latency_s: float = 0.0, overlap: float = 0.0
):
    """A stand-in class for DaliPolicyPipeline (the interface the accelerator thread uses) whose runs
    occupy `clock` in order (one DALI stream), each from `latency_s` after its submit at the earliest; every run's
    size is appended to `runs`."""
    from fusionflow.policy import load_policy

    class TimedPipeline:
        def __init__(self, policy, batch_size, device="cpu", device_id=None, num_threads=1, depth=2, **_):
            size = load_policy(policy).size
            self.batch_size, self.depth = batch_size, depth
            self.zeros = np.zeros((batch_size, 3, *size), np.uint8)  # size: (height, width)
            self.pending: deque = deque()
            self.build_seconds, self.rebuilds, self.sized_at = 0.0, 0, 0.0
            self.last_end = 0.0  # when the last run submitted ends: the next starts after it

        def submit(self, samples, indices, seed=0, epoch=0, copies=None, sizes=None, columns=None, keep=None):
            n = len(samples)  # `keep` (the helpers' byte slot) is held by the caller's run, as DALI's would be
            if not 1 <= n <= self.batch_size or len(self.pending) >= self.depth:
                raise RuntimeError(f"run of {n} with {len(self.pending)} in flight")
            runs.append(n)
            self.last_end = clock.run(run_s + n * sample_s, max(time.monotonic() + latency_s, self.last_end), overlap)
            self.pending.append((n, self.last_end))

        def collect(self, stream=None):
            n, end = self.pending.popleft()
            wait_until(end)
            return TimedOutput(self.zeros[:n])

        @property
        def in_flight(self):
            return len(self.pending)

        @property
        def idle(self):  # no run in flight: the loader may keep it for the next epoch (accel/at_exit.py)
            return not self.pending

        def forget_last_run(self):  # DaliPolicyPipeline's: it holds no run's bytes
            pass

        def reset(self):
            self.pending.clear()

        def close(self):
            self.pending.clear()

    return TimedPipeline


def dali_alone(
    clock: DeviceClock, batch: int, run_s: float, sample_s: float, latency_s: float = 0.0, overlap: float = 0.0
):
    """DALI's own loop: whole mini-batch runs, DALI_PREFETCH of them queued ahead of the one yielded."""
    ends: deque = deque()
    last = 0.0  # its runs in order, as on one stream
    while True:
        while len(ends) <= DALI_PREFETCH:
            last = clock.run(run_s + batch * sample_s, max(time.monotonic() + latency_s, last), overlap)
            ends.append(last)
        wait_until(ends.popleft())
        yield batch


def ff_loader(data, args, clock=None, runs=None, depth: int = 2):
    """The FusionFlowLoader; with `clock`, its accelerator runs TimedPipeline on it, `depth` runs in flight."""
    import fusionflow.accel.dali_graph as dali_graph
    import fusionflow.scheduling.split as split
    from fusionflow import DaliAccelerator, FusionFlowLoader

    kw = {}
    if clock is not None:
        kw["accelerator"] = DaliAccelerator("cpu", threads=1, runs_in_flight=depth)
    real_pipeline, real_controller = dali_graph.DaliPolicyPipeline, split.ShareController
    if clock is not None:  # the stand-ins are picked up while the loader builds its accelerator
        dali_graph.DaliPolicyPipeline = timed_pipeline(
            clock, args.run_ms * 1e-3, args.sample_us * 1e-6, runs, args.run_latency_ms * 1e-3, args.overlap
        )
        split.ShareController = lambda **k: real_controller(**{**k, "shares_device": True})
    try:
        loader = FusionFlowLoader(
            SlowInWorkers(data, args.worker_delay_ms * 1e-3),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            policy=POLICY,
            persistent_workers=True,
            drop_last=True,
            tiny_batch_size=args.tiny_batch_size,
            prefetch_factor=args.prefetch,
            **kw,
        )
        it = iter(loader)
        next(it)  # the accelerator (built lazily at the first epoch) exists from here
    finally:
        dali_graph.DaliPolicyPipeline, split.ShareController = real_pipeline, real_controller

    def batches():
        nonlocal it
        while True:
            for x, _ in it:
                yield len(x)
            it = iter(loader)

    return loader, batches()


def model(args, cpu_rate: float) -> dict:
    """The issue's additive model: DALI alone's rate, and the best FusionFlow rate over G."""
    b, t, f, g = args.batch_size, args.train_us * 1e-6, args.run_ms * 1e-3, args.sample_us * 1e-6

    o = args.overlap  # the part of DALI's device time beside training's, not in its way (its stream's still)

    def period(share):
        # a run holds up to `merge` whole shares within RUN_IMAGES samples (the accelerator's cap)
        runs = 1 / args.merge if share * args.merge <= RUN_IMAGES else math.ceil(share / RUN_IMAGES)
        dali = (f * runs if share else 0.0) + share * g
        return max(t * b + (1 - o) * dali, dali, (b - share) / cpu_rate)

    best = min(range(b + 1), key=period)
    alone = max(t * b + (1 - o) * (f + b * g), f + b * g)
    return {"dali_alone": b / alone, "ff_bound": b / period(best), "ff_best_share": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--tiny-batch-size", type=int, default=4)
    ap.add_argument("--train-us", type=float, default=86.0, help="training step's device time per image")
    ap.add_argument("--run-ms", type=float, default=10.0, help="a DALI run's fixed device time")
    ap.add_argument("--sample-us", type=float, default=58.0, help="a DALI run's device time per sample")
    ap.add_argument("--run-latency-ms", type=float, default=0.0, help="a DALI run's host stages before its device work")
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        help="the fraction of a DALI run's device time spent beside training's work rather than in its way",
    )
    ap.add_argument("--runs-in-flight", default="2", help="the accelerator's runs in flight: one candidate per value")
    ap.add_argument("--worker-delay-ms", type=float, default=2.0, help="added to each read in a CPU worker")
    ap.add_argument("--merge", type=int, default=2, help="mini-batch shares a run holds (the model's)")
    ap.add_argument("--prefetch", type=int, default=None, help="the loaders' prefetch_factor (default: theirs)")
    ap.add_argument("--batches", type=int, default=40, help="timed mini-batches per round and candidate")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=2048, help="distinct 32 px JPEGs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from fusionflow.tools.synthetic import make_jpegs

    data = make_jpegs(args.images, 32, 33, seed=1)
    clock, depths = DeviceClock(), list(dict.fromkeys(int(k) for k in args.runs_in_flight.split(",")))
    y_loader, y = ff_loader(data, args)
    runs = {f"ff_twin_d{k}": [] for k in depths}  # each candidate's run sizes
    twins = {name: ff_loader(data, args, clock, runs[name], k) for name, k in zip(runs, depths)}
    latency_s = args.run_latency_ms * 1e-3
    streams = {
        "dali_alone": dali_alone(
            clock, args.batch_size, args.run_ms * 1e-3, args.sample_us * 1e-6, latency_s, args.overlap
        )
    }
    streams.update(ff_cpu=y, **{name: batches for name, (_, batches) in twins.items()})
    step_s = args.train_us * 1e-6 * args.batch_size
    rates: dict = {k: [] for k in streams}
    accel: dict = {name: [] for name in twins}
    try:
        for r in range(args.rounds):
            for name in rotation(streams, r):
                s = streams[name]
                for _ in range(3):  # what it banked while the others ran
                    next(s)
                    wait_until(clock.occupy(step_s))
                x_loader = twins[name][0] if name in twins else None
                st = x_loader.stats if x_loader is not None else None
                before = (st.samples, st.accelerator_samples, len(runs[name])) if st is not None else None
                t0, images = time.monotonic(), 0
                for _ in range(args.batches):
                    images += next(s)
                    wait_until(clock.occupy(step_s))
                rates[name].append(images / (time.monotonic() - t0))
                if x_loader is not None:
                    done = runs[name][before[2] :]
                    accel[name].append(
                        {
                            "share": (st.accelerator_samples - before[1]) / max(1, st.samples - before[0]),
                            "samples_per_run": sum(done) / max(1, len(done)),
                        }
                    )
                print(f"round {r + 1}/{args.rounds}: {name} {rates[name][-1]:.0f} img/s", flush=True)
    finally:
        for loader, _ in twins.values():
            loader.close()
        y_loader.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    bound = model(args, med["ff_cpu"])  # the additive model: device time only (no run latency)
    print(f"DALI alone {med['dali_alone']:.0f} (model {bound['dali_alone']:.0f}), FF CPU {med['ff_cpu']:.0f}")
    for name in twins:
        share = statistics.median(a["share"] for a in accel[name])
        per_run = statistics.median(a["samples_per_run"] for a in accel[name])
        print(
            f"{name}: FF CPU + twin {med[name]:.0f} img/s: {med[name] / med['dali_alone']:.2f}x DALI alone, "
            f"{med[name] / bound['ff_bound']:.2f} of the model's bound {bound['ff_bound']:.0f} (its share "
            f"{bound['ff_best_share']} of {args.batch_size}); the accelerator took {share:.0%} in runs of {per_run:.0f}"
        )
    result = {
        "benchmark": "twin_gpu",
        "args": vars(args),
        "provenance": provenance(),
        "rates": rates,
        "medians": med,
        "model": bound,
        "accelerator": accel,
        "ff_over_dali_alone": {name: med[name] / med["dali_alone"] for name in twins},
        "ff_over_bound": {name: med[name] / bound["ff_bound"] for name in twins},
    }
    write_json(result, result_path(args.out, "twin_gpu.json"))


if __name__ == "__main__":
    main()
