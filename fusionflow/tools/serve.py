"""`python -m fusionflow serve --data DATA --name NAME --epochs N [...]`: a SharedLoader from a shell.

DATA: an ImageFolder root (one folder per class), or WebDataset tar shards (a `.tar` path, a glob
or brace notation: `/data/train-{000000..000146}.tar`) with --image-key / --target-key.

One producer per (dataset, policy, seed) on a node: it augments each epoch once and serves it to
every training job that opened `SharedLoaderClient(NAME)`. It waits for --min-clients before the
first epoch, prints a line per epoch, and exits 0 once every epoch went to every attached client
(Ctrl-C or SIGTERM stops it; the clients then raise SharedLoaderError).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from fusionflow.tools.cli import add_on_error, failed_sample


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fusionflow serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", required=True, help="an ImageFolder root, or tar shards (path, glob, {a..b})")
    ap.add_argument("--image-key", help="tar shards: the image member's extension(s), comma-separated (default: jpg)")
    ap.add_argument("--target-key", help="tar shards: the target member's extension, 'none' for none (default: cls)")
    ap.add_argument("--name", required=True, help="what clients call it: SharedLoaderClient(NAME)")
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--policy", default=None, help="a shipped policy name or a YAML path (default: crop + flip)")
    ap.add_argument("--seed", type=int, default=0, help="augmentation and shuffle order: a run repeats exactly")
    ap.add_argument("--min-clients", type=int, default=1)
    ap.add_argument("--buffer", type=int, default=None, help="mini-batches ahead of the slowest client")
    ap.add_argument("--tiny-batch-size", type=int, default=None)
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--no-shuffle", action="store_true")
    add_on_error(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    is_shards = _check(ap, a)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from fusionflow import FusionFlowLoader, SharedLoader
    from fusionflow.errors import FusionFlowError

    ds = _dataset(ap, a, is_shards)
    # kill, docker stop, scancel: the clients are told, the record goes; set before the loader is built (a SIGTERM
    # in between ended the process by the signal's default, -15, not 143)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        loader = FusionFlowLoader(
            ds,
            batch_size=a.batch_size,
            shuffle=not a.no_shuffle,
            num_workers=a.workers,
            policy=a.policy,
            seed=a.seed,
            generator=torch.Generator().manual_seed(a.seed),
            tiny_batch_size=a.tiny_batch_size,
            drop_last=a.drop_last,
            on_error=a.on_error,
        )
    except (OSError, ValueError, TypeError) as e:  # the policy's file or keys, above all
        ap.error(str(e))
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while it is built: nothing runs yet
        print(f"{e if isinstance(e, Stopped) else 'interrupted'} while starting", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    if len(loader) == 0:
        loader.close()
        ap.error(f"--batch-size {a.batch_size} with --drop-last: the {len(ds)} images make no mini-batch")
    try:
        shared = SharedLoader(loader, name=a.name, buffer=a.buffer)
    except (
        ValueError,
        FusionFlowError,
    ) as e:  # the name served already, a ring /dev/shm cannot hold: said, no traceback
        loader.close()
        ap.error(str(e))
    except OSError as e:  # the machine's: FUSIONFLOW_RUNTIME_DIR unusable (not a private directory of this user's)
        loader.close()
        print(f"python -m fusionflow serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while it starts: nothing served yet
        loader.close()
        print(f"{e if isinstance(e, Stopped) else 'interrupted'} while starting", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    return _serve_epochs(shared, loader, len(ds), a)


def _serve_epochs(shared, loader, images: int, a) -> int:
    """The epochs, said as they end; the exit status (a signal's: 130, 143)."""
    from fusionflow.errors import SampleError

    try:
        with shared:
            print(f"serving {images} images of {a.data} as {a.name!r}: {a.epochs} epochs of {len(loader)} batches")
            for epoch in range(a.epochs):
                _raise_if_stopped()
                t0, before = time.perf_counter(), loader.stats.samples
                shared.serve(epochs=1, min_clients=a.min_clients)
                n, dt = loader.stats.samples - before, time.perf_counter() - t0
                print(
                    f"epoch {epoch + 1}/{a.epochs}: {n} images to {shared.epoch_clients} clients in {dt:.1f} s "
                    f"({n / dt:.0f} img/s)",
                    flush=True,
                )
    except KeyboardInterrupt as e:  # Ctrl-C, or a Stopped signal: the shell's status for it (130, 143)
        print(f"{e if isinstance(e, Stopped) else 'interrupted'}: the clients were told", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    except SampleError as e:  # the clients were told it failed, and why
        return failed_sample("python -m fusionflow serve", e, skipping=a.on_error == "skip")
    return 0


def _dataset(ap, a, is_shards: bool):
    """The ImageFolder or TarShards DATA names; what cannot be read is a usage error."""
    from fusionflow import ImageFolder, TarShards

    try:
        if is_shards:
            target_key, image_key = a.target_key or "cls", a.image_key or "jpg"
            target = None if target_key == "none" else tuple(target_key.split(","))
            return TarShards(a.data, image_key=tuple(image_key.split(",")), target_key=target)
        return ImageFolder(a.data)
    except (OSError, ValueError) as e:
        ap.error(f"--data {a.data!r}: {e}")


def _check(ap, a) -> bool:
    """Refuse what can be refused before the dataset's scan (a usage error, exit 2); whether DATA is tar shards."""
    for name in ("epochs", "batch_size", "workers", "min_clients", "buffer", "tiny_batch_size"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    from fusionflow.shared.rendezvous import check_name

    try:
        check_name(a.name)
    except ValueError as e:
        ap.error(str(e).replace("name=", "--name "))
    is_shards = a.data.endswith(".tar") or (not os.path.isdir(a.data) and any(c in a.data for c in "*?[{"))
    if not os.path.isdir(a.data) and not is_shards:
        ap.error(
            f"--data {a.data!r} is neither a directory (an ImageFolder root: one folder per class) nor tar "
            "shards (a .tar path, a glob or brace notation)"
        )
    keys = [f"--{k}" for k in ("image-key", "target-key") if getattr(a, k.replace("-", "_")) is not None]
    if keys and not is_shards:  # an ImageFolder's images are its files, its targets its folders
        ap.error(f"{' and '.join(keys)} name tar shard members; --data {a.data!r} is an ImageFolder root")
    return is_shards


class Stopped(KeyboardInterrupt):
    """The producer stopped by a signal (SIGTERM: kill, docker stop, scancel); its clients are told so."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


_STOPPED: list[int] = []  # the signal that stopped the producer, once one came


def _interrupted(signum, frame):
    _STOPPED.append(signum)
    raise Stopped(signum)


def _raise_if_stopped() -> None:
    """A SIGTERM that came while the loader forked its workers: its Stopped, raised inside the fork's at-fork hooks
    (logging's), was printed and dropped by CPython, and serve went on waiting for clients -- until a second one."""
    if _STOPPED:
        raise Stopped(_STOPPED[0])
