"""timm's transforms in `policy_from_transform` (and so in `from_timm(**create_transform_kwargs)`).

    train = timm.data.create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                       interpolation="random", re_prob=0.25, re_mode="pixel")
    policy = fusionflow.policy_from_transform(train)          # or fusionflow.from_timm(224, ...)

What it reads, from timm's own objects (their attributes, not the config strings, so any string timm
accepts converts): RandomResizedCropAndInterpolation (interpolation bilinear, bicubic, nearest or
'random'), timm's RandAugment / AutoAugment / AugMixAugment (op names, probabilities, magnitudes and
their hparams: magnitude_std, magnitude_max, translate_pct / translate_const, fill colour,
interpolation), MaybeToTensor / MaybePILToTensor and timm's RandomErasing (modes const / rand / pixel,
counts). Everything else in timm's pipelines is torchvision's (RandomHorizontalFlip, Resize,
CenterCrop, Normalize, ColorJitter: the train default without auto_augment, color_jitter_prob's
RandomApply, grayscale_prob's RandomGrayscale -- after an auto_augment, as timm orders them with '3a' or
grayscale_prob, the policy's color_after_augment --, RandomVerticalFlip, gaussian_blur_prob's
GaussianBlur, Resize((h, w)) of no_aug and the eval 'squash' crop) and is read as such; the '3a' ops
(Desaturate, GaussianBlur, GaussianBlurRand) are timm's own (fusionflow/policy/timm_augment.py); its
ResizeKeepRatio followed by RandomCropOrPad / CenterCropOrPad (train_crop_mode 'rkrr' / 'rkrc', the
eval crop_mode 'border') are crop.mode keep_ratio (fusionflow/policy/keep_ratio.py), its TrimBorder
(crop_border_pixels) crop.trim.

The policy's semantics are in fusionflow/policy/timm_augment.py; tests/test_timm.py checks the pixels
against timm's objects given the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fusionflow.policy.timm_augment import TIMM_OPS


@dataclass
class TimmPart:
    """A timm transform read into policy sections: `role` crop | augment | erase, `cfg` the section."""

    role: str
    cfg: dict = field(default_factory=dict)
    source: Any = None

    def __repr__(self) -> str:
        return repr(self.source)


def is_timm(t) -> bool:
    return type(t).__module__.startswith("timm.")


def convert(t, fail) -> list:
    """timm transform -> the torchvision v2 transform(s) with the same behaviour, or TimmParts;
    `fail(why)` raises for one FusionFlow cannot express."""
    import torch
    import torchvision.transforms.v2 as T

    name = type(t).__name__
    if name == "MaybeToTensor":
        return [T.PILToTensor(), T.ToDtype(torch.float32, scale=True)]
    if name == "MaybePILToTensor":
        return [T.PILToTensor()]
    if name == "RandomResizedCropAndInterpolation":
        return [TimmPart("crop", _crop(t, fail), t)]
    if name == "ResizeKeepRatio":
        return [TimmPart("keep_ratio", _keep_ratio(t, fail), t)]
    if name in ("RandomCropOrPad", "CenterCropOrPad"):
        return [TimmPart("crop_or_pad", _crop_or_pad(t, fail), t)]
    if name == "TrimBorder":
        return [TimmPart("trim", {"trim": int(t.border_size)}, t)]
    if name in ("RandAugment", "AutoAugment", "AugMixAugment"):
        return [TimmPart("augment", _augment(t, fail), t)]
    if name == "RandomErasing":
        return [TimmPart("erase", _erasing(t, fail), t)]
    fail(
        f"timm's {name} has no FusionFlow equivalent (readable: RandomResizedCropAndInterpolation, ResizeKeepRatio "
        "+ RandomCropOrPad / CenterCropOrPad, TrimBorder, timm's RandAugment / AutoAugment / AugMixAugment, "
        "MaybeToTensor, RandomErasing, and torchvision's transforms)"
    )


def _mode(mode, fail, what: str) -> str:
    from PIL import Image

    if isinstance(mode, (tuple, list)):
        names = sorted(_mode(m, fail, what) for m in mode)
        if names != ["bicubic", "bilinear"]:
            fail(f"{what}: a random choice among {names} is not expressible (timm's 'random' is bilinear or bicubic)")
        return "random"
    if isinstance(mode, Image.Resampling) or type(mode) is int:
        mode = Image.Resampling(mode).name.lower()
    name = getattr(mode, "value", mode)
    if name not in ("nearest", "bilinear", "bicubic"):
        fail(f"{what}: interpolation {name!r} is not expressible (nearest, bilinear, bicubic or timm's random)")
    return name


def _crop(t, fail) -> dict:
    h, w = t.size
    return {
        "size": [int(h), int(w)],
        "scale": [float(v) for v in t.scale],
        "ratio": [float(v) for v in t.ratio],
        "interpolation": _mode(t.interpolation, fail, "RandomResizedCropAndInterpolation"),
    }


def _keep_ratio(t, fail) -> dict:
    """ResizeKeepRatio's settings as crop.mode keep_ratio's keys (policy/keep_ratio.py)."""
    return {
        "mode": "keep_ratio",
        "resize": [int(v) for v in t.size],
        "longest": float(t.longest),
        "scale": [float(v) for v in t.random_scale_range],
        "scale_p": float(t.random_scale_prob),
        "scale_area": bool(t.random_scale_area),
        "ratio": [float(v) for v in t.random_aspect_range],
        "ratio_p": float(t.random_aspect_prob),
        "interpolation": _mode(t.interpolation, fail, "ResizeKeepRatio"),
    }


def _crop_or_pad(t, fail) -> dict:
    """RandomCropOrPad / CenterCropOrPad: the output size, the placement and the padding."""
    if t.padding_mode == "reflect":
        pad = "reflect"
    elif t.padding_mode == "constant":
        fill = t.fill
        pad = [int(fill)] * 3 if isinstance(fill, (int, float)) else [int(v) for v in fill]
        if len(pad) == 1:
            pad *= 3
    else:
        fail(f"padding_mode {t.padding_mode!r} is not expressible (reflect or constant)")
    place = "random" if type(t).__name__ == "RandomCropOrPad" else "center"
    return {"size": [int(v) for v in t.size], "place": place, "pad": pad}


def center_crop_cfg(t) -> dict:
    """torchvision's CenterCrop after ResizeKeepRatio (timm's eval crop at a non-square size) as `_crop_or_pad`'s
    settings: it pads with 0 and places the crop as CenterCropOrPad(fill=0) does (the same arithmetic)."""
    size = [int(v) for v in t.size]
    return {"size": size * 2 if len(size) == 1 else size, "place": "center", "pad": [0, 0, 0]}


def _settings(ops, fail) -> dict:
    """The hparams every AugmentOp of one augmentation shares (timm builds them from one dict)."""
    first = ops[0]
    seen = {_hparams(op, fail) for op in ops}
    if len(seen) != 1:
        fail("its ops have different hparams (magnitude noise, translation, fill, interpolation): not expressible")
    for op in ops:
        if op.name not in TIMM_OPS:
            fail(f"op {op.name!r} has no FusionFlow implementation (readable: {', '.join(TIMM_OPS)})")
    return dict(next(iter(seen)), **{"interpolation": _mode(first.kwargs["resample"], fail, "its ops")})


def _hparams(op, fail) -> tuple:
    hp = op.hparams
    fill = op.kwargs.get("fillcolor", (128, 128, 128))
    fill = [int(fill)] * 3 if isinstance(fill, (int, float)) else [int(v) for v in fill]
    if len(fill) != 3 or not all(0 <= v <= 255 for v in fill):
        fail(f"fill colour {op.kwargs.get('fillcolor')!r}: expected three integers 0..255")
    std = float(op.magnitude_std)
    items = {
        "magnitude_std": "inf" if math.isinf(std) else std,
        "translate_pct": float(hp.get("translate_pct", 0.45)),
        "translate_const": float(hp.get("translate_const", 250)),
        "fill": tuple(fill),
    }
    if op.magnitude_max:
        items["magnitude_max"] = float(op.magnitude_max)
    return tuple(items.items())


def _augment(t, fail) -> dict:
    name = type(t).__name__
    if name == "AutoAugment":
        ops = [op for sub in t.policy for op in sub]
        cfg = {
            "type": "timm-auto",
            "subpolicies": [[[op.name, float(op.prob), float(op.magnitude)] for op in sub] for sub in t.policy],
        }
    else:
        ops = list(t.ops)
        if len({(float(op.prob), float(op.magnitude)) for op in ops}) != 1:
            fail("its ops have different probabilities or magnitudes: not expressible")
        cfg = {"ops": [op.name for op in ops], "magnitude": float(ops[0].magnitude)}
        if name == "RandAugment":
            cfg.update(type="timm-rand", num_ops=int(t.num_layers), prob=float(ops[0].prob))
            if t.choice_weights is not None:
                cfg["weights"] = [float(v) for v in t.choice_weights]
        else:
            if float(ops[0].prob) != 1.0:
                fail("AugMix ops with a probability below 1 are not expressible")
            cfg.update(type="timm-augmix", width=int(t.width), depth=int(t.depth), alpha=float(t.alpha))
            cfg["blended"] = bool(t.blended)
    settings = _settings(ops, fail)
    settings["fill"] = list(settings["fill"])
    return {**cfg, **settings}


def _erasing(t, fail) -> dict:
    if t.mode not in ("const", "rand", "pixel", ""):
        fail(f"mode {t.mode!r} is not one of const, rand, pixel")
    lo, hi = t.log_aspect_ratio
    return {
        "p": float(t.probability),
        "scale": [float(t.min_area), float(t.max_area)],
        "ratio": [math.exp(lo), math.exp(hi)],
        "value": {"rand": "random_color", "pixel": "random"}.get(t.mode, 0),
        "count": [int(t.min_count), int(t.max_count)],
    }
