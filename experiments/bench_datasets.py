"""FusionFlowLoader over tar shards vs an ImageFolder, on local disk and with slow reads, with and
without read-ahead.

    .venv/bin/python -m experiments.bench_datasets [--images 512] [--epochs 4] [--latency-ms 2]

The same images as an ImageFolder and as WebDataset shards (examples/make_shards.py, 64 samples a
shard); RandAugment, batch 32, 2 workers, persistent workers, one warm-up epoch per loader, then the
epochs with the loaders' order rotating every epoch; medians of img/s. "slow" wraps the dataset so
that every read waits --latency-ms first (a network filesystem's or object store's round trip);
"read-ahead 4" is FusionFlowLoader(read_ahead=4). Writes experiments/results/datasets_randaugment.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

from experiments.harness import ROOT, image_folder, medians, provenance, result_path, rotation, write_json


class SlowReads:
    """`dataset` whose every read first waits `seconds` (time.sleep: the GIL is released, as in real I/O)."""

    def __init__(self, dataset, seconds: float):
        self.dataset, self.seconds = dataset, seconds
        self.sizes = dataset.sizes

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return self.dataset[i]


def _make_shards(root: str, out: str) -> str:
    spec = importlib.util.spec_from_file_location("make_shards", os.path.join(ROOT, "examples", "make_shards.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_shards(root, out, per_shard=64, shuffle_seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=2.0)
    ap.add_argument("--read-ahead", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from fusionflow import FusionFlowLoader, ImageFolder, TarShards

    torch.set_num_threads(1)
    root = image_folder(args.images)
    folder = ImageFolder(root)
    pattern = _make_shards(root, root + "_shards")
    shards = TarShards(pattern)
    lat = args.latency_ms / 1000
    ra = args.read_ahead
    variants = {
        "folder": (folder, None),
        "shards": (shards, None),
        f"folder, read-ahead {ra}": (folder, ra),
        "folder, slow": (SlowReads(folder, lat), None),
        f"folder, slow, read-ahead {ra}": (SlowReads(folder, lat), ra),
        "shards, slow": (SlowReads(shards, lat), None),
        f"shards, slow, read-ahead {ra}": (SlowReads(shards, lat), ra),
    }
    loaders = {
        name: FusionFlowLoader(
            ds,
            batch_size=32,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
            drop_last=True,
            policy="randaugment",
            read_ahead=read_ahead,
        )
        for name, (ds, read_ahead) in variants.items()
    }
    print(
        f"{len(folder)} images, {len(shards.shards)} shards, {args.workers} workers, slow = {args.latency_ms} ms a read"
    )
    rates = {name: [] for name in loaders}
    try:
        for loader in loaders.values():  # warm-up: workers started, caches filled
            for _ in loader:
                pass
        names = list(loaders)
        for e in range(args.epochs):
            for name in rotation(names, e):
                loader = loaders[name]
                loader.set_epoch(e + 1)
                t0, n = time.perf_counter(), 0
                for images, _ in loader:
                    n += len(images)
                rates[name].append(n / (time.perf_counter() - t0))
            print(f"epoch {e + 1}/{args.epochs}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()))
    finally:
        for loader in loaders.values():
            loader.close()
    med = medians(rates)
    for k, v in med.items():
        print(f"{k:32s} {v:6.0f} img/s ({v / med['folder']:.2f}x folder)")
    write_json(
        {
            "benchmark": "datasets",
            "images": len(folder),
            "shards": len(shards.shards),
            "workers": args.workers,
            "epochs": args.epochs,
            "latency_ms": args.latency_ms,
            "read_ahead": ra,
            **provenance(),
            "img_per_s_median": med,
            "img_per_s_runs": rates,
        },
        result_path(args.out, "datasets_randaugment.json"),
    )


if __name__ == "__main__":
    main()
