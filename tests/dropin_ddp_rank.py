"""One rank of tests/test_timm_loader.py's torchrun tests, as a script written for the other loader
makes its loader: timm's train.py (create_dataset + fusionflow.timm.create_loader, distributed=True) or
torchvision's reference train.py (its ImageFolder with a transform, its DistributedSampler or RASampler,
given to FusionFlowLoader instead of DataLoader). Writes what the rank saw."""

import hashlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

UNSHARDED = "gives every rank the whole dataset"  # fusionflow/loader/delivery.py warn_if_unsharded


def timm_loader(root: str, repeats: int):
    from timm.data import create_dataset

    from fusionflow.timm import create_loader

    ds = create_dataset("", root=root, split="train", is_training=True)
    return create_loader(
        ds, (3, 32, 32), 4, is_training=True, distributed=True, num_aug_repeats=repeats, num_workers=1,
        device=torch.device("cpu"), auto_augment="rand-m9", pin_workers=False, timeout=120,
    )  # fmt: skip


def torchvision_loader(root: str, repeats: int):
    import torchvision
    import torchvision.transforms.v2 as T
    from timm.data.distributed_sampler import RepeatAugSampler  # DeiT's RASampler, as torchvision's own
    from torch.utils.data import DistributedSampler

    from fusionflow import FusionFlowLoader

    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.RandAugment(), T.PILToTensor()])
    ds = torchvision.datasets.ImageFolder(root, tf)
    sampler = RepeatAugSampler(ds, num_repeats=repeats) if repeats else DistributedSampler(ds)
    return FusionFlowLoader(ds, batch_size=4, sampler=sampler, num_workers=1, pin_workers=False, timeout=120)


def main(kind: str, root: str, out_dir: str, repeats: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    loader = (timm_loader if kind == "timm" else torchvision_loader)(root, repeats)
    seen = {}
    try:
        with warnings.catch_warnings(record=True) as caught:  # a sampler that deals shares: never warned about
            warnings.simplefilter("always")
            for epoch in range(2):
                loader.sampler.set_epoch(epoch)  # as both scripts do
                # a sample's pixels by their hash (a sum would not tell a crop from its mirror image)
                seen[epoch] = [
                    (int(t), hashlib.sha1(x[i].numpy().tobytes()).hexdigest())
                    for x, y in loader
                    for i, t in enumerate(y)
                ]
    finally:
        loader.close()
    from fusionflow import FusionFlowLoader, ImageFolder

    # the script Lightning or Accelerate would run: shuffle=True, no DistributedSampler (they insert one into
    # DataLoaders only): every rank would read the whole set, which the loader says
    with warnings.catch_warnings(record=True) as plain, FusionFlowLoader(ImageFolder(root), 4, shuffle=True) as whole:
        warnings.simplefilter("always")
        next(iter(whole))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        unsharded = [sum(UNSHARDED in str(w.message) for w in ws) for ws in (caught, plain)]
        json.dump({"seen": seen, "sampler": type(loader.sampler).__name__, "unsharded": unsharded}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
