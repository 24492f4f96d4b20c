"""`fusionflow.timm.create_loader`: timm's `timm.data.create_loader` (timm 1.0.x, same signature) with
FusionFlow's CPU workers underneath. A timm training script changes one import:

    from fusionflow.timm import create_loader     # was: from timm.data import create_loader

What each argument becomes (fusionflow/timm/arguments.py checks them, refusing at build time what
FusionFlow cannot express, naming the argument):
- the transform arguments (`is_training`, `no_aug`, `scale`, `ratio`, `hflip`, `color_jitter(_prob)`,
  `grayscale_prob`, `auto_augment`, `interpolation`, `crop_pct`, `crop_mode`, `re_*`, `mean`/`std`, ...):
  timm's own `create_transform` builds the transform, `policy_from_transform` reads it into the policy
  the CPU workers run (tests/test_timm.py: the pixels equal timm's given the same draws);
  `train_crop_mode` 'rkrr' / 'rkrc', `crop_mode` 'border' and `crop_border_pixels` are the policy's
  crop.mode keep_ratio and crop.trim (tests/test_timm_crops.py);
- `use_prefetcher`: as timm's PrefetchLoader: batches normalised to `img_dtype` and randomly erased on
  `device`, targets there too (fusionflow/timm/batch.py); on a CUDA device the workers deliver uint8
  and the device normalises, on the CPU the workers normalise. False: the transform's own ToTensor,
  Normalize and RandomErasing run in the workers and batches stay on the CPU, as timm's do;
- `collate_fn`: timm's FastCollateMixup is applied to each delivered batch (timm's Mixup semantics,
  `loader.mixup_enabled` as timm's); None / timm's fast_collate / default_collate: batches as they are;
  any other callable is FusionFlowLoader's collate_fn (a list of (image, target) samples);
- `distributed`, `num_aug_repeats`: the sampler timm builds (DistributedSampler, RepeatAugSampler,
  OrderedDistributedSampler for evaluation), each copy of a repeated index augmented differently;
- `num_aug_splits` with timm's AugMixDataset: the views of each sample share its crop and flip, the
  first is clean, and the batch is ordered as timm's fast collate orders it (views of one kind together);
- `num_workers`, `pin_memory`, `persistent_workers`, `worker_seeding`: as timm's (the seeding applies
  to the workers' `random`/numpy/torch; FusionFlow's augmentation draws are its own, a function of
  (seed, epoch, index)); `use_multi_epochs_loader`: FusionFlow's workers outlive epochs anyway.
`decode=` (FusionFlow's): "fast" or "exact" decoding (fusionflow/timm/arguments.py decode_mode); by default fast for
training and exact for evaluation (is_training=False: timm's pixels, so its accuracy is timm's).
Other keyword arguments beyond timm's go to FusionFlowLoader (`seed=`, `accelerator=`, `timeout=`, ...), except those
it derives from timm's (`policy`, `shuffle`, `drop_last`, `sampler`, `batch_sampler`): refused; a `worker_init_fn` runs
after timm's worker seeding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fusionflow.timm.arguments import TimmArguments, resolve

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
CUDA = torch.device("cuda")  # timm's default device


def create_loader(
    dataset,
    input_size: int | tuple[int, int] | tuple[int, int, int],
    batch_size: int,
    is_training: bool = False,
    no_aug: bool = False,
    re_prob: float = 0.0,
    re_mode: str = "const",
    re_count: int = 1,
    re_split: bool = False,
    train_crop_mode: str | None = None,
    scale: tuple[float, float] | None = None,
    ratio: tuple[float, float] | None = None,
    hflip: float = 0.5,
    vflip: float = 0.0,
    color_jitter: float = 0.4,
    color_jitter_prob: float | None = None,
    grayscale_prob: float = 0.0,
    gaussian_blur_prob: float = 0.0,
    auto_augment: str | None = None,
    num_aug_repeats: int = 0,
    num_aug_splits: int = 0,
    interpolation: str = "bilinear",
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN,
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD,
    num_workers: int = 1,
    distributed: bool = False,
    crop_pct: float | None = None,
    crop_mode: str | None = None,
    crop_border_pixels: int | None = None,
    collate_fn: Callable | None = None,
    pin_memory: bool = False,
    fp16: bool = False,
    img_dtype: torch.dtype = torch.float32,
    device: torch.device = CUDA,
    use_prefetcher: bool = True,
    use_multi_epochs_loader: bool = False,
    persistent_workers: bool = True,
    worker_seeding: str | Callable = "all",
    tf_preprocessing: bool = False,
    input_size_choices: Sequence | None = None,
    batch_size_choices: Sequence[int] | None = None,
    batch_choice_weights: Sequence[float] | None = None,
    batch_choice_seed: int = 0,
    batch_choice_schedule: str = "constant",
    batch_schedule_epochs: int | None = None,
    batch_schedule_spread: float = 0.65,
    batch_schedule_random_mix: float = 0.1,
    num_batches: int | None = None,
    **loader_kwargs,
) -> TimmLoader:
    """timm's create_loader, FusionFlow underneath (the module docstring says what each argument
    becomes). Returns a TimmLoader: iterate it as timm's loader; `.fusionflow` is the FusionFlowLoader."""
    args = TimmArguments(**{k: v for k, v in locals().items() if k not in ("dataset", "loader_kwargs")})
    built = resolve(dataset, args, loader_kwargs)
    return TimmLoader(built.loader, built.prep, dataset, built.sampler, batch_size, built.views)


class TimmLoader:
    """What `create_loader` returns: timm's loader surface (`len`, iteration, `sampler`, `batch_sampler`,
    `dataset`, `mixup_enabled`) over a FusionFlowLoader (`.fusionflow`: stats, state_dict, traces)."""

    def __init__(self, loader, prep, dataset, sampler, batch_size: int, views: int = 1):
        self.fusionflow, self.prep, self.dataset, self._sampler = loader, prep, dataset, sampler
        self._batch_size = batch_size  # create_loader's (the FusionFlowLoader's is None beside its batch_sampler)
        self.views = views  # AugMix splits: the batches hold each sample's views, view-major

    def __iter__(self):
        prep, views = self.prep, self.views
        for images, targets in self.fusionflow:
            if prep is not None:
                yield prep(images, targets)
            elif views > 1:  # timm's default_collate of AugMixDataset's tuples: one tensor a view, targets once
                yield list(images.chunk(views)), targets[: len(targets) // views]
            else:
                yield images, targets

    def __len__(self) -> int:
        return len(self.fusionflow)

    @property
    def sampler(self):
        """The sampler timm would have built (a DistributedSampler's set_epoch is the script's to call)."""
        return self._sampler if self._sampler is not None else self.fusionflow.sampler

    @property
    def batch_sampler(self):
        return self.fusionflow.batch_sampler

    @property
    def batch_size(self) -> int:
        """create_loader's batch_size, as timm's loader reports it."""
        return self._batch_size

    @property
    def mixup_enabled(self) -> bool:
        mixup = self.prep.mixup if self.prep is not None else None
        return bool(mixup is not None and mixup.mixup_enabled)

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        if self.prep is not None and self.prep.mixup is not None:
            self.prep.mixup.mixup_enabled = value

    @property
    def stats(self):
        return self.fusionflow.stats

    def set_epoch(self, epoch: int) -> None:
        self.fusionflow.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.fusionflow.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.fusionflow.load_state_dict(state)

    def close(self) -> None:
        self.fusionflow.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
