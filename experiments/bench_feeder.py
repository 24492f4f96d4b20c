"""Issue 41's feeder bar: what the accelerator costs the training process per sample it runs, and how
many Python calls a DALI run takes there (required: <= 20 us a sample, calls per run independent of
the run's size; goal <= 10 us).

DALI's CPU backend stands in for the GPU. A FusionFlowLoader with `--workers` CPU workers and
`DaliAccelerator("cpu", threads=1)` runs RandAugment over an in-memory set of `--images` JPEGs for
`--epochs` epochs at each batch size (a run holds at most one mini-batch's share; the CPU workers'
reads take `--worker-delay-ms` longer, so the accelerator's share approaches the whole mini-batch and
its runs the batch size: the sizes the bar names); the first epoch is
untimed (header sizes are read once per loader, then kept: later epochs are the steady state).
Reported per batch size, over the timed epochs:
  feed_us_per_sample    CPU time of the training process's accelerator thread over the samples DALI
                        ran (thread time: what it takes from the training loop's cores and GIL)
  land_us_per_sample    of that, landing DALI's outputs in the batch ring: on the CPU backend a host copy of
                        the pixels (~150 KB a sample at 224 px), on a GPU a device copy the thread only issues
  inputs_us_per_sample  CPU time of the accelerator's input helper process (reads, header sizes, draws,
                        windows, op parameters: moved out of the training process, not hidden)
  calls_per_run         Python and C function calls the accelerator thread makes per DALI run, counted
                        by a profile hook in a second pass (the hook slows the thread, so the first
                        pass times it without one), and calls per sample with it; work_calls_per_run: of
                        those, the ones inside the run's own submit and collect (the rest: the loop's take
                        attempts and wake-ups while a run is in flight, more the longer a run takes)
  samples_per_run       the runs' mean size
With `--tiny` the images are 32 px (still 224 px out: the policy's size, resized up and landed): DALI's
decoding shrinks and the 2-core machine is less saturated, so thread times are more the feeder's than
contention's. With `--files` the set is JPEG files read as fusionflow.ImageFolder reads them (open, read,
close per sample), not bytes in memory: what reading costs whoever reads (the CPU workers' delay still
applies). With `--step-us` the training loop sleeps that long per image: training is the bottleneck,
the loader runs ahead and nobody waits for a run in flight, as
on a GPU-bound training (by default training waits for every run). Medians over `--rounds`.

    .venv/bin/python -m experiments.bench_feeder [--batch-sizes 32,256] [--tiny] [--files] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from experiments.harness import provenance, result_path, write_json
from fusionflow.datasets.folder import ImageFolder
from fusionflow.tools.synthetic import EncodedImages

THREAD = "fusionflow-accelerator"  # the accelerator thread's name (accel/accelerator.py)
LOOP, WORK_STEPS = os.path.join("accel", "accelerator.py"), ("_submit", "_collect")  # a run's own steps


class CallCounter:
    """A profile hook counting the calls of the accelerator thread only: installed for every thread
    started after `install`, it removes itself from any thread of another name at its first event. `work`
    counts those made inside a run's submit or collect (accel/accelerator.py's loop steps, told by their code
    names); the rest are the loop's own: take attempts and wake-ups while runs are in flight, whose number
    follows how long a run takes (the board's events meanwhile), not its samples."""

    def __init__(self):
        self.calls = self.work = 0
        self._depth = 0  # submit/collect frames open

    def hook(self, frame, event, arg):
        if threading.current_thread().name != THREAD:
            sys.setprofile(None)
            return
        if event in ("call", "c_call"):
            self.calls += 1
            self.work += self._depth > 0
            if event == "call" and frame.f_code.co_name in WORK_STEPS and frame.f_code.co_filename.endswith(LOOP):
                self._depth += 1
        elif event == "return" and frame.f_code.co_name in WORK_STEPS and frame.f_code.co_filename.endswith(LOOP):
            self._depth -= 1

    def install(self):
        threading.setprofile(self.hook)

    def remove(self):
        threading.setprofile(None)


def in_cpu_worker() -> bool:
    """In one of the loader's CPU worker processes (they set DataLoader's worker info; the training process and
    the accelerator's input helpers do not)."""
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None


class SlowInWorkers(EncodedImages):
    """EncodedImages whose reads take `delay` seconds longer in a CPU worker: the CPU workers are slowed, so
    the split rule gives the accelerator (read by its input helpers, or the training process) most of each
    mini-batch and its runs approach the batch size."""

    def __init__(self, data, delay: float):
        super().__init__(data, classes=1000)
        self.delay = delay

    def __getitem__(self, i):
        if self.delay and in_cpu_worker():
            time.sleep(self.delay)
        return super().__getitem__(i)

    def __getitems__(self, indices):  # the batched read, kept (EncodedImages reads a subclass item by item)
        if self.delay and in_cpu_worker():
            time.sleep(self.delay * len(indices))
        return [(self.data[i], i % self.classes) for i in indices]


class SlowFolder(ImageFolder):
    """The set as files read as fusionflow.ImageFolder reads them (open, read, close: what a real dataset costs
    whoever reads it), slowed in the CPU workers as SlowInWorkers is."""

    def __init__(self, root: str, delay: float):
        super().__init__(root)
        self.delay = delay

    def __getitem__(self, i):
        if self.delay and in_cpu_worker():
            time.sleep(self.delay)
        return super().__getitem__(i)


def one_pass(data, args, batch_size: int, counter: CallCounter | None) -> dict:
    from fusionflow import DaliAccelerator, FusionFlowLoader

    if counter is not None:  # for every thread the loader starts (the accelerator's starts with the first epoch)
        counter.install()
    delay = args.worker_delay_ms * 1e-3
    loader = FusionFlowLoader(
        SlowFolder(data, delay) if isinstance(data, str) else SlowInWorkers(data, delay),
        batch_size=batch_size,
        shuffle=True,
        num_workers=args.workers,
        policy="randaugment",
        persistent_workers=True,
        drop_last=True,
        tiny_batch_size=4,
        accelerator=DaliAccelerator("cpu", threads=1),
    )
    try:
        for _ in loader:  # epoch 1: pipelines warm, every header read once
            pass
        before, calls0, work0 = dict(vars(loader.stats)), *((counter.calls, counter.work) if counter else (0, 0))
        for _ in range(args.epochs - 1):
            for x, _ in loader:
                time.sleep(args.step_us * 1e-6 * len(x))  # a training step (GIL released), 0 by default
        after = dict(vars(loader.stats))
    finally:
        loader.close()
        if counter is not None:
            counter.remove()
    grew = {k: after[k] - before[k] for k in ("accelerator_samples", "accelerator_runs", "samples")}
    samples, runs = grew["accelerator_samples"], grew["accelerator_runs"]
    row = {
        "samples": samples,
        "runs": runs,
        "share": samples / max(1, grew["samples"]),
        "samples_per_run": samples / max(1, runs),
    }
    if counter is None:
        feed = after["accelerator_feed_cpu_seconds"] - before["accelerator_feed_cpu_seconds"]
        inputs = after["accelerator_inputs_cpu_seconds"] - before["accelerator_inputs_cpu_seconds"]
        land = after["accelerator_land_cpu_seconds"] - before["accelerator_land_cpu_seconds"]
        per = 1e6 / max(1, samples)
        row.update(feed_us_per_sample=feed * per, land_us_per_sample=land * per, inputs_us_per_sample=inputs * per)
    else:
        calls, work = counter.calls - calls0, counter.work - work0
        row.update(
            calls_per_run=calls / max(1, runs),
            calls_per_sample=calls / max(1, samples),
            work_calls_per_run=work / max(1, runs),
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="32,256")
    ap.add_argument("--images", type=int, default=1024, help="JPEGs in the set (one epoch)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per pass, the first untimed")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker-delay-ms", type=float, default=20.0, help="added to each read in a CPU worker")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="32 px images: less of DALI's decoding")
    ap.add_argument(
        "--step-us", type=float, default=0.0, help="training step's sleep per image: > 0 lets the loader run ahead"
    )
    ap.add_argument(
        "--files", action="store_true", help="the set as JPEG files on disk (read per sample), not in memory"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from experiments.harness import mixed_jpegs
    from fusionflow.tools.synthetic import make_jpegs

    data = make_jpegs(args.images, 32, 33, seed=1) if args.tiny else mixed_jpegs(args.images)
    result = {**provenance(), "args": vars(args), "batch_sizes": {}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench_feeder_") as root:
        if args.files:
            os.makedirs(os.path.join(root, "c0"))
            for i, jpeg in enumerate(data):
                with open(os.path.join(root, "c0", f"{i:06d}.jpg"), "wb") as f:
                    f.write(jpeg)
        measure(root if args.files else data, args, result)
    name = "bench_feeder" + ("_tiny" if args.tiny else "") + ("_files" if args.files else "")
    write_json(result, result_path(args.out, name + ".json"))


def measure(data, args, result: dict) -> None:
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        timed = [one_pass(data, args, bs, None) for _ in range(args.rounds)]
        counted = one_pass(data, args, bs, CallCounter())
        med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
        med.update({k: counted[k] for k in ("calls_per_run", "calls_per_sample", "work_calls_per_run")})
        result["batch_sizes"][bs] = {"timed": timed, "counted": counted, "median": med}
        result["rows"].append({"batch_size": bs, **med})  # in --batch-sizes order (paired_trees reads the first)
        print(
            f"batch {bs}: {med['samples_per_run']:.0f} samples per run, share {med['share']:.2f}; feeding thread "
            f"{med['feed_us_per_sample']:.1f} us/sample ({med['land_us_per_sample']:.1f} landing), "
            f"input helper {med['inputs_us_per_sample']:.1f} us/sample; "
            f"{med['calls_per_run']:.0f} calls per run ({med['calls_per_sample']:.1f} per sample; "
            f"{med['work_calls_per_run']:.0f} in its submit and collect, the rest the loop's waits)",
            flush=True,
        )


if __name__ == "__main__":
    main()
