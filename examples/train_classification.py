"""Image classification training, written the way torchvision's classification recipe is (its flags,
its transforms), where one flag switches the data loading:

    --loader torchvision   torch DataLoader + torchvision.transforms.v2 in the dataset
    --loader fusionflow    FusionFlowLoader running the same transforms, converted by
                           fusionflow.policy_from_transform (a ValueError if they cannot be)

Everything else -- model, optimiser, MixUp/CutMix collate, RASampler, DDP -- is the same code.
A couple of steps on a synthetic ImageFolder, on the CPU:

    python examples/train_classification.py --data-path /tmp/ff-synth --synthetic --loader fusionflow \
        --model resnet18 --train-crop-size 64 --val-resize-size 72 --val-crop-size 64 --batch-size 8 \
        --steps 2 --auto-augment ra --random-erase 0.25 --mixup-alpha 0.2 --cutmix-alpha 1.0 --ra-sampler

Under torchrun (DDP) each rank loads its share through the sampler (DistributedSampler or RASampler);
FusionFlow's ranks also lend each other CPU workers. --output-dir saves a checkpoint per rank after each epoch
(--save-every N steps also mid-epoch: FusionFlow's state_dict() says which batches are done); --resume DIR goes on
from the newest save every rank finished, a mid-epoch one with the epoch's remaining batches.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torchvision
import torchvision.transforms.v2 as T
from torch.utils.data import DataLoader, Sampler, default_collate
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms.v2 import InterpolationMode

log = logging.getLogger("train_classification")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train_transform(args) -> T.Compose:
    """torchvision's training preset: crop, flip, auto-augment, tensor, normalise, erase."""
    interpolation = InterpolationMode(args.interpolation)
    steps = [T.RandomResizedCrop(args.train_crop_size, interpolation=interpolation, antialias=True)]
    if args.hflip_prob > 0:
        steps.append(T.RandomHorizontalFlip(args.hflip_prob))
    if args.auto_augment == "ra":
        steps.append(T.RandAugment(interpolation=interpolation, magnitude=args.ra_magnitude))
    elif args.auto_augment == "ta_wide":
        steps.append(T.TrivialAugmentWide(interpolation=interpolation))
    elif args.auto_augment == "augmix":
        steps.append(T.AugMix(interpolation=interpolation, severity=args.augmix_severity))
    elif args.auto_augment is not None:
        steps.append(T.AutoAugment(T.AutoAugmentPolicy(args.auto_augment), interpolation=interpolation))
    steps += [T.PILToTensor(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    if args.random_erase > 0:
        steps.append(T.RandomErasing(p=args.random_erase))
    return T.Compose(steps)


def eval_transform(args) -> T.Compose:
    interpolation = InterpolationMode(args.interpolation)
    return T.Compose(
        [
            T.Resize(args.val_resize_size, interpolation=interpolation, antialias=True),
            T.CenterCrop(args.val_crop_size),
            T.PILToTensor(),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(MEAN, STD),
        ]
    )


class RASampler(Sampler):
    """Repeated augmentation (Hoffer et al. 2020; DeiT): each index `repeats` times per epoch, the
    copies dealt round-robin over the ranks, and each rank's share cut to len(dataset) / world size
    (so an epoch costs what an ordinary one does)."""

    def __init__(self, n: int, num_replicas: int, rank: int, repeats: int = 3, shuffle: bool = True, seed: int = 0):
        self.n, self.num_replicas, self.rank, self.repeats = n, num_replicas, rank, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.per_rank = int(math.ceil(n * repeats / num_replicas))
        self.selected = int(math.floor(n // 256 * 256 / num_replicas)) or int(math.ceil(n / num_replicas))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        order = [i for i in order for _ in range(self.repeats)]
        total = self.per_rank * self.num_replicas
        order += order[: total - len(order)]
        return iter(order[self.rank : total : self.num_replicas][: self.selected])

    def __len__(self) -> int:
        return self.selected


def make_loaders(args, rank: int, world: int):
    """(train, val) loaders and the number of classes; the one place the --loader flag matters."""
    train_tf, eval_tf = train_transform(args), eval_transform(args)
    train_root, val_root = os.path.join(args.data_path, "train"), os.path.join(args.data_path, "val")
    if args.loader == "fusionflow":
        import fusionflow

        train_ds, val_ds = fusionflow.ImageFolder(train_root), fusionflow.ImageFolder(val_root)
    else:
        train_ds = torchvision.datasets.ImageFolder(train_root, train_tf)
        val_ds = torchvision.datasets.ImageFolder(val_root, eval_tf)
    num_classes = len(train_ds.classes)

    if args.ra_sampler:
        train_sampler = RASampler(len(train_ds), world, rank, repeats=args.ra_reps, seed=args.seed)
    elif world > 1:
        train_sampler = DistributedSampler(train_ds, world, rank, seed=args.seed)
    else:
        train_sampler = torch.utils.data.RandomSampler(train_ds, generator=torch.Generator().manual_seed(args.seed))
    val_sampler = (
        DistributedSampler(val_ds, world, rank, shuffle=False)
        if world > 1
        else torch.utils.data.SequentialSampler(val_ds)
    )

    collate_fn = default_collate
    mixes = [T.MixUp(alpha=args.mixup_alpha, num_classes=num_classes)] if args.mixup_alpha > 0 else []
    mixes += [T.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes)] if args.cutmix_alpha > 0 else []
    if mixes:
        mix = T.RandomChoice(mixes)
        collate_fn = lambda batch: mix(*default_collate(batch))  # noqa: E731 (torchvision's recipe, verbatim)

    common = dict(batch_size=args.batch_size, num_workers=args.workers)
    if args.loader == "fusionflow":
        from fusionflow import FusionFlowLoader, policy_from_transform

        train = FusionFlowLoader(
            train_ds,
            sampler=train_sampler,
            collate_fn=collate_fn,
            seed=args.seed,
            policy=policy_from_transform(train_tf),
            device=args.device,
            **common,
        )
        val = FusionFlowLoader(
            val_ds, sampler=val_sampler, policy=policy_from_transform(eval_tf), device=args.device, **common
        )
    else:
        train = DataLoader(
            train_ds, sampler=train_sampler, collate_fn=collate_fn, pin_memory=args.device != "cpu", **common
        )
        val = DataLoader(val_ds, sampler=val_sampler, **common)
    return train, val, train_sampler, num_classes


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed)
    if args.synthetic and rank == 0:
        from fusionflow.tools.synthetic import make_image_folder

        for split, per_class in (("train", args.synthetic_per_class), ("val", max(2, args.synthetic_per_class // 4))):
            make_image_folder(
                os.path.join(args.data_path, split),
                num_classes=args.synthetic_classes,
                per_class=per_class,
                min_side=48,
                max_side=160,
                seed=0 if split == "train" else 1,
            )
    if world > 1:
        dist.barrier()

    train, val, train_sampler, num_classes = make_loaders(args, rank, world)
    device = torch.device(args.device)
    model = torchvision.models.get_model(args.model, num_classes=num_classes).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    result = {"loader": args.loader, "train_losses": [], "val_acc": []}
    try:
        start_epoch = resume(args, rank, model, optimizer, train)
        for epoch in range(start_epoch, args.epochs):
            train_one_epoch(args, epoch, rank, model, optimizer, criterion, train, train_sampler, result)
            validate(args, epoch, model, val, result)
            save(args, rank, epoch, False, model, optimizer, train)
    finally:  # a failure (or a preemption) mid-run still ends the loaders' workers
        for ld in (train, val):
            if hasattr(ld, "close"):
                ld.close()
    if world > 1:
        dist.destroy_process_group()
    return result


def train_one_epoch(args, epoch: int, rank: int, model, optimizer, criterion, train, train_sampler, result) -> None:
    device = torch.device(args.device)
    if hasattr(train_sampler, "set_epoch"):
        train_sampler.set_epoch(epoch)
    if hasattr(train, "set_epoch"):  # FusionFlowLoader: the augmentation epoch (forwards to the sampler)
        train.set_epoch(epoch)
    model.train()
    t0 = time.perf_counter()
    for step, (images, targets) in enumerate(train):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result["train_losses"].append(loss.item())
        log.info(
            "epoch %d step %d loss %.4f (%s, %.2f s)",
            epoch,
            step,
            result["train_losses"][-1],
            args.loader,
            time.perf_counter() - t0,
        )
        if args.save_every and (step + 1) % args.save_every == 0:  # FusionFlow resumes the rest of this epoch
            save(args, rank, epoch, True, model, optimizer, train)
        if args.steps and step + 1 >= args.steps:
            break


def validate(args, epoch: int, model, val, result) -> None:
    model.eval()
    correct = seen = 0
    with torch.inference_mode():
        for step, (images, targets) in enumerate(val):
            out = model(images.to(args.device))
            correct += int((out.argmax(1).cpu() == targets).sum())
            seen += len(targets)
            if args.steps and step + 1 >= args.steps:
                break
    result["val_acc"].append(correct / max(seen, 1))
    log.info("epoch %d val acc %.3f on %d images", epoch, result["val_acc"][-1], seen)


def save(args, rank: int, epoch: int, mid_epoch: bool, model, optimizer, train) -> None:
    """A checkpoint per rank in --output-dir (each rank's loader has its own position): model, optimiser, epoch and,
    with FusionFlow, the loader's state_dict() -- which batches of the epoch are done, whatever the prefetch. Every
    rank saves at the same steps; the n-th save is checkpoint_rank{r}_{n}.pth, and each rank keeps its last two: a
    job killed while some ranks had written save n and others not resumes from save n - 1, which all have."""
    if not args.output_dir:
        return
    os.makedirs(args.output_dir, exist_ok=True)
    args.save_index += 1
    state = {
        "model": getattr(model, "module", model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "mid_epoch": mid_epoch,
        "loader": train.state_dict() if hasattr(train, "state_dict") else None,  # DataLoader has none
        "save_index": args.save_index,
    }
    path = os.path.join(args.output_dir, f"checkpoint_rank{rank}_{args.save_index:06d}.pth")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a run killed while saving keeps the previous checkpoint
    for other in _saves(args.output_dir, rank):  # this save and the one before it stay (a later one: a dead run's)
        if other not in (args.save_index, args.save_index - 1):
            os.remove(os.path.join(args.output_dir, f"checkpoint_rank{rank}_{other:06d}.pth"))
    for name in os.listdir(args.output_dir):  # what a run killed while saving left half-written
        if name.startswith(f"checkpoint_rank{rank}_") and name.endswith(".pth.tmp"):
            os.remove(os.path.join(args.output_dir, name))


def _saves(directory: str, rank: int) -> list[int]:
    """The save numbers of this rank's complete checkpoints in `directory`, oldest first."""
    head = f"checkpoint_rank{rank}_"
    return sorted(int(n[len(head) : -4]) for n in os.listdir(directory) if n.startswith(head) and n.endswith(".pth"))


def _agreed(latest: int) -> int:
    """The smallest of every rank's `latest` (the newest save all ranks finished); `latest` itself without DDP."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return latest
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([latest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def resume(args, rank: int, model, optimizer, train) -> int:
    """Load --resume (a checkpoint file, or an --output-dir holding every rank's): the epoch to start at. From a
    directory, the newest save every rank finished. A checkpoint taken mid-epoch resumes that epoch; FusionFlow's
    loader then yields only the batches not yet trained on."""
    if not args.resume:
        return 0
    path = args.resume
    if os.path.isdir(path):
        mine = _saves(path, rank)
        n = _agreed(mine[-1] if mine else -1)
        if _agreed(int(n in mine)) == 0:  # every rank stops, not only those lacking it (the others would hang)
            raise SystemExit(f"--resume {path}: no checkpoint every rank saved (rank {rank} has saves {mine})")
        for later in (k for k in mine if k > n):  # the killed run's, past what every rank has: never resumed from
            os.remove(os.path.join(path, f"checkpoint_rank{rank}_{later:06d}.pth"))
        path = os.path.join(path, f"checkpoint_rank{rank}_{n:06d}.pth")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    args.save_index = ckpt.get("save_index", 0)  # the next save numbers on from the one resumed
    getattr(model, "module", model).load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["loader"] is not None and hasattr(train, "load_state_dict"):
        train.load_state_dict(ckpt["loader"])
    log.info("resumed from %s: epoch %d%s", path, ckpt["epoch"], " (mid-epoch)" if ckpt["mid_epoch"] else "")
    return ckpt["epoch"] + (0 if ckpt["mid_epoch"] else 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", required=True, help="ImageFolder root with train/ and val/")
    p.add_argument("--loader", choices=("torchvision", "fusionflow"), default="fusionflow")
    p.add_argument("--synthetic", action="store_true", help="write a small synthetic ImageFolder at --data-path first")
    p.add_argument("--synthetic-classes", type=int, default=4)
    p.add_argument("--synthetic-per-class", type=int, default=16)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("-j", "--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop each epoch after this many steps (0: whole epoch)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auto-augment", default=None, help="ra | ta_wide | augmix | imagenet | cifar10 | svhn")
    p.add_argument("--ra-magnitude", type=int, default=9)
    p.add_argument("--augmix-severity", type=int, default=3)
    p.add_argument("--hflip-prob", type=float, default=0.5)
    p.add_argument("--interpolation", default="bilinear", help="bilinear, bicubic or nearest")
    p.add_argument("--train-crop-size", type=int, default=224)
    p.add_argument("--val-resize-size", type=int, default=256)
    p.add_argument("--val-crop-size", type=int, default=224)
    p.add_argument("--mixup-alpha", type=float, default=0.0)
    p.add_argument("--cutmix-alpha", type=float, default=0.0)
    p.add_argument("--random-erase", type=float, default=0.0)
    p.add_argument("--ra-sampler", action="store_true", help="repeated augmentation sampler")
    p.add_argument("--ra-reps", type=int, default=3)
    p.add_argument("--output-dir", default=None, help="save a checkpoint per rank there after each epoch")
    p.add_argument("--save-every", type=int, default=0, help="also every this many steps (mid-epoch)")
    p.add_argument("--resume", default=None, help="a checkpoint, or an --output-dir: the newest save of every rank")
    args = p.parse_args(argv)
    args.save_index = 0  # checkpoints saved so far (`save`; set by `resume`)
    return args


if __name__ == "__main__":
    main()
