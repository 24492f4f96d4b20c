"""Issue 41's lead: DALI 2.4's dynamic API (`nvidia.dali.experimental.dynamic`) as the accelerator's
engine. Does a run whose operators are called eagerly, each op once on the sub-batch of samples that
drew it, cost less than a pipeline graph that carries every op of the policy behind conditionals?

DALI's CPU backend, one DALI thread, one process; per batch size, rounds interleaved, medians:
  graph    DALI's own auto_aug RandAugment (n=2, m=9) pipeline (experiments/gpu_bench.py dali_batches:
           external source of the encoded bytes, random-crop decode, resize 224, flip, RandAugment),
           prefetch as DALI's iterators run it: img/s
  dynamic  the same steps as dynamic calls: decode with a random crop window, resize 224, flip, then
           per RandAugment layer the 14 ops drawn per sample (numpy), each drawn op applied once to the
           sub-batch that drew it, the layer's outputs put back in sample order: img/s, the calling
           thread's and the process's CPU time per sample, and DALI calls per run (on the CPU backend the dynamic API's
           operators compute on the calling thread, the graph's on DALI's: that CPU time is comparable
           only with --tiny, where little is computed)
On tiny images (32 px in, 16 px out, `--tiny`) the work per pixel vanishes and what is left is each engine's fixed
cost: per run for the graph, per call for the dynamic API -- the figure a GPU run pays on its host
side whatever the GPU. The dynamic ops approximate RandAugment's (magnitudes as auto_aug's at m=9,
the same op set); a policy-exact engine would call the graph fragments of fusionflow/accel/dali_ops.py
through the dynamic API. This measures cost, not pixels.

    .venv/bin/python -m experiments.dali_dynamic [--batch-sizes 4,32,256] [--images 256] [--rounds 5] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from experiments.harness import provenance, result_path, rotation, write_json

OPS = (
    "Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Contrast",
    "Color", "Sharpness", "Posterize", "Solarize", "Equalize", "AutoContrast",
)  # fmt: skip
M = 9 / 30  # auto_aug's magnitude 9 of 30 bins
WARM_RUNS = 5  # untimed dynamic runs first: the first call of an op at a new batch size builds its instance


class Counting:
    """The dynamic API's namespace, counting the operator calls a run makes (explicit ones: arithmetic
    on batches, `a * b`, runs DALI arithmetic operators besides, not counted)."""

    def __init__(self, ndd):
        self.ndd, self.calls = ndd, 0

    def __getattr__(self, name):
        target = getattr(self.ndd, name)
        if not callable(target) or name in ("as_batch", "as_tensor"):
            return target

        def call(*a, **k):
            self.calls += 1
            return target(*a, **k)

        return call


def _affine(op: str, signs: np.ndarray, size: int) -> np.ndarray:
    """Per-sample 2x3 output->input matrices about the image centre."""
    n, c = len(signs), size / 2
    mats = np.tile(np.array([[1, 0, 0], [0, 1, 0]], np.float32), (n, 1, 1))
    if op == "ShearX":
        mats[:, 0, 1] = 0.3 * M * signs
        mats[:, 0, 2] = -mats[:, 0, 1] * c
    elif op == "ShearY":
        mats[:, 1, 0] = 0.3 * M * signs
        mats[:, 1, 2] = -mats[:, 1, 0] * c
    elif op == "TranslateX":
        mats[:, 0, 2] = 0.45 * size * M * signs
    elif op == "TranslateY":
        mats[:, 1, 2] = 0.45 * size * M * signs
    else:  # Rotate, 30 degrees at full magnitude
        a = np.deg2rad(30 * M) * signs
        cos, sin = np.cos(a), np.sin(a)
        mats[:, 0, 0], mats[:, 0, 1], mats[:, 1, 0], mats[:, 1, 1] = cos, -sin, sin, cos
        mats[:, 0, 2] = c - cos * c + sin * c
        mats[:, 1, 2] = c - sin * c - cos * c
    return mats


def apply_op(d, types, op: str, imgs, signs: np.ndarray, size: int):
    """One op on a sub-batch (`d`: the counting namespace); per-sample parameters as batches."""
    per = lambda values: d.as_batch([np.float32(v) for v in values])  # noqa: E731
    if op == "Identity":
        return imgs
    if op in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
        mats = d.as_batch(list(_affine(op, signs, size)))
        return d.warp_affine(imgs, matrix=mats, fill_value=128.0, inverse_map=True)
    if op == "Brightness":
        return d.brightness(imgs, brightness=per(1 + 0.9 * M * signs))
    if op == "Contrast":
        return d.contrast(imgs, contrast=per(1 + 0.9 * M * signs))
    if op == "Color":
        return d.saturation(imgs, saturation=per(1 + 0.9 * M * signs))
    if op == "Sharpness":
        kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
        blurred = d.filter(imgs, kernel, border="clamp", dtype=types.FLOAT)
        f = d.cast(imgs, dtype=types.FLOAT)
        return d.cast(d.math.clamp(blurred + per(1 + 0.9 * M * signs) * (f - blurred), 0.0, 255.0), dtype=types.UINT8)
    if op == "Posterize":
        step = float(2 ** (8 - (8 - round(4 * M))))
        return d.cast(d.math.floor(d.cast(imgs, dtype=types.FLOAT) / step) * step, dtype=types.UINT8)
    if op == "Solarize":
        f = d.cast(imgs, dtype=types.FLOAT)
        t = 256.0 - 256.0 * M
        return d.cast(f + (f >= t) * (255.0 - 2.0 * f), dtype=types.UINT8)
    if op == "Equalize":
        return d.equalize(imgs)
    lo = d.reductions.min(imgs, axes=[0, 1])  # AutoContrast, per channel
    hi = d.reductions.max(imgs, axes=[0, 1])
    f, lo_f = d.cast(imgs, dtype=types.FLOAT), d.cast(lo, dtype=types.FLOAT)
    span = d.math.max(d.cast(hi, dtype=types.FLOAT) - lo_f, 1.0)
    return d.cast(d.math.clamp((f - lo_f) * (255.0 / span), 0.0, 255.0), dtype=types.UINT8)


def dynamic_run(d, types, encoded: list, rng: np.random.Generator, size: int):
    """One run: the whole batch through decode, crop, resize to `size`, flip and two RandAugment layers."""
    n = len(encoded)
    enc = d.as_batch([np.frombuffer(b, np.uint8) for b in encoded])
    imgs = d.decoders.image_random_crop(enc, device="cpu", output_type=types.RGB)
    imgs = d.resize(imgs, resize_x=size, resize_y=size, antialias=True)
    imgs = d.flip(imgs, horizontal=d.as_batch([np.int32(v) for v in rng.integers(0, 2, n)]))
    for _layer in range(2):
        drawn = rng.integers(0, len(OPS), n)
        signs = rng.choice(np.float32([-1, 1]), n)
        tensors = imgs.tensors
        out = [None] * n
        for k in np.unique(drawn):
            idx = np.flatnonzero(drawn == k).tolist()
            sub = d.as_batch([tensors[i] for i in idx]) if len(idx) < n else imgs
            res = apply_op(d, types, OPS[k], sub, signs[idx], size).tensors
            for j, i in enumerate(idx):
                out[i] = res[j]
        imgs = d.as_batch(out)
    imgs.evaluate()
    return imgs


def time_dynamic(data: list, batch_size: int, batches: int, seed: int, size: int) -> dict:
    import nvidia.dali.experimental.dynamic as ndd
    from nvidia.dali import types

    d, rng = Counting(ndd), np.random.default_rng(seed)
    for _ in range(WARM_RUNS):  # operator instances made (per op and sub-batch shape), as a warm engine's are
        dynamic_run(d, types, [data[j % len(data)] for j in range(batch_size)], rng, size)
    d.calls = 0

    def runs():
        for b in range(batches):  # the samples cycle through the set, as the graph's source does
            dynamic_run(d, types, [data[(b * batch_size + j) % len(data)] for j in range(batch_size)], rng, size)

    return {**timed_runs(runs, batch_size * batches), "calls_per_run": d.calls / batches}


def timed_runs(go, n: int) -> dict:
    """`go()` timed: img/s over `n` images, and CPU per image of the calling thread and of the process."""
    wall, cpu, every = time.perf_counter(), time.thread_time(), time.process_time()
    go()
    wall, cpu, every = time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - every
    return {
        "img_per_s": n / wall,
        "thread_cpu_us_per_sample": 1e6 * cpu / n,
        "process_cpu_us_per_sample": 1e6 * every / n,
    }


def time_graph(data: list, batch_size: int, batches: int, size: int, device: str = "cpu", threads: int = 1) -> dict:
    """DALI alone (gpu_bench's `dali_batches`, its batches landed in torch tensors on `device`) over `batches`
    batches, after two untimed ones."""
    import torch

    from experiments.gpu_bench import dali_batches

    it = dali_batches(data, batch_size, torch.device(device), threads, batches + 2, size=size)
    next(it)  # built and primed
    next(it)

    def go():
        for _ in it:
            pass
        if device == "cuda":
            torch.cuda.synchronize()

    return timed_runs(go, batch_size * batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="4,32,256")
    ap.add_argument("--images", type=int, default=256, help="samples timed per candidate, round and batch size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="32 px images: the engines' fixed costs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import nvidia.dali.experimental.dynamic as ndd

    from fusionflow.tools.synthetic import make_jpegs, sample_set

    ndd.set_num_threads(1)
    data = make_jpegs(64, 32, 33, seed=1) if args.tiny else sample_set("imagenet", 64)
    size = 16 if args.tiny else 224
    result = {"args": vars(args), **provenance(), "batch_sizes": {}}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batches = max(2, math.ceil(args.images / bs))
        runs: dict = {"graph": [], "dynamic": []}
        for r in range(args.rounds):
            for name in rotation(runs, r):
                if name == "graph":
                    got = time_graph(data, bs, batches, size)
                else:
                    got = time_dynamic(data, bs, batches, r, size)
                runs[name].append(got)
                print(f"batch {bs}, round {r + 1}, {name}: {got}", flush=True)
        med = {name: {k: statistics.median(g[k] for g in got) for k in got[0]} for name, got in runs.items()}
        med["dynamic_over_graph"] = med["dynamic"]["img_per_s"] / med["graph"]["img_per_s"]
        result["batch_sizes"][bs] = {"runs": runs, "medians": med}
        print(f"batch {bs}: {med}", flush=True)
    path = result_path(args.out, "dali_dynamic" + ("_tiny" if args.tiny else "") + ".json")
    write_json(result, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
