"""One rank of tests/test_timm_loader.py's torchrun test: timm's train.py calls (create_dataset,
fusionflow.timm.create_loader with distributed=True) under gloo; writes what the rank saw."""

import json
import os
import sys

import torch
import torch.distributed as dist
from timm.data import create_dataset

from fusionflow.timm import create_loader


def main(root: str, out_dir: str, repeats: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ds = create_dataset("", root=root, split="train", is_training=True)
    loader = create_loader(
        ds, (3, 32, 32), 4, is_training=True, distributed=True, num_aug_repeats=repeats, num_workers=1,
        device=torch.device("cpu"), auto_augment="rand-m9", pin_workers=False, timeout=120,
    )  # fmt: skip
    seen = {}
    with loader.fusionflow:
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)  # as train.py's _set_loader_epoch
            seen[epoch] = [(int(t), float(x[i].double().sum())) for x, y in loader for i, t in enumerate(y)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "sampler": type(loader.sampler).__name__}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
