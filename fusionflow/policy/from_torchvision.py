"""`policy_from_transform(t)`: a torchvision pipeline -> the equivalent FusionFlow Policy.

    train = T.Compose([T.RandomResizedCrop(176), T.RandomHorizontalFlip(), T.RandAugment(magnitude=7),
                       T.PILToTensor(), T.ToDtype(torch.float32, scale=True),
                       T.Normalize(mean, std), T.RandomErasing(0.25)])
    loader = FusionFlowLoader(fusionflow.ImageFolder(root), batch_size=256,
                              policy=fusionflow.policy_from_transform(train))

What it takes: a Compose (torchvision.transforms v1 or v2, nested ones opened), a list, one transform,
an object holding its Compose in `.transforms` (the classification reference's presets), or
`weights.transforms()` (ImageClassification: Resize + CenterCrop + float + Normalize). v1 transforms
are read as the v2 ones with the same parameters (ToTensor as PILToTensor + ToDtype(float32, scale=
True)); a leading PILToTensor / ToImage (the reference's `--backend tensor`) is skipped: FusionFlow
decodes itself and computes with the PIL backend's arithmetic, so tensor-backend pixels may differ
from torchvision's by its resampling's rounding.

What it reads, in this order (the order torchvision's classification recipe uses):
  train: RandomResizedCrop(size, scale, ratio, bilinear | bicubic | nearest, antialias=True)
         [RandomHorizontalFlip(p)] [ColorJitter(...) | RandomApply([ColorJitter(...)], p)]
         [RandomGrayscale(p) | Grayscale(3)]   (in this order; the flip may stand anywhere among them)
         [RandAugment | AutoAugment | TrivialAugmentWide, with their arguments; interpolation
          nearest, bilinear or bicubic, fill a number or [r, g, b] of integers]
         [GaussianBlur(kernel_size, sigma) | RandomApply([GaussianBlur(...)], p)]
  eval:  Resize(int | (h, w), bilinear | bicubic | nearest, antialias=True) + CenterCrop(size), or Resize((h, w))
         alone (the whole image squashed to h x w)
  then:  [PILToTensor | ToImage] [ToDtype(torch.float32, scale=True) | ConvertImageDtype(torch.float32)]
         [Normalize(mean, std)] [RandomErasing(p, scale, ratio, value)] [ToPureTensor]
Anything else -- another transform, another order, an argument FusionFlow does not implement
(a crop without antialiasing, an erase before Normalize) -- raises ValueError
naming the first transform it cannot express and why: the policy is the same recipe, or there is
no policy.

The auto-augmentation's tables: fusionflow/policy/torchvision_tables.py; timm's transforms (its
RandomResizedCropAndInterpolation, RandAugment / AutoAugment / AugMix, RandomErasing):
fusionflow/policy/timm_transforms.py.

Imports torch and torchvision lazily, on call; fusionflow.policy stays free of both.
"""

from __future__ import annotations

from typing import Any

from fusionflow.policy import timm_transforms
from fusionflow.policy.schema import Policy, parse_policy
from fusionflow.policy.torchvision_tables import INTERPOLATIONS, augment_section, mode_name
from fusionflow.policy.tv_flatten import as_v2, flatten, unreadable
from fusionflow.policy.tv_sections import RANDOM_APPLY, blur_section, grayscale_p, jitter_section

_TENSOR_STEPS = ("PILToTensor", "ToImage", "ToDtype", "ConvertImageDtype", "Normalize", "RandomErasing", "ToPureTensor")


def policy_from_transform(transform: Any, decode: str = "fast") -> Policy:
    """The Policy equivalent to the torchvision v2 pipeline `transform` (a Compose, a list of
    transforms, or one transform), or ValueError naming the first transform it cannot express. `decode`: the policy's
    decode.mode ("fast", the default, or "exact" for torchvision's pixels to the bit)."""
    import torchvision.transforms.v2 as T

    originals = flatten(transform)
    where = lambda k: f"policy_from_transform: transform {k} ({_describe(originals[k])})"  # noqa: E731

    def fail(k: int, why: str):
        raise ValueError(f"{where(k)}: {why}")

    steps, read = [], []
    for k, t in enumerate(originals):
        v2 = timm_transforms.convert(t, lambda why, k=k: fail(k, why)) if timm_transforms.is_timm(t) else as_v2(t)
        if v2 is None:
            fail(k, unreadable(t))
        steps += v2
        read += [t] * len(v2)  # error messages name the transform as the caller wrote it
    originals = read
    # the tensor backend converts first (torchvision's recipe, --backend tensor); FusionFlow decodes
    # itself and computes every op with the PIL backend's arithmetic either way
    tensors = False  # the crop's resize sees tensors: antialias=None then means none (torchvision's rule)
    while steps and type(steps[0]).__name__ in ("PILToTensor", "ToImage"):
        steps.pop(0)
        originals.pop(0)
        tensors = True
    cfg: dict[str, Any] = {"decode": {"mode": decode}, "augment": {"type": "none"}}
    if not steps:
        raise ValueError(
            "policy_from_transform: the pipeline is empty; it needs a RandomResizedCrop "
            "(training) or Resize + CenterCrop (evaluation) to fix the output size"
        )

    pos = _read_crop(steps, T, cfg, fail, tensors)  # 1. the crop, which fixes the output size
    size = tuple(cfg["output"]["size"])

    pos = _read_colour_steps(steps, pos, cfg, T)  # 2. flips, colour jitter, grayscale
    if pos < len(steps) and isinstance(steps[pos], (T.RandAugment, T.AutoAugment, T.TrivialAugmentWide, T.AugMix)):
        cfg["augment"] = augment_section(steps[pos], size, lambda why, k=pos: fail(k, why))
        pos += 1
    elif pos < len(steps) and _part(steps[pos], "augment"):  # timm's RandAugment / AutoAugment / AugMix
        cfg["augment"] = steps[pos].cfg
        pos += 1

    if not {"jitter", "grayscale"} & set(cfg) and (after := _read_colour_steps(steps, pos, cfg, T, False)) > pos:
        cfg["color_after_augment"], pos = True, after  # timm's order: its 3a, then ColorJitter / RandomGrayscale
    if pos < len(steps) and (blur := blur_section(steps[pos], T)) is not None:  # timm's gaussian_blur_prob
        cfg["blur"] = blur
        pos += 1
    _read_tensor_steps(steps, pos, cfg, fail)  # 3. to tensor, dtype, normalisation, erasing
    try:
        return parse_policy(cfg, f"policy_from_transform({type(transform).__name__})", default_name="from_torchvision")
    except ValueError as exc:
        raise ValueError(f"policy_from_transform: the pipeline has no FusionFlow equivalent: {exc}") from None


def _read_colour_steps(steps, pos: int, cfg: dict, T, flips: bool = True) -> int:
    """The flips, colour jitter and grayscale after the crop (the flips in any place: they commute with
    both; not after the augmentation, whose warps they do not commute with), into cfg; returns the index
    of the next step."""
    while pos < len(steps):
        t = steps[pos]
        if flips and isinstance(t, T.RandomHorizontalFlip) and "flip" not in cfg:
            cfg["flip"] = float(t.p)
        elif flips and isinstance(t, T.RandomVerticalFlip) and "vflip" not in cfg:
            cfg["vflip"] = float(t.p)
        elif (jitter := jitter_section(t, T)) is not None and not {"jitter", "grayscale"} & set(cfg):
            cfg["jitter"] = jitter
        elif (gray := grayscale_p(t, T)) is not None and "grayscale" not in cfg:
            cfg["grayscale"] = gray
        else:
            break
        pos += 1
    if not cfg.get("jitter", True):
        del cfg["jitter"]  # a ColorJitter that adjusts nothing
    return pos


def _read_crop(steps, T, cfg: dict, fail, tensors: bool) -> int:
    """The pipeline's first step(s): RandomResizedCrop, or Resize + CenterCrop, into cfg's output and
    crop; returns the index of the next step."""
    pos, trim = 0, None
    if _part(steps[pos], "trim"):  # timm's TrimBorder (crop_border_pixels), before its eval crop
        trim, pos = steps[pos].cfg["trim"], pos + 1
        if pos >= len(steps):
            fail(pos - 1, "TrimBorder must be followed by the crop")
    t = steps[pos]
    if _part(t, "keep_ratio"):  # timm's ResizeKeepRatio + RandomCropOrPad / CenterCropOrPad (or CenterCrop)
        after = steps[pos + 1] if pos + 1 < len(steps) else None
        if not (_part(after, "crop_or_pad") or isinstance(after, T.CenterCrop)):
            fail(pos, "ResizeKeepRatio must be followed by RandomCropOrPad, CenterCropOrPad or CenterCrop")
        place = timm_transforms.center_crop_cfg(after) if isinstance(after, T.CenterCrop) else after.cfg
        cfg["output"] = {"size": place["size"]}
        cfg["crop"] = dict(t.cfg, place=place["place"], pad=place["pad"])
        pos += 2
    elif _part(t, "crop"):  # timm's RandomResizedCropAndInterpolation
        cfg["output"] = {"size": t.cfg["size"]}
        cfg["crop"] = {k: t.cfg[k] for k in ("scale", "ratio", "interpolation")}
        pos += 1
    elif isinstance(t, T.RandomResizedCrop):
        mode = _check_resize_mode(t, fail, pos, tensors)
        cfg["output"] = {"size": list(t.size)}
        cfg["crop"] = {"scale": [float(v) for v in t.scale], "ratio": [float(v) for v in t.ratio]}
        cfg["crop"]["interpolation"] = mode
        pos += 1
    elif isinstance(t, T.Resize):
        mode = _check_resize_mode(t, fail, pos, tensors)
        cropped = pos + 1 < len(steps) and isinstance(steps[pos + 1], T.CenterCrop)
        if t.size is None or len(t.size) not in (1, 2) or t.max_size is not None or (not cropped and len(t.size) == 1):
            fail(
                pos,
                "only Resize(int) (the shorter side) + CenterCrop (a batch needs one size), or Resize((h, w)) "
                "(squashed, with or without CenterCrop), without max_size, is expressible for evaluation; for "
                "training start with RandomResizedCrop",
            )
        resize = int(t.size[0]) if len(t.size) == 1 else [int(v) for v in t.size]
        cfg["output"] = {"size": list(steps[pos + 1].size) if cropped else resize}  # alone: the whole squashed image
        cfg["crop"] = {"mode": "center", "resize": resize, "interpolation": mode}
        pos += 2 if cropped else 1
    else:
        fail(
            pos,
            "the pipeline must start with RandomResizedCrop (training) or Resize + CenterCrop "
            "(evaluation): FusionFlow decodes only the crop window, so the crop comes first",
        )
    if trim:
        cfg["crop"]["trim"] = trim
    return pos


def _misplaced(t, name: str) -> str | None:
    """Why step `t` (named `name`) cannot come after the augmentation, or None if it may."""
    import torchvision.transforms.v2 as T

    if name in ("RandomChoice", "RandomOrder"):
        return f"torchvision's {name} has no FusionFlow equivalent (a policy's stages run in a fixed order)"
    if name == "Grayscale" and t.num_output_channels != 3:
        return "only Grayscale(num_output_channels=3) is expressible (FusionFlow's output has three channels)"
    if name in ("Grayscale", "RandomGrayscale"):
        return (
            "a policy has one grayscale step, after the crop's flips and ColorJitter (or right after the "
            "augmentation, timm's order): this one is a second, or out of that order"
        )
    if name == "RandomApply" and jitter_section(t, T) is None and blur_section(t, T) is None:
        return RANDOM_APPLY
    if name not in _TENSOR_STEPS:
        return (
            "cannot be expressed here: after the crop come RandomHorizontalFlip, RandomVerticalFlip, ColorJitter, "
            "RandomGrayscale, one of RandAugment / AutoAugment / TrivialAugmentWide, "
            f"then {' / '.join(_TENSOR_STEPS)}, in that order"
        )
    return None


def _read_tensor_steps(steps, pos: int, cfg: dict, fail) -> None:
    """The steps after the augmentation (to tensor, dtype, normalisation, erasing), into cfg."""
    to_float, erase_at = False, None
    seen: set[str] = set()
    for k in range(pos, len(steps)):
        t = steps[k]
        name = "RandomErasing" if _part(t, "erase") else type(t).__name__
        why = _misplaced(t, name)
        if why is not None:
            fail(k, why)
        if name in seen or (name in ("ToImage", "PILToTensor") and seen & {"ToImage", "PILToTensor"}):
            fail(k, "appears twice")
        seen.add(name)
        if name in ("PILToTensor", "ToImage", "ToPureTensor"):
            if to_float and name != "ToPureTensor":
                fail(k, "comes after ToDtype: convert to a tensor first")
            continue
        if name in ("ToDtype", "ConvertImageDtype"):
            dtype = _image_dtype(t)
            import torch

            if dtype is not torch.float32 or not getattr(t, "scale", True):
                fail(
                    k,
                    f"only ToDtype(torch.float32, scale=True) is expressible (got dtype={dtype}, "
                    f"scale={getattr(t, 'scale', True)}): FusionFlow outputs uint8 or 0..1-scaled float32",
                )
            if erase_at is not None:
                fail(k, "comes after RandomErasing: erase last, as torchvision's recipe does")
            to_float = True
            cfg["output"]["normalize"] = {"mean": [0.0] * 3, "std": [1.0] * 3}
        elif name == "Normalize":
            if not to_float:
                fail(k, "needs ToDtype(torch.float32, scale=True) before it (Normalize of uint8 is undefined)")
            if erase_at is not None:
                fail(
                    k,
                    "comes after RandomErasing: FusionFlow erases the normalised output, as "
                    "torchvision's recipe does (Normalize, then RandomErasing)",
                )
            mean, std = (
                _triple(t.mean, "mean", lambda why, k=k: fail(k, why)),
                _triple(t.std, "std", lambda why, k=k: fail(k, why)),
            )
            cfg["output"]["normalize"] = {"mean": mean, "std": std}
        elif name == "RandomErasing":
            erase_at = k
            if _part(t, "erase"):  # timm's RandomErasing (after Normalize, as timm's pipeline has it)
                cfg["erase"] = t.cfg
                continue
            value = "random" if t.value is None else list(t.value)
            if value != "random" and not to_float:
                value = [int(v) if float(v).is_integer() else v for v in value]
            cfg["erase"] = {
                "p": float(t.p),
                "scale": [float(v) for v in t.scale],
                "ratio": [float(v) for v in t.ratio],
                "value": value,
            }


def _part(t, role: str) -> bool:
    return isinstance(t, timm_transforms.TimmPart) and t.role == role


def _describe(t) -> str:
    text = repr(t).replace("\n", " ")
    return text if len(text) <= 120 else text[:117] + "..."


def _check_resize_mode(t, fail, k: int, tensors: bool) -> str:
    """The crop's / Resize's interpolation as a policy names it. FusionFlow decodes and resizes with
    Pillow's filters, which always antialias (torchvision's PIL path ignores antialias=False too):
    an explicit antialias=False with bilinear or bicubic asks for the tensor backend's other pixels, as
    antialias=None does where the resize sees tensors (`tensors`: after a leading PILToTensor / ToImage)."""
    mode = mode_name(t.interpolation)
    if mode not in INTERPOLATIONS:
        fail(k, f"interpolation={mode!r}: the crop resizes with one of {', '.join(INTERPOLATIONS)}")
    if (t.antialias is False or (tensors and t.antialias is None)) and mode != "nearest":
        fail(
            k,
            f"interpolation={mode!r}, antialias={t.antialias}{' on tensors' if tensors else ''}: FusionFlow's crop "
            "resize is Pillow's antialiased filter (torchvision's PIL path, and its default). Use antialias=True, "
            "or keep this transform on torchvision",
        )
    return mode


def _image_dtype(t):
    import torch
    from torchvision import tv_tensors

    dtype = t.dtype
    if isinstance(dtype, dict):
        for key in (tv_tensors.Image, torch.Tensor, "others"):
            if key in dtype:
                return dtype[key]
        return None
    return dtype


def _triple(values, what: str, fail) -> list[float]:
    values = [float(v) for v in values]
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        fail(f"{what}={values}: expected 1 or 3 values (RGB)")
    return values


def from_timm(*args, decode: str = "fast", **create_transform_kwargs) -> Policy:
    """The Policy of `timm.data.create_transform(*args, **create_transform_kwargs)` (timm's train or
    eval transform, as its train.py builds them); `decode` as in policy_from_transform."""
    from timm.data import create_transform

    return policy_from_transform(create_transform(*args, **create_transform_kwargs), decode=decode)
