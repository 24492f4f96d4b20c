"""create_loader's arguments checked and turned into FusionFlow's parts: the policy (timm's own
`create_transform` read by `policy_from_transform`), the dataset as raw samples, the sampler timm
builds, the FusionFlowLoader, and the batch-level work of timm's prefetcher and mixup collate
(fusionflow/timm/batch.py). Everything FusionFlow cannot express is refused here, at build time,
naming the argument and what to do -- never per sample."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PROBABILITIES = ("hflip", "vflip", "grayscale_prob", "gaussian_blur_prob", "color_jitter_prob", "re_prob")
SCHEDULED = ("input_size_choices", "batch_size_choices", "batch_choice_weights", "num_batches")
TRANSFORM_ARGS = (
    "is_training no_aug train_crop_mode scale ratio hflip vflip color_jitter color_jitter_prob grayscale_prob "
    "gaussian_blur_prob auto_augment interpolation mean std crop_pct crop_mode crop_border_pixels re_prob re_mode "
    "re_count tf_preprocessing"
).split()
# a policy field policy_from_transform refused (out of range) -> the create_loader argument that set it
FIELDS = (("crop.resize", "crop_pct / crop_mode"), ("output.size", "input_size"), ("augment.", "auto_augment"))
# the transform policy_from_transform refused -> the create_loader argument that put it there
CAUSES = {
    "RandomGrayscale": "grayscale_prob",
    "RandomApply": "color_jitter_prob / gaussian_blur_prob",
    "GaussianBlur": "gaussian_blur_prob",
    "ColorJitter": "color_jitter",
    "AutoAugment": "auto_augment",
    "RandAugment": "auto_augment",
    "AugMixAugment": "auto_augment",
    "RandomResizedCropAndInterpolation": "scale / ratio / interpolation",
    "ResizeKeepRatio": "train_crop_mode / crop_mode",
    "RandomCropOrPad": "train_crop_mode",
    "CenterCropOrPad": "crop_mode / crop_border_pixels",
    "Resize": "crop_mode / crop_pct / interpolation",
    "CenterCrop": "crop_mode / crop_pct",
}


@dataclass
class TimmArguments:
    """timm.data.create_loader's arguments, as given (fusionflow/timm/loader.py has the signature)."""

    input_size: Any
    batch_size: int
    is_training: bool
    no_aug: bool
    re_prob: float
    re_mode: str
    re_count: int
    re_split: bool
    train_crop_mode: Any
    scale: Any
    ratio: Any
    hflip: float
    vflip: float
    color_jitter: Any
    color_jitter_prob: Any
    grayscale_prob: float
    gaussian_blur_prob: float
    auto_augment: Any
    num_aug_repeats: int
    num_aug_splits: int
    interpolation: str
    mean: Any
    std: Any
    num_workers: int
    distributed: bool
    crop_pct: Any
    crop_mode: Any
    crop_border_pixels: Any
    collate_fn: Any
    pin_memory: bool
    fp16: bool
    img_dtype: Any
    device: Any
    use_prefetcher: bool
    use_multi_epochs_loader: bool
    persistent_workers: bool
    worker_seeding: Any
    tf_preprocessing: bool
    input_size_choices: Any
    batch_size_choices: Any
    batch_choice_weights: Any
    batch_choice_seed: int
    batch_choice_schedule: str
    batch_schedule_epochs: Any
    batch_schedule_spread: float
    batch_schedule_random_mix: float
    num_batches: Any


@dataclass
class Built:
    loader: Any  # the FusionFlowLoader
    prep: Any  # BatchPrep or None
    sampler: Any  # the sampler timm would have built, or None
    views: int = 1  # AugMix splits: without the prefetcher a batch is a list of one tensor per view, as timm's


# FusionFlowLoader arguments create_loader derives from timm's, refused among its extra keywords (a policy given
# there replaced the transform and its normalisation silently; the others clashed with timm's own). A worker_init_fn
# there runs after timm's worker seeding.
DERIVED = {
    "policy": "the policy is the transform timm's arguments describe (input_size, auto_augment, mean/std, ...); "
    "set those, or use FusionFlowLoader(policy=...) directly",
    "shuffle": "is_training=True shuffles (and drops the last partial batch), as timm's loader does",
    "drop_last": "is_training=True drops the last partial batch, as timm's loader does",
    "sampler": "timm's loader picks its sampler from distributed= and num_aug_repeats=",
    "batch_sampler": "timm's loader batches by batch_size=",
}


def refuse(argument: str, why: str):
    raise ValueError(f"fusionflow.timm.create_loader({argument}): {why}")


def check(dataset, a: TimmArguments) -> int:
    """The refusals that need no transform; returns the AugMix views per sample (1: none)."""
    for name in PROBABILITIES:  # timm passes them on unchecked: above 1 reads as 1, below 0 as 0
        p = getattr(a, name)
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1):
            refuse(f"{name}={p!r}", "a probability must be a number in [0, 1] (1: always)")
    for name in SCHEDULED:
        if getattr(a, name) is not None:
            refuse(f"{name}=...", "scheduled input and batch sizes are not supported; use timm.data.create_loader")
    if a.tf_preprocessing and a.use_prefetcher:  # (without the prefetcher timm's create_transform ignores it)
        refuse("tf_preprocessing=True", "TF's preprocessing is timm's port-testing path; use timm.data.create_loader")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        refuse(
            f"dataset={type(dataset).__name__}",
            "a stream (timm's IterableImageDataset, e.g. wds/tfds): FusionFlow needs random access; "
            "for tar shards use fusionflow.TarShards with FusionFlowLoader",
        )
    size = a.input_size
    if isinstance(size, (tuple, list)) and len(size) == 3 and size[0] != 3:
        refuse(f"input_size={tuple(size)}", "FusionFlow delivers 3-channel RGB images")
    augmix = type(dataset).__name__ == "AugMixDataset"
    if a.num_aug_splits == 1 or a.num_aug_splits < 0:
        refuse(f"num_aug_splits={a.num_aug_splits}", "use 0 (no splits) or >= 2, as timm's train.py requires")
    if a.num_aug_splits and not augmix:
        refuse(
            f"num_aug_splits={a.num_aug_splits}",
            "the dataset must be timm's AugMixDataset(dataset, num_splits=...), as train.py wraps it",
        )
    if augmix and a.num_aug_splits != dataset.num_splits:
        refuse(
            f"num_aug_splits={a.num_aug_splits}",
            f"the AugMixDataset has num_splits={dataset.num_splits}; pass the same number",
        )
    if a.num_aug_repeats and not a.distributed:
        refuse(f"num_aug_repeats={a.num_aug_repeats}", "repeated augmentation needs distributed=True, as in timm")
    mixup = fast_mixup(a.collate_fn)
    if mixup is not None and "half" in mixup.mode:
        refuse("collate_fn=FastCollateMixup(mode='half')", "mode 'half' is not supported; use 'elem'")
    if a.num_aug_splits and mixup is None and not _is_plain(a.collate_fn):
        refuse(
            "collate_fn=...",
            "with num_aug_splits FusionFlow delivers each view as a sample, where timm's collate_fn gets a tuple of "
            "views per sample: leave collate_fn unset (timm's fast collate or default_collate)",
        )
    if mixup is not None and a.num_aug_splits:
        refuse("collate_fn=FastCollateMixup", "with num_aug_splits: not defined by timm either (train.py asserts)")
    if mixup is not None and not a.use_prefetcher:
        refuse("collate_fn=FastCollateMixup", "needs use_prefetcher=True (without it, apply timm's Mixup in the loop)")
    return a.num_aug_splits or 1


def fast_mixup(collate_fn):
    """timm's FastCollateMixup when that is the collate_fn, else None."""
    if collate_fn is None:
        return None
    try:
        from timm.data.mixup import FastCollateMixup
    except ImportError:
        return None
    return collate_fn if isinstance(collate_fn, FastCollateMixup) else None


def build_policy(a: TimmArguments, views: int, normalize_in_workers: bool, decode: str = "fast"):
    """The policy of the transform timm's create_loader would set on the dataset, decoding in `decode` mode."""
    from timm.data import create_transform

    from fusionflow.policy.from_torchvision import policy_from_transform

    kw = {name: getattr(a, name) for name in TRANSFORM_ARGS}
    kw["re_num_splits"] = (a.num_aug_splits or 2) if a.re_split else 0
    if a.use_prefetcher and normalize_in_workers:
        kw.update(use_prefetcher=False, re_prob=0.0)  # normalised by the workers, erased on the batch
    else:
        kw["use_prefetcher"] = a.use_prefetcher
    transform = create_transform(a.input_size, separate=views > 1, **kw)
    if views > 1:
        import torchvision.transforms as T

        transform = T.Compose([t for part in transform for t in part.transforms])
    try:
        policy = policy_from_transform(transform, decode=decode)
    except ValueError as e:
        refused = re.search(r"transform \d+ \((\w+)", str(e))
        cause = CAUSES.get(refused.group(1)) if refused else next((arg for f, arg in FIELDS if f in str(e)), None)
        if cause is not None and cause.isidentifier():  # one argument: named with its value
            cause = f"{cause}={getattr(a, cause)!r}"
        args = cause or ", ".join(f"{k}={v!r}" for k, v in kw.items() if v not in (None, 0, 0.0, False))
        refuse(args, f"timm's transform for these arguments is not expressible: {e}")
    return dataclasses.replace(policy, views=views) if views > 1 else policy


def decode_mode(decode, a: TimmArguments) -> str:
    """FusionFlow's `decode=` keyword: "fast" (DCT-scaled decoding, resized by faster filters) or "exact" (timm's
    pixels: Pillow's decode and resize). None: fast for training, where augmentation dwarfs the difference, exact
    for evaluation, whose accuracy is then timm's (a large shrink reads 33-50 dB from Pillow's in fast mode)."""
    if decode is None:
        return "fast" if a.is_training else "exact"
    if decode not in ("fast", "exact"):
        refuse(f"decode={decode!r}", "use 'fast' or 'exact' (None: fast for training, exact for evaluation)")
    return decode


def build_sampler(dataset, a: TimmArguments):
    """The sampler timm's create_loader builds (None: batches from shuffle / sequential order)."""
    if not a.distributed:
        return None
    from timm.data.distributed_sampler import OrderedDistributedSampler, RepeatAugSampler

    if not a.is_training:
        return OrderedDistributedSampler(dataset)
    if a.num_aug_repeats:
        return RepeatAugSampler(dataset, num_repeats=a.num_aug_repeats)
    return torch.utils.data.distributed.DistributedSampler(dataset)


class WorkerSeeding:
    """timm's `worker_seeding` in a FusionFlow worker, as timm's worker init: 'all' seeds numpy from the worker's
    seed (get_worker_info().seed: the epoch's base seed + id, new each epoch, as DataLoader's; random and torch are
    seeded from it at the worker's start), 'part' leaves numpy alone, a callable gets the worker's info (`id`,
    `seed`, `num_workers`, `dataset`) and returns the seed random, torch and numpy take. Outside a worker (no
    worker info) the seed is the loader's seed + worker id."""

    def __init__(self, mode, seed: int, num_workers: int, then=None):
        if not callable(mode) and mode not in ("all", "part"):
            refuse(f"worker_seeding={mode!r}", "use 'all', 'part' or a callable, as timm")
        self.mode, self.seed, self.num_workers = mode, seed, num_workers
        self.then = then  # a worker_init_fn given among create_loader's extra keywords: called after the seeding

    def __call__(self, worker_id: int) -> None:
        from types import SimpleNamespace

        info = torch.utils.data.get_worker_info()
        if info is None:  # (not in a worker: seeded as one with the loader's seed would be)
            info = SimpleNamespace(id=worker_id, seed=(self.seed + worker_id) % 2**63, num_workers=self.num_workers)
            info.dataset = None
            random.seed(info.seed)
            torch.manual_seed(info.seed)
        seed = info.seed
        if callable(self.mode):  # timm passes torch's WorkerInfo: the dataset too (the worker's get_worker_info's)
            seed = self.mode(
                SimpleNamespace(id=worker_id, seed=seed, num_workers=self.num_workers, dataset=info.dataset)
            )
            random.seed(seed)
            torch.manual_seed(seed)
        if self.mode != "part":
            np.random.seed(seed % (2**32 - 1))
        if self.then is not None:
            self.then(worker_id)


def _check_skip(views: int, a: TimmArguments) -> None:
    """on_error='skip' leaves a batch short by the samples it drops: refused where that breaks timm's batches."""
    if views > 1:
        refuse(
            "on_error='skip'", "with num_aug_splits a skipped sample would leave its views misaligned (keep 'raise')"
        )
    if fast_mixup(a.collate_fn) is not None:
        refuse(
            "on_error='skip'",
            "timm's mixup (FastCollateMixup, or Mixup in the loop) needs even batches, and a skipped sample "
            "leaves its batch one short (keep 'raise')",
        )


def resolve(dataset, a: TimmArguments, loader_kwargs: dict) -> Built:
    from fusionflow.datasets.timm_reader import timm_samples
    from fusionflow.datasets.views import SplitBatches, SplitViews
    from fusionflow.loader import FusionFlowLoader

    views = check(dataset, a)
    check_keywords(loader_kwargs, FusionFlowLoader)
    for name, why in DERIVED.items():  # FusionFlowLoader arguments create_loader makes from timm's own
        if name in loader_kwargs:
            refuse(f"{name}=...", why)
    if loader_kwargs.get("on_error") == "skip":
        _check_skip(views, a)
    device = torch.device(a.device) if a.use_prefetcher else torch.device("cpu")
    custom = fast_mixup(a.collate_fn) is None and not _is_plain(a.collate_fn)  # the script's collate_fn: uint8 in
    # uint8 to the device, normalised there; on the CPU the workers normalise, unless a collate_fn of the script's
    # own comes between (timm's gets uint8 samples and its prefetcher normalises the collated batch)
    normalize_after = device.type != "cpu" or custom
    policy = build_policy(a, views, not normalize_after, decode_mode(loader_kwargs.pop("decode", None), a))
    base = dataset.dataset if views > 1 else dataset
    samples = timm_samples(base)
    sampler = build_sampler(base, a)
    seed, given = _seed(loader_kwargs)
    if a.is_training and sampler is None and "generator" not in loader_kwargs:
        # the shuffle's own generator, seeded once from torch's: an order drawn from the global generator
        # would move with every draw the training process makes (the prefetcher's erasing noise, dropout),
        # so the next epoch's order could not be known ahead and its speculated work was thrown away
        loader_kwargs["generator"] = torch.Generator().manual_seed(int(torch.randint(2**62, ()).item()))
    kw = dict(
        num_workers=a.num_workers,
        pin_memory=a.pin_memory,
        persistent_workers=a.persistent_workers and a.num_workers > 0,
        worker_init_fn=WorkerSeeding(a.worker_seeding, seed, a.num_workers, loader_kwargs.pop("worker_init_fn", None)),
        policy=policy,
        device=device,
        seed=seed,
        collate_fn=a.collate_fn if custom else None,
    )
    kw.update(loader_kwargs)
    batching = dict(
        batch_size=a.batch_size,
        shuffle=sampler is None and a.is_training,
        sampler=sampler,
        drop_last=a.is_training,
    )
    if views > 1:
        samples = SplitViews(samples, views)
        if sampler is not None:
            order = sampler
        elif a.is_training:
            order = torch.utils.data.RandomSampler(base, generator=loader_kwargs.pop("generator"))
        else:
            order = torch.utils.data.SequentialSampler(base)
        inner = torch.utils.data.BatchSampler(order, a.batch_size, a.is_training)
        batching = dict(batch_sampler=SplitBatches(inner, views))
    prep = _prep(a, device, normalize_after) if a.use_prefetcher else None  # (its arguments checked first)
    loader = FusionFlowLoader(samples, **batching, **kw)
    if not given:  # drawn here for timm's worker seeding: a resumed state's seed replaces it without a warning
        loader.config = loader.config.with_config(seed_given=False)
    return Built(loader, prep, sampler, views)


def _seed(loader_kwargs: dict) -> tuple[int, bool]:
    """The loader's seed and whether the script gave it; else drawn now: timm's worker seeding is made here, before
    the loader's first epoch."""
    from fusionflow.loader.config import resolve_seed

    seed = resolve_seed(loader_kwargs.pop("seed", None), loader_kwargs.get("generator"))
    return (seed, True) if seed is not None else (int(torch.randint(2**62, ()).item()), False)


def check_keywords(loader_kwargs: dict, loader_class) -> None:
    """Keywords beyond timm's must be FusionFlowLoader's (or `decode`): else the TypeError names create_loader
    (not FusionFlowLoader, which the script never called) and the nearest argument of either."""
    known = [*inspect.signature(loader_class.__init__).parameters, "decode"]
    for name in loader_kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(TimmArguments)] + known, 1)
            hint = f": did you mean {close[0]!r}?" if close else " (neither timm's create_loader nor FusionFlowLoader)"
            raise TypeError(f"fusionflow.timm.create_loader() got an unexpected keyword argument {name!r}{hint}")


def _prep(a: TimmArguments, device, normalize: bool):
    """timm's prefetcher's work on each delivered batch: normalise (`normalize`: uint8 delivered; else only a cast,
    the workers normalised), FastCollateMixup's mixing, RandomErasing."""
    from fusionflow.timm.batch import BatchPrep

    img_dtype = torch.float16 if a.fp16 else (a.img_dtype or torch.float32)
    if not (isinstance(img_dtype, torch.dtype) and img_dtype.is_floating_point):  # timm's prefetcher fails at div_
        raise ValueError(f"img_dtype={img_dtype!r} must be a floating torch dtype: the prefetcher normalises images")
    re_prob = a.re_prob if a.is_training and not a.no_aug else 0.0
    erasing = None
    if re_prob > 0:
        from timm.data.random_erasing import RandomErasing

        erasing = RandomErasing(re_prob, mode=a.re_mode, max_count=a.re_count, num_splits=kw_splits(a), device=device)
    return BatchPrep(a.mean, a.std, img_dtype, device, normalize, fast_mixup(a.collate_fn), erasing)


def kw_splits(a: TimmArguments) -> int:
    """RandomErasing's num_splits as timm's create_loader sets it (re_split: the first split is left clean)."""
    return (a.num_aug_splits or 2) if a.re_split else 0


def _is_plain(collate_fn) -> bool:
    """No collating to do: None, DataLoader's default_collate, or timm's fast_collate (stacks uint8)."""
    if collate_fn is None or collate_fn is torch.utils.data.default_collate:
        return True
    return getattr(collate_fn, "__name__", None) == "fast_collate" and "timm" in getattr(collate_fn, "__module__", "")
