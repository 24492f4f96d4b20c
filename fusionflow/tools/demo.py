"""`python -m fusionflow demo | profile | bench | serve | gm`. The main job (demo): a short training run,
FusionFlow's augmentation vs torch DataLoader + torchvision.

Makes a small ImageFolder dataset of mixed-size JPEGs if none is given, trains a small CNN for a
few epochs with each input pipeline -- same policy semantics, same workers, same batches -- shows
progress, and prints both throughputs and their ratio.

FusionFlow's side is `FusionFlowLoader`; the baseline is `torch.utils.data.DataLoader` with
torchvision.transforms.v2 on PIL images, the same number of workers and the same batch size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from fusionflow.errors import SampleError
from fusionflow.tools.baseline import TV_POLICIES, BaselineSampleError, TorchvisionSamples, failed_line, timed_batches
from fusionflow.tools.cli import check_out_dir, failed_sample, interrupted


def data_home() -> str:
    """Where the demo writes: a checkout's experiments/data (fusionflow/tools/demo.py -> three levels up), as `make
    clean` expects; for an installed package (site-packages is no place to write, nor writable to a user) the
    user's cache directory."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(repo, "setup.cfg")) and os.path.isdir(os.path.join(repo, "experiments")):
        return os.path.join(repo, "experiments", "data")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fusionflow")


IMAGES_PER_CLASS = 96  # the synthetic set's, 4 classes


def small_cnn(num_classes: int):
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4, padding=2),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def train_step(model, opt, loss_fn, x, y):
    loss = loss_fn(model(x.float().div_(255)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def train(name: str, loader, set_epoch, num_classes: int, args) -> dict:
    import torch
    from tqdm import tqdm

    torch.manual_seed(0)
    model = small_cnn(num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images, waits, t0 = 0, [], time.perf_counter()
    steady_start, steady_images = None, 0
    for epoch in range(args.epochs):
        set_epoch(epoch)
        bar = tqdm(
            total=len(loader),
            desc=f"{name} epoch {epoch + 1}/{args.epochs}",
            unit="batch",
            leave=False,
            mininterval=0.5,
        )
        for x, y, wait in timed_batches(loader):
            waits.append(wait)
            loss = train_step(model, opt, loss_fn, x, y)
            images += len(y)
            if steady_start is None:
                steady_start = time.perf_counter()  # after the first batch: worker start-up excluded
            else:
                steady_images += len(y)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
        bar.close()
    total = time.perf_counter() - t0
    steady = steady_images / (time.perf_counter() - steady_start) if steady_images else float("nan")
    print(
        f"  {name}: {images} images in {total:.1f} s, {steady:.1f} img/s after the first batch, "
        f"mean wait at next() {1e3 * np.mean(waits):.0f} ms, final loss {loss.item():.3f}"
    )
    return {"img_per_s": steady, "seconds": total, "images": images}


def _parser():
    """The command line: (parser, demo's, profile's and bench's subparsers)."""
    ap = argparse.ArgumentParser(
        prog="python -m fusionflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="short training run: FusionFlow vs DataLoader + torchvision")
    d.add_argument("--data", default=None, help="ImageFolder root (default: make a synthetic one)")
    d.add_argument("--policy", default="randaugment", choices=TV_POLICIES)
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    d.add_argument(
        "--images-per-class", type=int, default=None, help=f"the synthetic set's (default {IMAGES_PER_CLASS})"
    )
    d.add_argument(
        "--profile-dir",
        default=None,
        help="where the FusionFlow run's trace.json and timeline.png go (default: demo_profile beside the "
        "synthetic set: experiments/data in a checkout, else ~/.cache/fusionflow)",
    )
    from fusionflow.tools import bench, profile

    p = sub.add_parser(
        "profile",
        help="where the time goes on your data: trace, timeline PNG, summary",
        description=profile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_arguments(p)
    b = sub.add_parser(
        "bench",
        help="FusionFlowLoader vs DataLoader + torchvision on your data",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(b)
    # listed here, parsed by their own modules (main hands them their arguments before this parser runs)
    sub.add_parser("serve", help="a SharedLoader for co-located jobs (serve --help)", add_help=False)
    sub.add_parser("gm", help="a DDP job's global manager: serve, status, workers (gm --help)", add_help=False)
    return ap, d, p, b


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gm"]:
        from fusionflow.tools.gm import main as gm

        return gm(argv[1:])
    if argv[:1] == ["serve"]:
        from fusionflow.tools.serve import main as serve

        return serve(argv[1:])
    from fusionflow.tools import bench, profile

    ap, d, p, b = _parser()
    args = ap.parse_args(argv)
    prog = f"python -m fusionflow {args.command}"
    try:
        if args.command == "profile":
            profile.check_arguments(p, args)
            return profile.run(args, p)
        if args.command == "bench":
            bench.check_arguments(b, args)
            return bench.run(args, b)
        return _demo_main(d, args)
    except SampleError as e:  # a corrupt image in the user's data: said in a line, with the option that goes on
        skipping = args.command == "profile" and args.on_error == "skip"
        return failed_sample(prog, e, skip_option=args.command == "profile", skipping=skipping)
    except BaselineSampleError as e:  # the same, met first by the comparison's DataLoader + torchvision
        print(
            f"{prog}: {failed_line(e)}\n(fix or remove that file: both loaders are timed on the same images)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:  # the loaders closed on the way out (with blocks, finally)
        return interrupted(prog)


def _demo_main(ap, args) -> int:
    if args.data is not None and args.images_per_class is not None:
        ap.error("--images-per-class sizes the synthetic set: it has no effect with --data")
    args.images_per_class = IMAGES_PER_CLASS if args.images_per_class is None else args.images_per_class
    for name in ("epochs", "batch_size", "images_per_class"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 0:
        ap.error("--workers must be >= 0")
    if args.data is not None and not os.path.isdir(args.data):
        ap.error(f"--data {args.data!r} is not a directory (an ImageFolder root: one folder per class)")
    if args.profile_dir:
        check_out_dir(ap, "--profile-dir", args.profile_dir)
    return demo(args, ap)


def demo(args, ap=None) -> int:
    """The main job: train with DataLoader + torchvision, then with FusionFlowLoader; print both."""
    import torch

    from fusionflow.datasets.folder import ImageFolder
    from fusionflow.tools.synthetic import make_image_folder

    torch.set_num_threads(1)  # the CPUs are the loaders' to share; the tiny model needs little
    root = args.data
    if root is None:
        root = os.path.join(data_home(), "demo")
        print(f"making a synthetic dataset of mixed-size JPEGs (200-1000 px) in {root} ...", flush=True)
        make_image_folder(root, num_classes=4, per_class=args.images_per_class)
    try:
        ds = ImageFolder(root)
    except (OSError, ValueError) as e:  # no class folders, no images
        if ap is None:
            raise
        ap.error(f"--data {root!r}: {e}")
    if len(ds) // args.batch_size < 2 and ap is not None:  # drop_last; the first batch of a pass is not timed
        ap.error(
            f"--batch-size {args.batch_size}: {len(ds)} images make {len(ds) // args.batch_size} full mini-batches "
            "an epoch, and the demo times the ones after the first: use a smaller --batch-size or more images"
        )
    print(
        f"{len(ds)} images, {len(ds.classes)} classes, policy {args.policy}, batch {args.batch_size}, "
        f"{args.workers} workers, {args.epochs} epochs"
    )
    from torch.utils.data import DataLoader

    from fusionflow import FusionFlowLoader

    common = dict(
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        drop_last=True,
        persistent_workers=args.workers > 0,
    )
    baseline = DataLoader(TorchvisionSamples(ds, args.policy, 224), **common)
    base = train("DataLoader+torchvision", baseline, lambda e: None, len(ds.classes), args)
    del baseline  # its persistent workers end before FusionFlow's start (not 2 more processes through its run)
    out_dir = args.profile_dir or os.path.join(data_home(), "demo_profile")
    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, "trace.json")
    with FusionFlowLoader(ds, policy=args.policy, seed=0, **common) as loader, loader.trace(trace_path):
        ours = train("FusionFlowLoader", loader, loader.set_epoch, len(ds.classes), args)
    ratio = ours["img_per_s"] / base["img_per_s"]
    print(
        f"throughput: FusionFlowLoader {ours['img_per_s']:.1f} img/s vs DataLoader+torchvision "
        f"{base['img_per_s']:.1f} img/s -> {ratio:.2f}x"
    )
    _say_where_time_went(trace_path, os.path.join(out_dir, "timeline.png"))
    return 0


def _say_where_time_went(trace_path: str, png: str) -> None:
    from fusionflow.loader.trace import load
    from fusionflow.tools.timeline import plot_timeline

    try:
        plot_timeline(load(trace_path), png)
    except ImportError as e:  # matplotlib is the `plot` extra's: the training and its comparison stand
        print(f"no timeline: {e}", file=sys.stderr)
        png = "(no timeline)"
    print(
        f"where FusionFlow's time went: {png} (trace: {trace_path}, open at https://ui.perfetto.dev; "
        f"on your data: python -m fusionflow profile --data DIR)"
    )
