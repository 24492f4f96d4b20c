"""FusionFlowLoader vs torch DataLoader, same policy semantics, same workers, same data, one run.

Candidates (persistent workers for all, one warm-up epoch each, then epochs interleaved, the order
rotating each epoch):
  dataloader_tv   torch DataLoader + torchvision.transforms.v2 on PIL (what users run today)
  dataloader_ff   torch DataLoader + FusionFlow's CPU pipeline as the dataset transform
  fusionflow      FusionFlowLoader (tiny-batches into shared memory)
  with --observability, also (tracing off vs on):
  fusionflow_trace   FusionFlowLoader(trace=...): the timeline recorded, and written at every epoch's end
  fusionflow_stages  FusionFlowLoader(stage_times=True): per-sample stage timing in the workers
Modes: `loader` (iterate and touch each batch) and `model` (a small CNN trains on every batch).
Reported: img/s per epoch (median over epochs), mean and p95 wait per batch at next(), ratios.

    .venv/bin/python -m experiments.bench_loader [--images 512] [--epochs 5] [--workers 2] [--batch-size 32]
    .venv/bin/python -m experiments.bench_loader --modes loader --observability   # tracing overhead

The per-loader summary (median, every rate, wait at next() mean and p95) is fusionflow/tools/bench.py's
`summarize`, the one `python -m fusionflow bench` prints.
"""

from __future__ import annotations

import argparse
import os
import time

from experiments.harness import image_folder, provenance, result_path, rotation, write_json
from fusionflow.tools.baseline import TorchvisionSamples, timed_batches
from fusionflow.tools.bench import summarize
from fusionflow.tools.demo import small_cnn, train_step


class FusionFlowSamples:
    """FusionFlow's CPU pipeline as a map-style dataset (per-sample draws from seed, epoch, index)."""

    def __init__(self, ds, policy_name: str, seed: int = 0):
        self.ds, self.policy_name, self.seed, self.epoch = ds, policy_name, seed, 0
        self._pipe = None

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        import torch

        from fusionflow.ops.pipeline import CpuPipeline

        if self._pipe is None:
            self._pipe = CpuPipeline(self.policy_name)
        data, label = self.ds[i]
        return torch.from_numpy(self._pipe(data, i, self.seed, self.epoch, what=self.ds.describe(i))), label


def epoch_run(loader, model, opt, loss_fn, set_epoch):
    set_epoch()
    waits, n = [], 0
    t0 = time.perf_counter()
    for x, y, wait in timed_batches(loader):
        waits.append(wait)
        n += len(y)
        if model is None:
            float(x[:, :, 0, 0].float().mean())  # touch the batch
        else:
            train_step(model, opt, loss_fn, x, y)
    return n / (time.perf_counter() - t0), waits


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--tiny-batch-size", type=int, default=4)
    ap.add_argument(
        "--policy", default="randaugment", choices=["randaugment", "trivialaugment", "autoaugment", "default"]
    )
    ap.add_argument("--modes", default="loader,model")
    ap.add_argument("--out", default=None)
    ap.add_argument("--observability", action="store_true", help="add FusionFlowLoader with trace / stage_times on")
    args = ap.parse_args()
    if args.images < args.batch_size:
        ap.error(f"--images {args.images} is fewer than --batch-size {args.batch_size}: no full batch to time")
    return args


def make_loaders(args, ds) -> tuple[dict, list]:
    """The candidates, {name: (loader, its set_epoch)}, and the FusionFlowLoaders among them (to close)."""
    from torch.utils.data import DataLoader

    from fusionflow import FusionFlowLoader

    # the settings both loaders share (DataLoader's arguments, as FusionFlowLoader takes them too)
    common = dict(
        batch_size=args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=True, drop_last=True
    )
    loaders = {
        "dataloader_tv": (DataLoader(TorchvisionSamples(ds, args.policy, 224), **common), lambda e: None),
        # per-worker epochs are fixed: fine for speed
        "dataloader_ff": (DataLoader(FusionFlowSamples(ds, args.policy), **common), lambda e: None),
    }
    variants = [("fusionflow", {})]
    if args.observability:
        import tempfile

        trace_dir = tempfile.mkdtemp(prefix="ff_bench_trace_")
        variants += [
            ("fusionflow_trace", {"trace": os.path.join(trace_dir, "run.json")}),
            ("fusionflow_stages", {"stage_times": True}),
        ]
    owned = []
    for name, kw in variants:  # the same settings as the DataLoaders', plus FusionFlow's own
        ff = FusionFlowLoader(ds, policy=args.policy, tiny_batch_size=args.tiny_batch_size, **common, **kw)
        loaders[name] = (ff, ff.set_epoch)
        owned.append(ff)
    return loaders, owned


def run_mode(mode: str, loaders: dict, num_classes: int, epochs: int) -> dict:
    """One warm-up epoch per loader, then `epochs` epochs with the loaders' order rotating; the summary."""
    import torch

    model = opt = loss_fn = None
    rates = {name: [] for name in loaders}
    waits = {name: [] for name in loaders}
    for loader, set_epoch in loaders.values():  # warm-up: start workers, fill caches
        torch.manual_seed(0)
        if mode == "model":
            model = small_cnn(num_classes)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            loss_fn = torch.nn.CrossEntropyLoss()
        epoch_run(loader, model, opt, loss_fn, lambda: set_epoch(0))
    names = list(loaders)
    for e in range(1, epochs + 1):
        # rotate who goes first each epoch: a candidate's place in the round (e.g. right after the
        # DataLoaders' workers went idle) otherwise biases it by more than tracing costs
        for name in rotation(names, e - 1):
            loader, set_epoch = loaders[name]
            rate, w = epoch_run(loader, model, opt, loss_fn, lambda: set_epoch(e))
            rates[name].append(rate)
            waits[name] += w
        print(
            f"[{mode}] epoch {e}/{epochs}: " + ", ".join(f"{n} {r[-1]:.0f} img/s" for n, r in rates.items()),
            flush=True,
        )
    return with_ratios(mode, summarize(rates, waits, unit="img_per_s"))


def with_ratios(mode: str, res: dict) -> dict:
    """The summary with each loader's ratio to DataLoader + torchvision (and the FusionFlowLoader
    variants' to plain FusionFlowLoader), printed."""
    base = res["dataloader_tv"]["img_per_s_median"]
    for name in res:
        res[name]["ratio_vs_dataloader_tv"] = res[name]["img_per_s_median"] / base
        if name.startswith("fusionflow_"):
            res[name]["ratio_vs_fusionflow"] = res[name]["img_per_s_median"] / res["fusionflow"]["img_per_s_median"]
    print(
        f"[{mode}] "
        + ", ".join(
            f"{n}: {r['img_per_s_median']:.0f} img/s ({r['ratio_vs_dataloader_tv']:.2f}x), "
            f"wait mean {r['wait_mean_ms']:.0f} ms p95 {r['wait_p95_ms']:.0f} ms"
            for n, r in res.items()
        )
    )
    return res


def main() -> None:
    args = parse_args()

    import torch

    from fusionflow import ImageFolder

    torch.set_num_threads(1)
    root = image_folder(args.images)
    ds = ImageFolder(root)
    print(f"{len(ds)} images in {root}, policy {args.policy}, batch {args.batch_size}, {args.workers} workers")
    loaders, owned = make_loaders(args, ds)
    try:
        results = {mode: run_mode(mode, loaders, len(ds.classes), args.epochs) for mode in args.modes.split(",")}
        stats = owned[0].stats.summary()
    finally:
        for ff in owned:
            ff.close()
    out = {
        "benchmark": "loader",
        "policy": args.policy,
        "images": len(ds),
        "epochs": args.epochs,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "tiny_batch_size": args.tiny_batch_size,
        **provenance(),
        "torch": torch.__version__,
        "results": results,
        "fusionflow_stats": {k: v for k, v in stats.items() if k != "wait_seconds"},
    }
    tag = "_observability" if args.observability else ""
    write_json(out, result_path(args.out, f"loader_{args.policy}_w{args.workers}_b{args.batch_size}{tag}.json"))


if __name__ == "__main__":
    main()
