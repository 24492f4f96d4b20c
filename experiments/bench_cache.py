"""The decoded-image cache (`cache=`, fusionflow/cache/): what it saves per core and in the loader,
what filling it costs, what a small budget keeps, and what it does to the pixels.

One run, on one synthetic image set (--sizes imagenet: 500x375 / 375x500 photos' shapes, sides
jittered 10%; 800-2000: sides uniform in 800..2000 px), policy --policy (RandAugment by default):

  per core   one process, one thread, the CPU pipeline over the set, epoch after epoch, candidates
             interleaved repeat by repeat (medians):
               uncached   the fast mode as shipped (window decode at a DCT scale + resample + ops)
               fill       a fresh cache's first epoch (whole-image decode, shrink, store, crop)
               warm       later epochs from the cache
               no_decode  the limit: each sample's decoded window made beforehand, then resample +
                          flip + ops + write only (the issue's "resize + ops alone")
  loader     FusionFlowLoader, --workers CPU workers (persistent), batch 32: per repeat a loader
             without the cache, one with a fresh cache filled as samples come (fill_share=None) and
             one with the default fill_share="auto", --epochs epochs each, a training step of
             --step-ms per batch (0: loader-bound): epoch 1 (all start their workers: fill vs
             uncached, and the share cached), then the later epochs vs uncached ones
  paced      per core, DecodedCache(fill_share=--fill-share): each of --paced-epochs epochs against an
             uncached epoch timed beside it, and the share of the set cached after it
  refurbish  per core, warm: a new crop each epoch vs DecodedCache(reuse_crop_epochs=--reuse), over
             --paced-epochs epochs, and the diversity each gives (pairwise PSNR, distinct crops)
  budget     per core, a cache of --budget-share (25%) of the set's decoded bytes, with admission
             "score" (decode time per stored byte) vs "first" (first come): the warm epochs' rate
             and hit share; the set is the chosen one unless --budget-sizes names another (mixed
             sizes show the difference: 200-2000 by default)
  fidelity   cached vs uncached fast mode on the same draws, PSNR per shipped policy (median, 1st
             percentile), at the default max_side and, for --policy, at each of --max-sides

    .venv/bin/python -m experiments.bench_cache [--sizes imagenet] [--images 256] [--repeats 3]
        [--workers 2] [--epochs 3] [--step-ms 0] [--budget-share 0.25] [--budget-sizes 200-2000]
        [--max-sides 256,320,384,448] [--fill-share 0.1] [--paced-epochs 8] [--skip loader,paced,budget,fidelity]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from experiments.harness import provenance, result_path, rounds, write_json

POLICIES = ("randaugment", "randaugment-paper", "autoaugment", "trivialaugment", "augmix", "deepaa", "default", "eval")


def private_cache(entries: int, size: int, max_side: int, admission: str = "score"):
    """A CacheReader over a fresh, nameless segment of this process (no keeper: one process)."""
    from fusionflow.cache.keeper import segment
    from fusionflow.cache.reader import CacheReader
    from fusionflow.cache.store import CacheStore

    store = CacheStore.create(segment(None), entries, size, max_side, admission)
    return CacheReader(store, store.claim_rows(1, os.getpid())[0])


def drop_cache(reader) -> None:
    fd = reader.store.fd
    reader.store.close()
    os.close(fd)


def epoch_runner(pipe, data, out):
    def run(epoch: int) -> None:
        for i, d in enumerate(data):
            pipe(d, i, 0, epoch, out=out)

    return run


def no_decode_runner(pipe, data, epochs: int):
    """Each sample's decoded window for every epoch made now; the returned run(epoch) does the rest
    (the draw, resample, flip, ops, write)."""
    from functools import partial

    from fusionflow.ops import fast
    from fusionflow.ops.decode import decode_fast_window
    from fusionflow.ops.resample import resample_box, resize_window
    from fusionflow.policy import crop_window, draw

    p = pipe.policy
    pre = {}
    for e in range(epochs):
        for i, d in enumerate(data):
            s = draw(p, 0, e, i)
            pre[e, i] = (s, *decode_fast_window(d, partial(crop_window, p, s), p.size))
    out = np.empty(p.out_shape, np.uint8)

    def run(epoch: int) -> None:
        for i in range(len(data)):
            _, arr, box = pre[epoch, i]
            s = draw(p, 0, epoch, i)  # the draw is the pipeline's work too, not the decode's
            arr = resize_window(arr, *p.size) if box is None else resample_box(arr, box, *p.size)
            arr = fast.flip(arr) if s.flip else arr
            fast.write_planes(pipe.augment_array(arr, s), out)

    return run


def per_core(data, policy: str, repeats: int, max_side: int) -> dict:
    from fusionflow.ops.pipeline import CpuPipeline

    n = len(data)
    plain = CpuPipeline(policy)
    out = np.empty(plain.out_shape, plain.out_dtype)
    state = {"reader": None}

    def fresh_fill() -> None:
        if state["reader"] is not None:
            drop_cache(state["reader"])
        state["reader"] = private_cache(n, 4 << 30, max_side)
        epoch_runner(CpuPipeline(policy, cache=state["reader"]), data, out)(0)

    def warm() -> None:
        epoch_runner(CpuPipeline(policy, cache=state["reader"]), data, out)(1)

    limit = no_decode_runner(plain, data, 2)
    runs = rounds(
        {
            "uncached": lambda: _timed(lambda: epoch_runner(plain, data, out)(1)),
            "fill": lambda: _timed(fresh_fill),
            "warm": lambda: _timed(warm),
            "no_decode": lambda: _timed(lambda: limit(1)),
        },
        repeats,
        report=lambda r, v: print(f"per core, repeat {r + 1}: " + _rates(v, n), flush=True),
    )
    filled = state["reader"].store.counts([])
    drop_cache(state["reader"])
    rate = {k: n / statistics.median(v) for k, v in runs.items()}
    return {
        "seconds": runs,
        "img_per_s": rate,
        "warm_over_uncached": rate["warm"] / rate["uncached"],
        "fill_over_uncached": rate["fill"] / rate["uncached"],
        "warm_over_no_decode": rate["warm"] / rate["no_decode"],
        "cached_bytes": filled["bytes"],
        "cached_bytes_per_image": filled["bytes"] / n,
        "encoded_bytes_per_image": sum(len(d) for d in data) / n,
    }


def _timed(go) -> float:
    t0 = time.perf_counter()
    go()
    return time.perf_counter() - t0


def _rates(values: dict, n: int) -> str:
    return ", ".join(f"{k} {n / v[-1]:.0f} img/s" for k, v in values.items())


LOADER_FILLS = {"uncached": "off", "cached": None, "auto": "auto"}  # kind -> DecodedCache(fill_share=...)


def loader_epochs(data, policy: str, workers: int, epochs: int, repeats: int, max_side: int, step_ms: float = 0):
    """Per repeat, one loader per kind (rotated): no cache, a fresh cache filled as samples come
    (fill_share=None), and one with the default fill_share="auto"; each `epochs` epochs, the training
    loop taking `step_ms` per batch (0: as fast as batches come, a loader-bound job). Epoch 1 is the
    filling one; what share of the set it cached is reported per kind."""
    from fusionflow import DecodedCache, FusionFlowLoader
    from fusionflow.tools.synthetic import EncodedImages

    ds, n = EncodedImages(data), len(data)
    m = n - 32  # images after each epoch's first batch (batch 32)
    times, cached1 = {k: [] for k in LOADER_FILLS}, {k: [] for k in LOADER_FILLS if k != "uncached"}
    first_batch = {k: [] for k in LOADER_FILLS}
    for r in range(repeats):
        kinds = list(LOADER_FILLS)
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            fill = LOADER_FILLS[kind]
            cache = None if fill == "off" else DecodedCache(size=4 << 30, max_side=max_side, fill_share=fill)
            loader = FusionFlowLoader(
                ds, batch_size=32, shuffle=True, num_workers=workers, policy=policy, seed=r,
                persistent_workers=True, pin_workers=False, cache=cache,
            )  # fmt: skip
            per_epoch = []
            for e in range(epochs):
                loader.set_epoch(e)
                t0 = time.perf_counter()
                for k, _ in enumerate(loader):
                    if k == 0:  # timed from the first batch: workers' and the cache's start-up are apart
                        t1 = time.perf_counter()
                        if e == 0:
                            first_batch[kind].append(t1 - t0)
                    if step_ms:
                        time.sleep(step_ms / 1000)
                per_epoch.append(time.perf_counter() - t1)
                if e == 0 and cache is not None:
                    cached1[kind].append(loader.stats.cache.get("entries", 0) / n)
            loader.close()
            times[kind].append(per_epoch)
            print(f"loader {kind}, repeat {r + 1}: " + ", ".join(f"{m / t:.0f}" for t in per_epoch), flush=True)
    first = {k: m / statistics.median(v[0] for v in runs) for k, runs in times.items()}
    later = {k: m / statistics.median(t for v in runs for t in v[1:]) for k, runs in times.items()}
    return {
        "step_ms": step_ms,
        "timed": "each epoch from its first batch on (img/s over the rest); start-up to the first batch apart",
        "first_batch_s": {k: statistics.median(v) for k, v in first_batch.items()},
        "seconds_per_epoch": times,
        "epoch1_img_per_s": first,
        "later_img_per_s": later,
        "cached_after_epoch1": {k: statistics.median(v) for k, v in cached1.items()},
        "fill_over_uncached": first["cached"] / first["uncached"],
        "warm_over_uncached": later["cached"] / later["uncached"],
        "auto_fill_over_uncached": first["auto"] / first["uncached"],
        "auto_later_over_uncached": later["auto"] / later["uncached"],
    }


def budget_run(data, policy: str, share: float, repeats: int, max_side: int) -> dict:
    from fusionflow.ops.pipeline import CpuPipeline

    n = len(data)
    full = private_cache(n, 4 << 30, max_side)
    out = np.empty(CpuPipeline(policy).out_shape, np.uint8)
    epoch_runner(CpuPipeline(policy, cache=full), data, out)(0)
    total = full.store.counts([])["bytes"]
    drop_cache(full)
    size = max(1 << 20, int(total * share))
    result = {"decoded_bytes": total, "budget_bytes": size}
    for admission in ("score", "first"):
        rates, hit_share = [], []
        for _ in range(repeats):
            reader = private_cache(n, size, max_side, admission)
            epoch_runner(CpuPipeline(policy, cache=reader), data, out)(0)
            t = _timed(lambda: epoch_runner(CpuPipeline(policy, cache=reader), data, out)(1))
            c = reader.store.counts([reader_row(reader)])
            rates.append(n / t)
            hit_share.append(c["hits"] / n)
            drop_cache(reader)
        result[admission] = {"warm_img_per_s": statistics.median(rates), "hit_share": statistics.median(hit_share)}
        print(f"budget {share:.0%} {admission}: {result[admission]}", flush=True)
    plain = CpuPipeline(policy)
    result["uncached_img_per_s"] = n / statistics.median(
        _timed(lambda: epoch_runner(plain, data, out)(1)) for _ in range(repeats)
    )
    result["score_over_first"] = result["score"]["warm_img_per_s"] / result["first"]["warm_img_per_s"]
    return result


def paced_run(data, policy: str, share: float, epochs: int, max_side: int) -> dict:
    """Per core, a fresh cache filled with `fill_share=share`: each epoch's rate over an uncached epoch
    timed beside it, and the share of the set cached after it."""
    from fusionflow.cache.reader import CacheReader
    from fusionflow.ops.pipeline import CpuPipeline

    n = len(data)
    plain = CpuPipeline(policy)
    out = np.empty(plain.out_shape, np.uint8)
    eager = private_cache(n, 4 << 30, max_side)
    reader = CacheReader(eager.store, reader_row(eager), fill_share=share)
    paced = CpuPipeline(policy, cache=reader)
    ratios, cached = [], []
    for e in range(epochs):
        base = _timed(lambda: epoch_runner(plain, data, out)(e))  # noqa: B023 (called at once)
        ratios.append(base / _timed(lambda: epoch_runner(paced, data, out)(e)))  # noqa: B023
        cached.append(eager.store.counts([])["entries"] / n)
        print(
            f"paced fill_share={share}, epoch {e + 1}: {ratios[-1]:.2f}x uncached, {cached[-1]:.0%} cached", flush=True
        )
    drop_cache(eager)
    return {"fill_share": share, "over_uncached_per_epoch": ratios, "cached_share_per_epoch": cached}


def refurbish_run(data, policy: str, reuse: int, epochs: int, max_side: int) -> dict:
    """Per core, warm from the cache, a new crop every epoch vs `reuse_crop_epochs=reuse` (the crop
    kept): each epoch's rate side by side, and what reuse does to diversity -- per sample, the PSNR
    between its outputs of every two epochs (higher: more alike), and the distinct crops it got."""
    import dataclasses
    import itertools

    from fusionflow.cache.crops import CropStore
    from fusionflow.cache.keeper import segment
    from fusionflow.cache.reader import CacheReader
    from fusionflow.ops.pipeline import CpuPipeline
    from fusionflow.policy import draw, load_policy

    n, base = len(data), load_policy(policy)
    kept = dataclasses.replace(base, crop_epochs=reuse)
    shared = private_cache(n, 4 << 30, max_side)
    crop_fd = segment(None)
    crops = CropStore.create(crop_fd, n, base.size)
    pipes = {
        "new_crop": CpuPipeline(base, cache=shared),
        "kept_crop": CpuPipeline(kept, cache=CacheReader(shared.store, None, None, crops)),
    }
    out = np.empty(base.out_shape, np.uint8)
    epoch_runner(pipes["new_crop"], data, out)(0)  # fill the decoded cache first: both runs are warm
    rates = {k: [] for k in pipes}
    for e in range(epochs):
        for name in ("new_crop", "kept_crop") if e % 2 == 0 else ("kept_crop", "new_crop"):
            rates[name].append(n / _timed(lambda: epoch_runner(pipes[name], data, out)(e)))  # noqa: B023
        print(f"refurbish epoch {e + 1}: " + ", ".join(f"{k} {v[-1]:.0f} img/s" for k, v in rates.items()), flush=True)
    few = range(min(n, 48))
    similarity, distinct = {}, {}
    for name, pol in (("new_crop", base), ("kept_crop", kept)):
        outs = {i: [pipes[name](data[i], i, 0, e) for e in range(epochs)] for i in few}
        pairs = [psnr(a, b) for i in few for a, b in itertools.combinations(outs[i], 2)]
        similarity[name] = float(np.median([min(p, 60.0) for p in pairs]))
        distinct[name] = float(np.mean([len({draw(pol, 0, e, i).crop_u for e in range(epochs)}) for i in few]))
    drop_cache(shared)
    crops.close()
    os.close(crop_fd)
    later = {k: statistics.median(v[1:]) for k, v in rates.items()}
    return {
        "reuse_crop_epochs": reuse,
        "img_per_s_per_epoch": rates,
        "median_img_per_s": later,
        "kept_over_new": later["kept_crop"] / later["new_crop"],
        "pairwise_psnr_median_db": similarity,
        "distinct_crops_per_sample": distinct,
        "epochs": epochs,
    }


def reader_row(reader) -> int:
    return next(r for r in range(len(reader.store.rows)) if reader.store.rows[r, 0] == os.getpid())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def fidelity(data, policies, max_side: int, epochs: int = 2) -> dict:
    from fusionflow.ops.pipeline import CpuPipeline

    table = {}
    for policy in policies:
        plain, reader = CpuPipeline(policy), private_cache(len(data), 4 << 30, max_side)
        cached = CpuPipeline(policy, cache=reader)
        values = [psnr(plain(d, i, 0, e), cached(d, i, 0, e)) for e in range(epochs) for i, d in enumerate(data)]
        drop_cache(reader)
        table[policy] = {"median_db": float(np.median(values)), "p1_db": float(np.percentile(values, 1))}
        print(f"fidelity {policy} max_side={max_side}: {table[policy]}", flush=True)
    return table


def main() -> None:
    from fusionflow.cache.config import DEFAULT_MAX_SIDE
    from fusionflow.tools.synthetic import sample_set

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="imagenet")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-side", type=int, default=DEFAULT_MAX_SIDE)
    ap.add_argument("--budget-share", type=float, default=0.25)
    ap.add_argument("--budget-sizes", default="200-2000")
    ap.add_argument("--max-sides", default="256,320,384,448")
    ap.add_argument("--fidelity-images", type=int, default=64)
    ap.add_argument("--fill-share", type=float, default=0.1)
    ap.add_argument("--step-ms", type=float, default=0.0, help="loader part: the training step per batch (sleep)")
    ap.add_argument("--paced-epochs", type=int, default=8)
    ap.add_argument("--reuse", type=int, default=3, help="reuse_crop_epochs for the refurbish part")
    ap.add_argument("--skip", default="", help="comma-separated: per_core, loader, paced, refurbish, budget, fidelity")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    data = sample_set(args.sizes, args.images)
    result = {"args": vars(args), **provenance()}
    if "per_core" not in skip:
        result["per_core"] = per_core(data, args.policy, args.repeats, args.max_side)
    if "loader" not in skip:
        result["loader"] = loader_epochs(
            data, args.policy, args.workers, args.epochs, args.repeats, args.max_side, args.step_ms
        )
    if "paced" not in skip:
        result["paced"] = paced_run(data, args.policy, args.fill_share, args.paced_epochs, args.max_side)
    if "refurbish" not in skip:
        result["refurbish"] = refurbish_run(data, args.policy, args.reuse, args.paced_epochs, args.max_side)
    if "budget" not in skip:
        mixed = sample_set(args.budget_sizes, args.images) if args.budget_sizes != args.sizes else data
        result["budget"] = budget_run(mixed, args.policy, args.budget_share, args.repeats, args.max_side)
    if "fidelity" not in skip:
        few = data[: args.fidelity_images]
        result["fidelity"] = {"default_max_side": fidelity(few, POLICIES, args.max_side)}
        result["fidelity"]["max_sides"] = {
            int(m): fidelity(few, [args.policy], int(m)) for m in args.max_sides.split(",") if m
        }
    path = result_path(args.out, f"bench_cache_{args.sizes}")
    write_json(result, path)
    print(f"wrote {path}")
    for part in ("per_core", "loader"):
        if part in result:
            r = result[part]
            print(f"{part}: warm/uncached {r['warm_over_uncached']:.2f}x, fill/uncached {r['fill_over_uncached']:.2f}x")
    if "loader" in result:
        r = result["loader"]
        print(
            f"loader, fill_share='auto': epoch 1 {r['auto_fill_over_uncached']:.2f}x uncached "
            f"({r['cached_after_epoch1']['auto']:.0%} cached), later epochs {r['auto_later_over_uncached']:.2f}x"
        )


if __name__ == "__main__":
    main()
