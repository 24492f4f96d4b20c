"""`load_policy(name, **overrides)`: a shipped (or your own) policy, adjusted to a training script's
flags without editing YAML or reaching into the frozen `Policy`.

    load_policy("randaugment", size=176, magnitude=7, interpolation="bilinear",
                normalize=((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))

Overrides (each validated; an unknown or invalid one raises ValueError naming it and what is valid):
  size           int or (height, width): the output size. Pixel-valued op ranges (TranslateX/Y by
                 width/height, Cutout by the shorter side) are rescaled with it, as torchvision's
                 RandAugment/AutoAugment scale translate with the image, unless the policy marks them
                 `scale_with_size: false` (TrivialAugmentWide's fixed 32 px).
  resize         int: crop.mode center policies (e.g. "eval"): the shorter side before the center
                 crop, as torchvision's Resize(resize) + CenterCrop(size); >= size
  magnitude      int: the bin every op uses (augment.type rand), 0..num_bins-1
  num_ops        int: ops per sample (augment.type rand), 1..16
  interpolation  "nearest" | "bilinear" | "bicubic": the policy ops' geometric resampling (the crop's
                 filter is the policy file's crop.interpolation). bicubic runs on the CPU workers only:
                 DALI's warp_affine (the GPU path) has only nearest and linear, so the DALI
                 accelerator declines such a policy (a policy means the same pixels everywhere).
  normalize      (mean, std), {"mean": ..., "std": ...} (0..1 units; output becomes float32), or None
                 to drop normalisation (uint8 output)
  flip           float: horizontal flip probability, 0..1
  erase          RandomErasing on the output (after normalisation): a mapping {p, scale, ratio, value}
                 (the policy file's `erase:` keys, torchvision's defaults for those left out), a float
                 p (torchvision's --random-erase), an Erase, or None / 0 to turn it off. value 'random'
                 and non-integer values need normalize.
  jitter         ColorJitter after the flip: a mapping {brightness, contrast, saturation, hue, p} (the
                 policy file's `jitter:` keys), a float v (timm's color_jitter: brightness, contrast
                 and saturation v), a tuple (brightness, contrast, saturation[, hue]) as ColorJitter's
                 arguments, a Jitter, or None / 0 to turn it off. CPU only (the DALI accelerator declines).
  grayscale      float: RandomGrayscale's probability (after the jitter), 0..1; CPU only.
  order          "crop_first" | "authors": a DeepAA policy's order (augment.order, policy/deepaa.py)

Pure Python, like the rest of `fusionflow.policy`: no torch, no DALI.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

from fusionflow.policy import schema
from fusionflow.policy.deepaa import INTERPOLATIONS as DEEPAA_INTERPOLATIONS
from fusionflow.policy.deepaa import ORDERS
from fusionflow.policy.image_sections import (
    Erase,
    Jitter,
    check_blur_fits,
    check_center_resize,
    parse_erase,
    parse_jitter,
)
from fusionflow.policy.op_specs import OPS
from fusionflow.policy.reader import Reader
from fusionflow.policy.schema import INTERPOLATIONS, Augment, OpChoice, Policy
from fusionflow.policy.timm_augment import TIMM_INTERPOLATIONS
from fusionflow.policy.tv_augmix import INTERPOLATIONS as AUGMIX_INTERPOLATIONS

OVERRIDES = (
    "size",
    "resize",
    "magnitude",
    "num_ops",
    "interpolation",
    "normalize",
    "flip",
    "jitter",
    "grayscale",
    "erase",
    "order",
)


def load_policy(path_or_dict: str | os.PathLike | Mapping | Policy, **overrides: Any) -> Policy:
    """Load and validate a policy (a shipped name, a YAML path, a mapping or a Policy), then apply
    `overrides` (see the module docstring). Without overrides this is `schema.load_policy`."""
    policy = schema.load_policy(path_or_dict)
    return apply_overrides(policy, overrides) if overrides else policy


def apply_overrides(policy: Policy, overrides: Mapping[str, Any]) -> Policy:
    """A new Policy: `policy` with `overrides` applied and validated, in the order of OVERRIDES."""
    _check_names(overrides)
    r = Reader(f"{policy.source} with override")
    aug = policy.augment
    changes: dict[str, Any] = {}
    if "size" in overrides:
        size = _size(r, overrides["size"])
        aug = dataclasses.replace(aug, ops=tuple(_rescale(r, c, policy.size, size) for c in aug.ops))
        changes["size"] = size
        if policy.keep_ratio is not None and policy.keep_ratio.resize_is_size:  # its default resize is the size
            changes["keep_ratio"] = dataclasses.replace(policy.keep_ratio, resize=size)
        if policy.blur is not None:
            check_blur_fits(r, policy.blur, size, "size")
    if "resize" in overrides or policy.center_resize is not None:
        changes["center_resize"] = _center_resize(r, policy, overrides, changes.get("size", policy.size))
    aug = _rand_counts(r, policy.name, aug, overrides)
    if "interpolation" in overrides:
        aug = _interpolation(r, policy.name, aug, overrides["interpolation"])
    if "order" in overrides:
        if aug.deepaa is None:
            r.fail("order", f"applies to augment.type 'deepaa'; policy {policy.name!r} is {aug.type!r}")
        order = r.choice(overrides["order"], "order", ORDERS)
        aug = dataclasses.replace(aug, deepaa=dataclasses.replace(aug.deepaa, order=order))
    if "normalize" in overrides:
        changes["normalize"] = _normalize(r, overrides["normalize"])
    if "flip" in overrides:
        changes["flip"] = r.number(overrides["flip"], "flip", 0.0, 1.0)
    if "jitter" in overrides:
        changes["jitter"] = _jitter(r, overrides["jitter"])
    if "grayscale" in overrides:
        changes["grayscale"] = r.number(overrides["grayscale"] or 0.0, "grayscale", 0.0, 1.0)
    # checked again when only normalize changed: its units follow the output's
    changes["erase"] = _erase(r, overrides.get("erase", policy.erase), changes.get("normalize", policy.normalize))
    return dataclasses.replace(policy, augment=aug, **changes)


def _check_names(overrides: Mapping[str, Any]) -> None:
    """Every override is one of OVERRIDES (else a ValueError with the closest name and the list)."""
    for key in overrides:
        if key not in OVERRIDES:
            hint = difflib.get_close_matches(str(key), OVERRIDES, n=1)
            fix = f"did you mean {hint[0]!r}? " if hint else ""
            raise ValueError(f"load_policy(): unknown override {key!r}; {fix}valid overrides: {', '.join(OVERRIDES)}")


def _center_resize(r: Reader, policy: Policy, overrides: Mapping[str, Any], size: tuple[int, int]) -> int:
    """A crop.mode center policy's resize (the override's, else its own), checked against the output size."""
    if policy.center_resize is None:
        r.fail(
            "resize",
            f"applies to crop.mode center policies (Resize + CenterCrop, e.g. 'eval'); policy "
            f"{policy.name!r} has a random resized crop: leave resize out, or use size",
        )
    return check_center_resize(r, overrides.get("resize", policy.center_resize), "resize", size)


def _rand_counts(r: Reader, name: str, aug: Augment, overrides: Mapping[str, Any]) -> Augment:
    """magnitude and num_ops: only for augment.type rand (RandAugment)."""
    for key in ("magnitude", "num_ops"):
        if key in overrides:
            if aug.type != "rand":
                r.fail(
                    key,
                    f"applies to augment.type 'rand' (RandAugment); policy {name!r} is "
                    f"{aug.type!r}: leave {key} out or use a rand policy such as 'randaugment'",
                )
            value = (
                r.integer(overrides[key], key, 0, aug.num_bins - 1)
                if key == "magnitude"
                else r.integer(overrides[key], key, 1, 16)
            )
            aug = dataclasses.replace(aug, **{key: value})
    return aug


def _interpolation(r: Reader, name: str, aug: Augment, value: Any) -> Augment:
    """The ops' geometric resampling, from what the policy file's augment.interpolation accepts for its type; a
    policy without ops only accepts 'bilinear' (its crop's)."""
    if aug.timm is not None:
        allowed = TIMM_INTERPOLATIONS
    else:
        allowed = {"augmix": AUGMIX_INTERPOLATIONS, "deepaa": DEEPAA_INTERPOLATIONS}.get(aug.type, INTERPOLATIONS)
    value = r.choice(value, "interpolation", INTERPOLATIONS + tuple(v for v in allowed if v not in INTERPOLATIONS))
    if aug.type == "none" and value != "bilinear":
        r.fail(
            "interpolation",
            f"policy {name!r} has no ops to resample: leave interpolation out or pass 'bilinear' (the "
            f"crop's own filter is the policy file's crop.interpolation)",
        )
    if aug.type != "none" and value not in allowed:
        why = " (torchvision's AugMix runs on tensors and raises on it)" if aug.type == "augmix" else ""
        r.fail("interpolation", f"{value!r}: policy {name!r} ({aug.type}) takes {', '.join(allowed)}{why}")
    return aug if aug.type == "none" else dataclasses.replace(aug, interpolation=value)


def _erase(r: Reader, erase: Any, normalize) -> Erase | None:
    """The erase override (or the policy's Erase): a mapping, an Erase, a float p, or None / 0 for off."""
    if isinstance(erase, (int, float)) and not isinstance(erase, bool):
        erase = {"p": erase} if erase else None
    return None if erase is None else parse_erase(r, erase, "erase", normalize)


def _jitter(r: Reader, jitter: Any) -> Jitter | None:
    """The jitter override: a mapping, a Jitter, a float (timm's color_jitter), a tuple of ColorJitter's
    arguments, or None / 0 for off."""
    if isinstance(jitter, (int, float)) and not isinstance(jitter, bool):
        jitter = dict.fromkeys(("brightness", "contrast", "saturation"), jitter) if jitter else None
    elif isinstance(jitter, (list, tuple)):
        if len(jitter) not in (3, 4):
            r.fail("jitter", f"a tuple is (brightness, contrast, saturation[, hue]), got {jitter!r}")
        jitter = dict(zip(Jitter.KEYS, jitter))
    return None if jitter is None else parse_jitter(r, jitter, "jitter")


def _size(r: Reader, raw: Any) -> tuple[int, int]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return (r.integer(raw, "size", 8, 8192),) * 2
    if isinstance(raw, (list, tuple)) and len(raw) == 2:
        return tuple(r.integer(v, f"size[{i}]", 8, 8192) for i, v in enumerate(raw))
    r.fail("size", f"expected an int or (height, width), got {raw!r}")


def _rescale(r: Reader, choice: OpChoice, old: tuple[int, int], new: tuple[int, int]) -> OpChoice:
    spec = OPS[choice.name]
    if spec.scale_by is None or choice.range is None:
        return choice
    rng = choice.range
    if choice.scale_with_size:
        (oh, ow), (nh, nw) = old, new
        factor = {"width": nw / ow, "height": nh / oh, "side": min(nh, nw) / min(oh, ow)}[spec.scale_by]
        rng = (rng[0] * factor, rng[1] * factor)
    lo, hi = spec.domain_for(*new)
    if not all(lo <= v <= hi for v in rng):
        r.fail(
            "size",
            f"{choice.name}'s fixed range {list(rng)} px does not fit a {new[0]}x{new[1]} output "
            f"(allowed {lo}..{hi}): use a larger size, or a policy whose {choice.name} scales with size",
        )
    return dataclasses.replace(choice, range=rng)


def _normalize(r: Reader, raw: Any):
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        norm = r.mapping(raw, "normalize", ("mean", "std"), ())
        mean, std = norm["mean"], norm["std"]
    elif isinstance(raw, (list, tuple)) and len(raw) == 2:
        mean, std = raw
    else:
        r.fail("normalize", f"expected (mean, std), {{'mean': [3], 'std': [3]}} or None, got {raw!r}")
    return (r.triple(mean, "normalize.mean", 0.0, 1.0), r.triple(std, "normalize.std", 1e-6, None))
