"""The processes of tests/test_shared.py: a SharedLoader producer and its clients, each its own
program (`python tests/shared_jobs.py producer|client ...`), as co-located training jobs are.

A client writes what it got to a JSON file, per epoch: the producer's epoch number, the batch sizes,
the labels (the dataset's labels are sample indices) and a digest of each sample's pixels; so
clients with different batch sizes compare sample by sample."""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from test_loader import JPEGS, SMALL  # noqa: E402


class Indexed:
    """`n` small JPEGs (test_loader's, cycled) whose labels are their indices: batches say which
    samples they hold."""

    def __init__(self, n: int):
        self.n = n
        self.sizes = [len(JPEGS[i % len(JPEGS)]) for i in range(n)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return JPEGS[i % len(JPEGS)], i


def make_loader(batch_size: int, n: int, drop_last: bool):
    """The producer's loader; the tests build the same one as their reference."""
    from fusionflow import FusionFlowLoader

    return FusionFlowLoader(
        Indexed(n),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        num_workers=2,
        policy=SMALL,
        seed=7,
        drop_last=drop_last,
    )


def digests(images: torch.Tensor) -> list[str]:
    return [hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest()[:16] for img in images]


def producer(a) -> int:
    from fusionflow import SharedLoader

    loader = make_loader(a.batch_size, a.n, a.drop_last)
    if a.no_close:  # the process ends without close(): the record must go with it
        SharedLoader(loader, name=a.name, buffer=a.buffer).serve(epochs=a.epochs, min_clients=a.min_clients)
        return 0
    with SharedLoader(loader, name=a.name, buffer=a.buffer) as shared:
        shared.serve(epochs=a.epochs, min_clients=a.min_clients)
    return 0


def _wait_for(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.02)


def client(a) -> int:
    from fusionflow import SharedLoaderClient

    _wait_for(a.start_after)
    loader = SharedLoaderClient(a.name, batch_size=a.batch_size, timeout=a.timeout)
    if a.attached:
        open(a.attached, "w").close()
    out = {"len": len(loader), "epochs": []}
    for _ in range(a.epochs):
        got = {"sizes": [], "labels": [], "digests": []}
        for i, batch in enumerate(loader):
            assert type(batch) is list  # as DataLoader's default_collate gives it
            images, labels = batch
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 24, 24)
            got["sizes"].append(len(labels))
            got["labels"] += labels.tolist()
            got["digests"] += digests(images)
            if a.pause_after is not None and i + 1 == a.pause_after and not out["epochs"]:
                open(a.paused, "w").close()
                _wait_for(a.resume_after)
                if a.resume_after is None:
                    time.sleep(3600)  # to be SIGKILLed
        got["epoch"] = loader.epoch
        out["epochs"].append(got)
    out["wait_seconds"] = sum(loader.stats.wait_seconds)
    loader.close()
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "client"])
    ap.add_argument("--name", required=True)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--buffer", type=int, default=None)
    ap.add_argument("--min-clients", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--no-close", action="store_true", help="producer: end without SharedLoader.close()")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--start-after", help="attach once this file exists")
    ap.add_argument("--attached", help="create this file once attached")
    ap.add_argument("--pause-after", type=int, help="in the first epoch, after this many batches ...")
    ap.add_argument("--paused", help="... create this file and ...")
    ap.add_argument("--resume-after", help="... wait for this one (none: sleep, to be killed)")
    a = ap.parse_args()
    return producer(a) if a.role == "producer" else client(a)


if __name__ == "__main__":
    sys.exit(main())
