"""`python -m fusionflow bench --data DIR`: is FusionFlowLoader faster than DataLoader + torchvision
on your data?

Both loaders get the same ImageFolder, policy (torchvision's RandAugment / TrivialAugmentWide /
AutoAugment or none, after RandomResizedCrop + flip), batch size and worker count, persistent
workers. After one warm-up pass each, repeats alternate between them (A B A B ...) so drifts in the
machine's load hit both alike; each repeat times --batches mini-batches after the first (start-up
excluded). Reported: samples/s medians, wait at next() mean, and FusionFlow's ratio.

Both deliver what a training recipe feeds the model: float32 normalised with ImageNet's mean and std
(`--output uint8`: the raw crops, cheaper for both). `--data` is an ImageFolder root, or a folder of
splits (train/, val/): the `train` split (else the first that holds class folders) is measured.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
import warnings

import numpy as np

from fusionflow.tools.baseline import TV_POLICIES, TorchvisionSamples, timed_batches
from fusionflow.tools.cli import check_out_file


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="ImageFolder root (class folders of images)")
    p.add_argument("--policy", default="randaugment", choices=TV_POLICIES)
    p.add_argument("--workers", type=int, default=min(4, len(os.sched_getaffinity(0))))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=30, help="mini-batches timed per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", type=int, default=224, help="output side in pixels (both loaders)")
    p.add_argument("--output", default="float", choices=("float", "uint8"), help="normalised float32 or uint8")
    p.add_argument("--json", default=None, help="also write the result as JSON there")


def check_arguments(p, args) -> None:
    for name in ("workers", "batch_size", "batches", "repeats", "size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 8 <= args.size <= 8192:  # the policy's own range (policy/overrides.py)
        p.error(f"--size must be 8 to 8192 pixels, got {args.size}")
    if not os.path.isdir(args.data):
        p.error(f"--data {args.data!r} is not a directory (an ImageFolder root: one folder per class)")
    if args.json:
        check_out_file(p, "--json", args.json)


def time_pass(loader, batches: int, bar) -> tuple[float, list[float]]:
    """samples/s over `batches` mini-batches after the first one of a pass, and every wait at next()."""
    waits, samples, t0 = [], 0, None
    it = timed_batches(loader)
    try:
        for x, y, wait in itertools.islice(it, batches + 1):
            float(x[:, :, 0, 0].float().mean())  # touch the batch
            if t0 is None:
                t0 = time.perf_counter()
                continue
            waits.append(wait)
            samples += len(y)
            bar.update()
    finally:
        it.close()
    return (samples / (time.perf_counter() - t0) if samples else float("nan")), waits


def run(args, parser=None) -> int:
    """Bench as `args` say; data that cannot be benched is `parser`'s usage error (exit 2) when given."""
    import torch

    from fusionflow import ImageFolder

    torch.set_num_threads(1)
    try:
        root = image_root(args.data)
        ds = ImageFolder(root)
        batch_size = min(args.batch_size, len(ds))
        if len(ds) // batch_size < 2:
            raise SystemExit(
                f"bench: {len(ds)} images make fewer than 2 mini-batches of {batch_size}: use a smaller --batch-size "
                "(the first mini-batch of each pass is not timed)"
            )
    except SystemExit as e:  # the data cannot be benched: the parser's usage error (exit 2) when there is one
        if parser is None:
            raise
        parser.error(str(e).removeprefix("bench: "))
    per_pass = min(args.batches, len(ds) // batch_size - 1)
    print(
        f"{len(ds)} images in {root}, policy {args.policy} ({args.output} output), batch {batch_size}, "
        f"{args.workers} workers, "
        f"{args.repeats} repeats x {per_pass} mini-batches"
    )
    loaders = _loaders(args, ds, batch_size)
    try:
        rates, waits = _alternate(loaders, args.repeats, per_pass)
    finally:
        loaders["FusionFlowLoader"].close()
    result = _summary(rates, waits, args.repeats)
    ratio = (
        result["FusionFlowLoader"]["samples_per_s_median"] / result["DataLoader+torchvision"]["samples_per_s_median"]
    )
    print(f"FusionFlowLoader / DataLoader+torchvision: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "data": root,
                    "output": args.output,
                    "images": len(ds),
                    "policy": args.policy,
                    "workers": args.workers,
                    "batch_size": batch_size,
                    "repeats": args.repeats,
                    "batches_per_repeat": per_pass,
                    "results": result,
                    "ratio": ratio,
                },
                f,
                indent=2,
            )
    return 0


IMAGENET_NORMALIZE = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def image_root(path: str) -> str:
    """`path` when it is an ImageFolder root (class folders of images), else its split that is one
    (`train` first, as torchvision's and timm's layouts name it), else a SystemExit saying what was expected."""
    from fusionflow import ImageFolder
    from fusionflow.datasets.folder import looks_like_splits

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a root of splits is told apart below
            classes = ImageFolder(path).classes
        if not looks_like_splits(classes):
            return path
        why = f"its folders {classes} are splits, not classes"
    except ValueError as e:
        why = e
    splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
    for name in sorted(splits, key=lambda n: (n != "train", n)):
        try:
            ImageFolder(os.path.join(path, name))
        except ValueError:
            continue
        print(f"bench: {path} holds splits; measuring its {name!r} split")
        return os.path.join(path, name)
    raise SystemExit(
        f"bench: --data {path!r} is not an ImageFolder root ({why}); expected {path}/<class>/<image>.jpg, "
        f"or a folder of splits such as {path}/train/<class>/<image>.jpg"
    )


def _loaders(args, ds, batch_size: int) -> dict:
    """The two loaders under test, with the same dataset, policy, batch size and workers."""
    from torch.utils.data import DataLoader

    from fusionflow import FusionFlowLoader
    from fusionflow.policy import load_policy

    common = dict(
        batch_size=batch_size, shuffle=True, num_workers=args.workers, drop_last=True, persistent_workers=True
    )
    normalize = IMAGENET_NORMALIZE if getattr(args, "output", "float") == "float" else None
    policy = load_policy(args.policy, size=args.size, normalize=normalize)
    return {
        "DataLoader+torchvision": DataLoader(TorchvisionSamples(ds, args.policy, args.size, normalize), **common),
        "FusionFlowLoader": FusionFlowLoader(ds, policy=policy, seed=0, **common),
    }


def _alternate(loaders: dict, repeats: int, per_pass: int) -> tuple[dict, dict]:
    """One warm-up pass each, then `repeats` rounds alternating the loaders: rates and waits by name."""
    from tqdm import tqdm

    rates = {name: [] for name in loaders}
    waits = {name: [] for name in loaders}
    for name, loader in loaders.items():
        with tqdm(total=per_pass, desc=f"warm-up {name}", unit="batch", leave=False) as bar:
            time_pass(loader, per_pass, bar)
    for r in range(repeats):
        for name, loader in loaders.items():
            with tqdm(total=per_pass, desc=f"repeat {r + 1}/{repeats} {name}", unit="batch", leave=False) as bar:
                rate, w = time_pass(loader, per_pass, bar)
            rates[name].append(rate)
            waits[name] += w
    return rates, waits


def summarize(rates: dict, waits: dict, unit: str = "samples_per_s") -> dict:
    """The loader-vs-loader summary, per loader name: the median rate (`<unit>_median`), every rate
    (`<unit>`), and the wait at next() in ms (mean, p95). `rates` and `waits`: lists by loader name.
    The owner of this summary: experiments/bench_loader.py calls it too (with unit "img_per_s")."""
    result = {}
    for name in rates:
        w = np.asarray(waits[name])
        result[name] = {
            f"{unit}_median": statistics.median(rates[name]),
            unit: rates[name],
            "wait_mean_ms": 1e3 * float(w.mean()),
            "wait_p95_ms": 1e3 * float(np.percentile(w, 95)),
        }
    return result


def _summary(rates: dict, waits: dict, repeats: int) -> dict:
    """`summarize`, each loader's line printed."""
    result = summarize(rates, waits)
    for name, row in result.items():
        print(
            f"  {name}: {row['samples_per_s_median']:.1f} samples/s (median of {repeats}), "
            f"wait at next() mean {row['wait_mean_ms']:.1f} ms, p95 {row['wait_p95_ms']:.1f} ms"
        )
    return result
