"""Ahead-of-time DALI pipelines: one per op combination (the paper's design) vs one per policy with
per-sample conditionals (ours). Start-up time, memory, and throughput on a stream of tiny-batches.

  combos       one pipeline per ordered op pair (196 for RandAugment's 14 ops, N=2); each tiny-batch
               is split by the combination its samples drew and each part runs on its pipeline
  conditional  one pipeline; each sample's op slots select their op by DALI conditionals

Both consume the same host-side draws, so their outputs are identical (checked on every sample).

    .venv/bin/python -m experiments.bench_aot [--device cpu|gpu] [--tiny-batch-size 4] [--tiny-batches 150]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import warnings
from collections import defaultdict

import numpy as np

from experiments.harness import provenance, result_path, rounds, timed, write_json


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gpu_used_bytes() -> int | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return total - free
    except Exception:
        return None


def to_numpy(out, device):
    if device == "gpu":
        out = out.as_cpu()
    return [np.array(out[i]) for i in range(len(out))]


def fixed_ops_pipeline_class():
    """DaliPolicyPipeline for one op sequence, without conditionals: the paper's one pipeline per
    op combination. Every sample fed to it must draw exactly that sequence."""

    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.accel.dali_ops import DALI_IMPLS
    from fusionflow.policy import draw
    from fusionflow.policy.op_specs import NUM_PARAMS, OPS

    class FixedOpsPipeline(DaliPolicyPipeline):
        def __init__(self, policy, batch_size: int, fixed_ops: tuple[str, ...], **kw):
            self.fixed_ops = tuple(fixed_ops)
            # a sequence of magnitude-free ops consumes no parameters (DALI would prune the input)
            self.fixed_params = any(OPS[n].has_magnitude for n in self.fixed_ops)
            super().__init__(policy, batch_size, **kw)

        def slot_count(self) -> int:
            return len(self.fixed_ops)

        def op_graph(self, style):
            fixed, with_params = self.fixed_ops, self.fixed_params
            start = self.layout.span("params")[0]  # each slot's parameters in the packed host row

            def augment(images, host):
                for k, name in enumerate(fixed):
                    params = host[start + k * NUM_PARAMS : start + (k + 1) * NUM_PARAMS] if with_params else None
                    images = DALI_IMPLS[name](images, params, style)
                return images

            return augment

        def prepare(self, data, index, seed, epoch, what=None, copy=0, size=None):
            drawn = tuple(op.name for op in draw(self.policy, seed, epoch, index, copy).ops)
            if drawn != self.fixed_ops:
                raise ValueError(f"sample {index} draws {list(drawn)}, this pipeline runs {list(self.fixed_ops)}")
            return super().prepare(data, index, seed, epoch, what, copy, size)

    return FixedOpsPipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--tiny-batch-size", type=int, default=4)
    ap.add_argument("--tiny-batches", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    from fusionflow import load_policy
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.policy import draw
    from fusionflow.tools.synthetic import make_jpegs

    policy = load_policy(args.policy)
    if policy.augment.type != "rand":
        raise SystemExit("bench_aot compares designs for rand policies (fixed N ops per sample)")
    device_id = 0 if args.device == "gpu" else None
    names = [o.name for o in policy.augment.ops]
    combos = list(itertools.product(names, repeat=policy.augment.num_ops))
    tb = args.tiny_batch_size
    n = args.tiny_batches * tb
    data = make_jpegs(min(n, 200), 200, 1000, seed=21)
    samples = [(data[i % len(data)], i) for i in range(n)]
    print(f"{len(combos)} combinations, {n} samples in tiny-batches of {tb}, DALI on {args.device}")

    FixedOpsPipeline = fixed_ops_pipeline_class()

    t0 = time.perf_counter()
    warm = DaliPolicyPipeline("default", tb, device=args.device, device_id=device_id)  # DALI's one-time init
    library_init = time.perf_counter() - t0
    warm.run([samples[0][0]], [0])
    warm.close()
    rss0, gpu0, t0 = rss_bytes(), gpu_used_bytes(), time.perf_counter()
    conditional = DaliPolicyPipeline(policy, tb, device=args.device, device_id=device_id)
    cond_build = time.perf_counter() - t0
    cond_rss, cond_gpu = rss_bytes() - rss0, (gpu_used_bytes() - gpu0) if gpu0 is not None else None
    print(f"conditional: built in {cond_build:.2f} s, +{cond_rss / 2**20:.0f} MiB RSS")

    rss0, gpu0, t0 = rss_bytes(), gpu_used_bytes(), time.perf_counter()
    per_combo = {c: FixedOpsPipeline(policy, tb, c, device=args.device, device_id=device_id) for c in combos}
    combo_build = time.perf_counter() - t0
    combo_rss, combo_gpu = rss_bytes() - rss0, (gpu_used_bytes() - gpu0) if gpu0 is not None else None
    print(f"combos: {len(per_combo)} built in {combo_build:.2f} s, +{combo_rss / 2**20:.0f} MiB RSS")

    tiny = [samples[i : i + tb] for i in range(0, n, tb)]
    drawn = {i: tuple(op.name for op in draw(policy, 0, 0, i).ops) for _, i in samples}

    def run_conditional():
        outs = {}
        for t in tiny:
            for img, (_, i) in zip(to_numpy(conditional.run([d for d, _ in t], [i for _, i in t]), args.device), t):
                outs[i] = img
        return outs

    def run_combos():
        outs, runs = {}, 0
        for t in tiny:
            groups = defaultdict(list)
            for d, i in t:
                groups[drawn[i]].append((d, i))
            for combo, part in groups.items():
                res = per_combo[combo].run([d for d, _ in part], [i for _, i in part])
                runs += 1
                for img, (_, i) in zip(to_numpy(res, args.device), part):
                    outs[i] = img
        return outs, runs

    last = {}  # the outputs of the latest pass of each design

    def pass_conditional():
        last["conditional"] = run_conditional()

    def pass_combos():
        last["combos"], last["runs"] = run_combos()

    def report(r, seconds):
        rate = {k: n / v[-1] for k, v in seconds.items()}
        print(f"repeat {r + 1}: conditional {rate['conditional']:.0f} img/s, combos {rate['combos']:.0f} img/s")

    designs = {"conditional": timed(pass_conditional), "combos": timed(pass_combos)}
    seconds = rounds(designs, args.repeats, report=report)
    rates = {k: [n / t for t in v] for k, v in seconds.items()}
    a, b, runs = last["conditional"], last["combos"], last["runs"]
    identical = sum(np.array_equal(a[i], b[i]) for i in a)
    result = {
        "benchmark": "aot_designs",
        "device": args.device,
        "policy": args.policy,
        "tiny_batch_size": tb,
        "samples": n,
        "combinations": len(combos),
        "pipeline_runs_per_pass": {"conditional": len(tiny), "combos": runs},
        "build_seconds": {"conditional": cond_build, "combos": combo_build, "dali_library_init": library_init},
        "rss_bytes": {"conditional": cond_rss, "combos": combo_rss},
        "gpu_bytes": {"conditional": cond_gpu, "combos": combo_gpu},
        "img_per_s_median": {k: statistics.median(v) for k, v in rates.items()},
        "img_per_s": rates,
        "identical_outputs": f"{identical}/{len(a)}",
        **provenance(),
    }
    med = result["img_per_s_median"]
    print(
        f"median: conditional {med['conditional']:.0f} img/s, combos {med['combos']:.0f} img/s "
        f"({med['conditional'] / med['combos']:.2f}x); start-up {cond_build:.2f} s vs {combo_build:.2f} s; "
        f"outputs identical {identical}/{len(a)}"
    )
    write_json(result, result_path(args.out, f"aot_{args.policy}_{args.device}.json"))


if __name__ == "__main__":
    main()
