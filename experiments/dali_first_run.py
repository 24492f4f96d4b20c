"""A DALI pipeline's first run on a GPU: nvImageCodec fixes its hardware JPEG decoder's share of every run there.

Under DALI's mixed decoder, nvImageCodec sorts each run's images by chroma subsampling and area and gives the
largest to the hardware JPEG decoder (A100/H100/H200), the rest to the hybrid decoder, whose Huffman stage runs on
DALI's CPU threads for crops under a megapixel. How many go to the hardware decoder it computes once, at the
decoder's first run: round(hw_decoder_load x that run's samples) (DALI asks for its FIXED load-hint policy). DALI
alone's first batch is a full one. The accelerator's first run was its first share -- 128 samples on the H200 in
session 49, 8 at 15 CPU workers -- so its later runs of ~175 of each mini-batch's largest samples went ~83 to the
hardware decoder and the rest to 4 CPU threads, or nearly all of them to 1 thread. Since session 50 a new GPU
pipeline's first run is a sizing run of run_samples copies of a small JPEG (dali_graph.py `_sizing_run`).

Each candidate, per round, is a fresh `DaliPolicyPipeline` (RandAugment, runs of at most --run-samples, --threads
DALI threads, two runs in flight):
  first_small   without the sizing run: its first run is the --first largest of a mini-batch (before session 50)
  sized         with it, then the same first run
  sized_hwNN    with it and hw_decoder_load=NN/100 (--loads)
then --runs runs, each the --share largest of a random mini-batch of --batch-size (largest first, as the
accelerator's runs come), their host inputs made before the clock, timed to their completion: img/s and GB/s of
JPEG, medians over --rounds (candidates in rotating order). On DALI's CPU backend (the default here) the candidates
only check the script: no hardware decoder, nothing to size.

    .venv/bin/python -m experiments.dali_first_run [--device cuda] [--threads 4] [--rounds 3] [--loads 80,100]
    (on the device machine: experiments/gpu_run.sh firstrun ARGS)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from experiments.harness import mixed_jpegs, provenance, result_path, rotation, write_json


def runs_of(data: list, sizes: list, rng, batch: int, share: int, count: int) -> list[list[int]]:
    """`count` runs, each the `share` largest (by encoded bytes) of a random mini-batch of `batch`, largest first."""
    runs = []
    for _ in range(count):
        picked = rng.choice(len(data), batch, replace=False)
        runs.append(sorted(picked.tolist(), key=lambda i: -len(data[i]))[:share])
    return runs


def timed(pipe, data: list, sizes: list, runs: list, device: str) -> dict:
    """The runs through `pipe`, `pipe.depth` in flight, their inputs made first; img/s and GB/s to completion."""
    fed = [([data[i] for i in r], r, pipe.host.columns(r, None, [sizes[i] for i in r], 0, 0)) for r in runs]
    start = time.perf_counter()
    for samples, indices, columns in fed:
        if pipe.in_flight == pipe.depth:
            pipe.collect()
        pipe.submit(samples, indices, columns=columns)
    while pipe.in_flight:
        out = pipe.collect()
    if device == "cuda":
        out.as_cpu()  # the last run's outputs, in the pipeline's order after every earlier run's
    wall = time.perf_counter() - start
    images = sum(map(len, runs))
    return {"img_per_s": images / wall, "jpeg_gb_per_s": sum(len(s) for f in fed for s in f[0]) / wall / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=4, help="DALI's CPU threads")
    ap.add_argument("--run-samples", type=int, default=256, help="the pipeline's largest run (its batch size)")
    ap.add_argument("--batch-size", type=int, default=256, help="the mini-batch a run's share is taken from")
    ap.add_argument("--share", type=int, default=175, help="samples a timed run holds (the largest)")
    ap.add_argument("--first", type=int, default=128, help="samples the first run holds")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", default="", help="hw_decoder_load percentages to try with the sizing run: 80,100")
    ap.add_argument("--out")
    args = ap.parse_args()

    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.accel.header_sizes import image_size
    from fusionflow.policy import load_policy

    data = mixed_jpegs(args.images)
    sizes = [image_size(d) for d in data]
    gpu = args.device == "cuda"
    candidates = {"first_small": (False, None), "sized": (True, None)}
    candidates |= {f"sized_hw{p}": (True, int(p) / 100) for p in filter(None, args.loads.split(","))}
    results: dict = {name: [] for name in candidates}
    for r in range(args.rounds):
        rng = np.random.default_rng(r)
        first = runs_of(data, sizes, rng, args.batch_size, args.first, 1)
        runs = runs_of(data, sizes, rng, args.batch_size, args.share, args.runs)
        for name in rotation(candidates, r):
            full_first_run, load = candidates[name]
            pipe = DaliPolicyPipeline(
                load_policy("randaugment"),
                args.run_samples,
                device="gpu" if gpu else "cpu",
                device_id=0 if gpu else None,
                num_threads=args.threads,
                depth=2,
                hw_decoder_load=load,
                full_first_run=full_first_run,
            )
            try:
                timed(pipe, data, sizes, first, args.device)  # the first run: the decoder's count is fixed here
                results[name].append(timed(pipe, data, sizes, runs, args.device))
            finally:
                pipe.close()
            print(f"round {r} {name}: {results[name][-1]['img_per_s']:.0f} img/s", flush=True)
    summary = {
        name: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for name, rows in results.items() if rows
    }
    for name, s in summary.items():
        ratio = s["img_per_s"] / summary["first_small"]["img_per_s"]
        print(f"{name}: {s['img_per_s']:.0f} img/s, {s['jpeg_gb_per_s']:.2f} GB/s of JPEG, {ratio:.2f}x first_small")
    path = result_path(args.out, f"dali_first_run_{args.device}.json")
    write_json({**provenance(), "args": vars(args), "medians": summary, "rounds": results}, path)


if __name__ == "__main__":
    main()
