"""What timm's loader does to a whole batch, done to FusionFlow's delivered batch in the training process:
the prefetcher's normalisation (to `img_dtype`, on the device), FastCollateMixup's mixing and its soft
targets, the prefetcher's RandomErasing -- in timm's order (mix, normalise, erase; mixing is linear, so
mixing the normalised batch equals normalising the mixed one, but for timm's rounding of the mix to
uint8: at most half a grey level). The mixing and the erasing are timm's own objects (the collate_fn the
script passed, and timm.data.RandomErasing as timm's prefetcher builds it), called on the batch."""

from __future__ import annotations

import torch


class BatchPrep:
    """`prep(images, targets)` -> (images, targets) as timm's prefetching loader yields them.

    `normalize`: the images arrive as uint8 and are normalised here (on the device, as timm's
    prefetcher does); False: they arrive normalised (FusionFlow's CPU workers did it: on a CPU device
    that is where it is cheapest) and are only cast. `mixup`: timm's FastCollateMixup (or None), whose
    batch-level semantics (timm's Mixup.__call__: batch, pair and elem modes, cutmix, label smoothing,
    `mixup_enabled`) are applied to the batch. `erasing`: timm's RandomErasing (or None)."""

    def __init__(self, mean, std, img_dtype, device, normalize: bool, mixup=None, erasing=None):
        self.device, self.img_dtype, self.normalize = device, img_dtype, normalize
        # per channel, a scalar repeated (timm's PrefetchLoader takes mean=0.5 as (0.5, 0.5, 0.5))
        mean, std = (torch.as_tensor(v, dtype=torch.float64).reshape(-1).expand(3) * 255 for v in (mean, std))
        self.mean, self.std = (v.to(device, img_dtype).view(1, 3, 1, 1) for v in (mean, std))
        self.mixup, self.erasing = mixup, erasing

    def __call__(self, images: torch.Tensor, targets):
        images = images.to(self.device, non_blocking=True)
        if isinstance(targets, torch.Tensor):
            targets = targets.to(self.device, non_blocking=True)
        if self.normalize:
            images = images.to(self.img_dtype).sub_(self.mean).div_(self.std)
        else:
            images = images.to(self.img_dtype)
        if self.mixup is not None:
            images, targets = mix(self.mixup, images, targets)
        if self.erasing is not None:
            images = self.erasing(images)
        return images, targets


def mix(mixup, images: torch.Tensor, targets):
    """timm's Mixup.__call__ on the batch. Its batch mode's blend (the common case) in one pass over the
    batch and its mirror, `lerp_` (timm's takes four: the mirror scaled, the batch scaled, the sum):
    the mixing is in the training process, where every pass over a float batch costs the loop time."""
    from timm.data.mixup import Mixup, mixup_target

    if mixup.mode != "batch":  # its per-sample lam is made in the batch's dtype: a float16/bfloat16 batch is mixed
        if images.dtype in (torch.float16, torch.bfloat16):  # in float32, else the soft targets lose precision
            wide, targets = Mixup.__call__(mixup, images.float(), targets)  # (rows summing to 1 within 2e-3)
            return images.copy_(wide), targets
        return Mixup.__call__(mixup, images, targets)
    assert len(images) % 2 == 0, "Batch size should be even when using this"  # timm's own check
    lam, use_cutmix = mixup._params_per_batch()
    if lam != 1.0 and use_cutmix:
        from timm.data.mixup import cutmix_bbox_and_lam

        (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(
            images.shape, lam, ratio_minmax=mixup.cutmix_minmax, correct_lam=mixup.correct_lam
        )
        images[:, :, yl:yh, xl:xh] = images.flip(0)[:, :, yl:yh, xl:xh]
    elif lam != 1.0:
        images.lerp_(images.flip(0), 1.0 - lam)
    multi = {"multi_label": mixup.multi_label} if hasattr(mixup, "multi_label") else {}  # newer timm only
    return images, mixup_target(targets, mixup.num_classes, lam, mixup.label_smoothing, **multi)
