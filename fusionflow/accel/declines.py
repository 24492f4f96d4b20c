"""Which policies the DALI graph (fusionflow/accel/dali_graph.py) can run with the CPU path's pixels;
importable without DALI (the loader asks before it builds anything)."""

from __future__ import annotations

from fusionflow.policy.op_specs import OPS


def accelerator_declines(policy) -> str | None:
    """Why the loader's DALI accelerator does not take `policy`, or None: what its graph cannot run (`dali_declines`),
    and exact mode, whose promise is torchvision's pixels to the bit, which nvJPEG and DALI's filters do not make
    (the graph's outputs are within the CPU fast path's bounds)."""
    if policy is not None and not policy.fast_downscale:
        return "decode.mode exact (torchvision's pixels to the bit: the CPU path's decoder and filters)"
    return dali_declines(policy)


def dali_declines(policy) -> str | None:
    """Why the DALI graph cannot run `policy` with the CPU path's pixels, or None: DALI has no
    filter matching Pillow's bicubic or nearest crop resize, its warp_affine no bicubic, and the graph
    none of timm's augmentations, AugMix's mixtures, ColorJitter, RandomGrayscale or the Hue op; its geometric
    ops fill with one gray level."""
    if policy is None:
        return None
    if policy.blur is not None:
        return "blur (GaussianBlur is CPU-only)"
    if policy.vflip > 0:
        return "vflip (the DALI graph flips horizontally only)"
    if policy.views > 1:
        return f"views={policy.views} (AugMix splits: the DALI graph draws no view-shared crop)"
    if policy.keep_ratio is not None:
        return "crop.mode keep_ratio (timm's keep-ratio crops pad the image: CPU only)"
    if policy.crop_interpolation != "bilinear":
        return f"crop.interpolation {policy.crop_interpolation!r} (DALI's resize does not match Pillow's)"
    if policy.augment.timm is not None:
        return f"augment.type {policy.augment.type!r} (timm's ops, magnitude noise and mixing are CPU-only)"
    if policy.augment.type == "deepaa":
        return "augment.type 'deepaa' (its crops are ops of the policy and its cutout has its own fill)"
    if policy.augment.type == "augmix":
        return "augment.type 'augmix' (the DALI graph has no per-sample mixture of op chains)"
    if policy.augment.type != "none" and policy.augment.interpolation == "bicubic":
        return "augment.interpolation 'bicubic' (DALI's warp_affine has only nearest and linear)"
    if policy.jitter is not None:
        return "jitter (ColorJitter: its random order and Pillow's HSV hue are CPU-only)"
    if policy.grayscale > 0:
        return "grayscale (RandomGrayscale is CPU-only)"
    aug = policy.augment
    if len(set(aug.fill)) != 1 and any(o.name != "Cutout" and o.range is not None for o in aug.ops):
        return f"augment.fill {list(aug.fill)} (DALI's geometric ops fill with one gray level; Cutout alone may not)"
    cpu_only = [o.name for o in policy.augment.ops if not OPS[o.name].dali]
    if cpu_only:
        return f"augment.ops {cpu_only} (no DALI implementation)"
    erase = policy.erase
    if erase is not None and (erase.count != (1, 1) or (erase.value is None and erase.noise == "color")):
        return "timm's erase (count > 1 or value random_color: the DALI graph erases one rectangle)"
    return None
