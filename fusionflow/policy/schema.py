"""Policy files -> frozen, validated `Policy` objects.

The schema (documented for users in configs/README.md):

    name: str                          optional; defaults to the file's stem
    output:
      size: int | [height, width]      every sample comes out this size, uint8 CHW
      normalize: null | {mean: [3], std: [3]}   in 0..1 units; makes the output float32
    decode:
      mode: exact | fast               exact: torchvision's pixels to the bit; fast (default): JPEG
                                       window decoded at the coarsest DCT scale covering the output,
                                       SIMD resize (`fast_downscale: bool` is the older spelling)
      max_pixels: int | null           refuse an encoded image whose header declares more pixels
                                       than this (decompression bombs), before decoding; default
                                       DEFAULT_MAX_PIXELS = 178,956,970, the size at which Pillow's
                                       own default raises DecompressionBombError; null: no limit
    crop:                              random resized crop, torchvision's algorithm
      mode: random | center | keep_ratio   center: torchvision's Resize(resize) + CenterCrop(output.size),
                                       for evaluation (takes resize, not scale/ratio); keep_ratio: timm's
                                       rkrr / rkrc / eval 'border' crops (their keys: policy/keep_ratio.py)
      scale: [lo, hi]                  area fraction, 0 < lo <= hi <= 1
      ratio: [lo, hi]                  aspect ratio w/h, 0 < lo <= hi
      resize: int | [h, w]             center: the shorter side is resized to this, >= output.size;
                                       [h, w]: the image is squashed to h x w (torchvision's Resize((h, w)))
      interpolation: bilinear | bicubic | nearest | random   the crop's (or Resize's) filter, Pillow's
                                       as torchvision's PIL path uses it (antialiased); default bilinear;
                                       random: bilinear or bicubic drawn per sample (timm's 'random').
                                       Not bilinear: the DALI accelerator declines the policy
      trim: int                        pixels cut from each edge of the image first (timm's crop_border_pixels)
    flip: float                        horizontal flip probability
    vflip: float                       vertical flip probability (timm's vflip), after the horizontal
                                       flip; default 0. CPU only (the DALI accelerator declines it)
    jitter:                            torchvision's ColorJitter, after the flip, before augment
      brightness: v | [lo, hi]         factor drawn uniformly from [max(0, 1 - v), 1 + v] or [lo, hi]
      contrast: v | [lo, hi]           likewise (blend with the mean grey)
      saturation: v | [lo, hi]         likewise (blend with the greyscale image)
      hue: v | [lo, hi]                turn drawn from [-v, v] or [lo, hi], within [-0.5, 0.5]
      p: float                         probability the jitter applies at all (RandomApply), default 1
                                       The four run in a random order per sample, as torchvision's.
                                       CPU only: the DALI accelerator declines a policy with jitter
    color_after_augment: bool          jitter and grayscale after the augment ops instead of before (timm's
                                       order: its 3a then ColorJitter, an auto_augment then RandomGrayscale)
    blur: {kernel_size, sigma, p}      torchvision's GaussianBlur in RandomApply(p), after the augment ops
                                       (timm's gaussian_blur_prob); sigma a number or [lo, hi] drawn per
                                       sample. CPU only (the DALI accelerator declines it)
    grayscale: float                   torchvision's RandomGrayscale(p), after jitter: Pillow's luma in
                                       all three channels; default 0. CPU only (the accelerator declines)
    erase:                             torchvision's RandomErasing, last (after normalisation if any)
      p: float                         probability, default 0.5
      scale: [lo, hi]                  erased area fraction, 0 <= lo <= hi <= 1, default [0.02, 0.33]
      ratio: [lo, hi]                  aspect ratio h/w, 0 < lo <= hi, default [0.3, 3.3]
      value: number | [r, g, b] | random | random_color   default 0; in the output's units
                                       (normalised units when output.normalize is set, else 0..255
                                       integers); random (standard normal noise per pixel) and
                                       random_color (per channel: timm's mode 'rand') need output.normalize
      count: int | [lo, hi]            rectangles per erased sample, drawn uniformly, each of area / count
                                       (timm's max_count); default 1
    augment:                           (the timm-rand / timm-auto / timm-augmix types: policy/timm_augment.py)
      type: none | rand | trivial | subpolicy | augmix | deepaa | timm-rand | timm-auto | timm-augmix
                                       (augmix: torchvision's AugMix, policy/tv_augmix.py;
                                       deepaa: Deep AutoAugment's layers, policy/deepaa.py)
      ops: {OpName: {range: [v0, v1], signed: bool} or {} for ops without magnitude}
                                       pixel-valued ops (TranslateX/Y, Cutout) also take
                                       scale_with_size: bool (default true): a size override
                                       (load_policy(name, size=...)) rescales the range
      num_bins: int                    bins b = 0..num_bins-1 map linearly onto range
      num_ops: int                     rand: ops drawn per sample (with replacement)
      magnitude: int                   rand: the bin every op uses
      subpolicies: [[[Op, prob, bin?], ...], ...]   subpolicy: one drawn uniformly per sample
      interpolation: nearest | bilinear | bicubic   for the geometric ops (bicubic: CPU only, the
                                       DALI accelerator declines the policy)
      fill: int | [r, g, b]            colour for pixels uncovered by geometric ops / Cutout

Every problem raises ValueError naming the file and the key path, e.g.
``configs/mine.yaml: augment.ops.Rotat: unknown op; did you mean 'Rotate'?``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusionflow.policy.deepaa import DeepAASettings, parse_deepaa
from fusionflow.policy.image_sections import (
    DEFAULT_MAX_PIXELS,
    Blur,
    Erase,
    Jitter,
    parse_blur,
    parse_crop,
    parse_decode,
    parse_erase,
    parse_jitter,
    parse_output,
)
from fusionflow.policy.keep_ratio import KeepRatio
from fusionflow.policy.op_specs import OPS
from fusionflow.policy.reader import Reader, read_yaml
from fusionflow.policy.timm_augment import TIMM_TYPES, TimmAugment, parse_timm
from fusionflow.policy.timm_augment import max_ops as timm_max_ops
from fusionflow.policy.tv_augmix import AugMixSettings, parse_augmix

AUGMENT_TYPES = ("none", "rand", "trivial", "subpolicy", "augmix", "deepaa", *TIMM_TYPES)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


@dataclass(frozen=True)
class OpChoice:
    """One op a policy may draw, with the value range its magnitude bins map onto."""

    name: str
    range: tuple[float, float] | None  # None for ops without a magnitude
    signed: bool = False
    scale_with_size: bool = True  # pixel-valued ops: a size override rescales the range (False: fixed px)

    def value(self, bin_index: int, num_bins: int) -> float:
        if self.range is None:
            return 0.0
        lo, hi = self.range
        v = lo if num_bins == 1 else lo + (hi - lo) * bin_index / (num_bins - 1)
        return float(round(v)) if OPS[self.name].integer else v


@dataclass(frozen=True)
class Step:
    """One step of an AutoAugment-style sub-policy: apply `op` with probability `prob` at `bin`."""

    op: str
    prob: float
    bin: int | None


@dataclass(frozen=True)
class Augment:
    type: str
    ops: tuple[OpChoice, ...] = ()
    num_bins: int = 1
    num_ops: int = 0
    magnitude: int | None = None
    subpolicies: tuple[tuple[Step, ...], ...] = ()
    interpolation: str = "nearest"  # timm types: bilinear, bicubic or random (drawn per op)
    fill: tuple[int, int, int] = (0, 0, 0)
    timm: TimmAugment | None = None  # the timm-* types' settings
    augmix: AugMixSettings | None = None  # type augmix: torchvision's AugMix (policy/tv_augmix.py)
    deepaa: DeepAASettings | None = None  # type deepaa: Deep AutoAugment's layers (policy/deepaa.py)

    def op(self, name: str) -> OpChoice:
        for choice in self.ops:
            if choice.name == name:
                return choice
        raise KeyError(name)

    @property
    def max_ops(self) -> int:
        """Most ops one sample can get: the number of op slots a pipeline needs."""
        if self.type == "rand":
            return self.num_ops
        if self.type == "trivial":
            return 1
        if self.type == "subpolicy":
            return max(len(sp) for sp in self.subpolicies)
        if self.timm is not None:
            return timm_max_ops(self.type, self.timm)
        if self.augmix is not None:
            return self.augmix.max_ops
        if self.deepaa is not None:
            return self.deepaa.max_ops
        return 0


@dataclass(frozen=True)
class Policy:
    name: str
    source: str
    size: tuple[int, int]  # (height, width)
    scale: tuple[float, float]
    ratio: tuple[float, float]
    flip: float
    augment: Augment
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    fast_downscale: bool = True  # decode.mode == "fast" (the field keeps the key's older name)
    center_resize: int | tuple[int, int] | None = None  # crop.mode center: Resize(center_resize) + CenterCrop(size)
    # (an int: the shorter side; (h, w): squashed to that size); None: the random resized crop
    max_pixels: int | None = DEFAULT_MAX_PIXELS  # decode.max_pixels; None: no limit
    erase: Erase | None = None  # RandomErasing on the output (after normalisation); None: off
    jitter: Jitter | None = None  # ColorJitter after the flip, before the augment ops; None: off
    grayscale: float = 0.0  # RandomGrayscale's probability, after the jitter
    crop_interpolation: str = "bilinear"  # the crop's / Resize's filter: bilinear, bicubic, nearest
    vflip: float = 0.0  # RandomVerticalFlip's probability, after the horizontal flip
    blur: Blur | None = None  # GaussianBlur after the augment ops (RandomApply's p); None: off
    color_after_augment: bool = False  # jitter and grayscale after the augment ops (timm's order), not before
    crop_epochs: int = 1  # the crop and flips drawn once per this many epochs (DecodedCache(reuse_crop_epochs))
    keep_ratio: KeepRatio | None = None  # crop.mode keep_ratio (timm's rkrr / rkrc / border), policy/keep_ratio.py
    trim: int = 0  # crop.trim: pixels cut from each edge of the source first (timm's crop_border_pixels)
    views: int = 1  # AugMix splits (timm's num_aug_splits, set by fusionflow.timm): index v is view v % views of
    # sample v // views -- one crop, flip and filter per sample, view 0 without the augment ops (sampling.draw)

    @property
    def decode_mode(self) -> str:
        return "fast" if self.fast_downscale else "exact"

    @property
    def out_dtype(self) -> str:
        return "float32" if self.normalize else "uint8"

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (3, *self.size)


def parse_policy(raw: Any, source: str = "<dict>", default_name: str = "custom") -> Policy:
    r = Reader(source)
    top = r.mapping(
        raw,
        "",
        ("output", "augment"),
        ("name", "decode", "crop", "flip", "vflip", "jitter", "grayscale", "color_after_augment", "blur", "erase"),
    )

    name = top.get("name", default_name)
    if not isinstance(name, str) or not name:
        r.fail("name", f"expected a non-empty string, got {name!r}")

    size, normalize = parse_output(r, top["output"])
    fast, max_pixels = parse_decode(r, top)
    crop = parse_crop(r, top, size)
    flip = r.number(top.get("flip", 0.0), "flip", 0.0, 1.0)
    vflip = r.number(top.get("vflip", 0.0), "vflip", 0.0, 1.0)

    augment = _parse_augment(r, top["augment"], size)
    erase = parse_erase(r, top["erase"], "erase", normalize) if top.get("erase") is not None else None
    jitter = parse_jitter(r, top["jitter"]) if top.get("jitter") is not None else None
    grayscale = r.number(top.get("grayscale", 0.0), "grayscale", 0.0, 1.0)
    blur = parse_blur(r, top["blur"], size=size) if top.get("blur") is not None else None
    color_after_augment = r.boolean(top.get("color_after_augment", False), "color_after_augment")
    return Policy(
        name=name,
        source=source,
        size=size,
        **crop,
        flip=flip,
        augment=augment,
        normalize=normalize,
        fast_downscale=fast,
        max_pixels=max_pixels,
        erase=erase,
        jitter=jitter,
        grayscale=grayscale,
        vflip=vflip,
        blur=blur,
        color_after_augment=color_after_augment,
    )


def _parse_augment(r: Reader, raw: Any, size: tuple[int, int]) -> Augment:
    if not isinstance(raw, Mapping):
        r.fail("augment", f"expected a mapping, got {type(raw).__name__} {raw!r}")
    kind = r.choice(raw.get("type"), "augment.type", AUGMENT_TYPES)
    common = ("interpolation", "fill")
    if kind == "none":
        r.mapping(raw, "augment", ("type",), ())
        return Augment(type="none")
    if kind in TIMM_TYPES:
        timm, interpolation, fill = parse_timm(r, raw, kind)
        return Augment(type=kind, interpolation=interpolation, fill=fill, timm=timm)
    if kind == "augmix":
        settings, interpolation, fill = parse_augmix(r, raw)
        return Augment(type=kind, interpolation=interpolation, fill=fill, augmix=settings)
    if kind == "deepaa":
        deepaa, interpolation, fill = parse_deepaa(r, raw)
        return Augment(type=kind, interpolation=interpolation, fill=fill, deepaa=deepaa)
    if kind == "rand":
        a = r.mapping(raw, "augment", ("type", "ops", "num_ops", "magnitude", "num_bins"), common)
    elif kind == "trivial":
        a = r.mapping(raw, "augment", ("type", "ops", "num_bins"), common)
    else:
        a = r.mapping(raw, "augment", ("type", "ops", "num_bins", "subpolicies"), common)

    num_bins = r.integer(a["num_bins"], "augment.num_bins", 1, 1000)
    ops = _parse_ops(r, a["ops"], size)
    interpolation = r.choice(a.get("interpolation", "nearest"), "augment.interpolation", INTERPOLATIONS)
    fill = r.fill(a.get("fill", 0), "augment.fill")

    num_ops, magnitude, subpolicies = 0, None, ()
    if kind == "rand":
        num_ops = r.integer(a["num_ops"], "augment.num_ops", 1, 16)
        magnitude = r.integer(a["magnitude"], "augment.magnitude", 0, num_bins - 1)
    elif kind == "subpolicy":
        subpolicies = _parse_subpolicies(r, a["subpolicies"], {o.name: o for o in ops}, num_bins)
    return Augment(
        type=kind,
        ops=tuple(ops),
        num_bins=num_bins,
        num_ops=num_ops,
        magnitude=magnitude,
        subpolicies=subpolicies,
        interpolation=interpolation,
        fill=fill,
    )


def _parse_ops(r: Reader, raw: Any, size: tuple[int, int]) -> list[OpChoice]:
    if not isinstance(raw, Mapping) or not raw:
        r.fail("augment.ops", f"expected a non-empty mapping of op name -> settings, got {raw!r}")
    ops = []
    for name, settings in raw.items():
        path = f"augment.ops.{name}"
        spec = r.op_name(name, path)
        settings = {} if settings is None else settings
        if spec.has_magnitude:
            s = r.mapping(settings, path, ("range",), ("signed", "scale_with_size") if spec.scale_by else ("signed",))
            lo, hi = spec.domain_for(*size)
            rng = r.pair(s["range"], f"{path}.range", lo, hi, ordered=False)
            ops.append(
                OpChoice(
                    name,
                    rng,
                    r.boolean(s.get("signed", False), f"{path}.signed"),
                    r.boolean(s.get("scale_with_size", True), f"{path}.scale_with_size"),
                )
            )
        else:
            r.mapping(settings, path, (), ())  # no keys allowed: the op has no magnitude
            ops.append(OpChoice(name, None, False))
    return ops


def _parse_subpolicies(r, raw, ops: dict[str, OpChoice], num_bins: int):
    subpolicies: list[list[Step]] = []
    for i, spath, step in r.subpolicy_steps(raw, "augment.subpolicies", "[op, probability, bin]"):
        if not isinstance(step, (list, tuple)) or len(step) not in (2, 3):
            r.fail(spath, f"expected [op, probability] or [op, probability, bin], got {step!r}")
        name = step[0]
        r.op_name(name, f"{spath}[0]")
        if name not in ops:
            r.fail(f"{spath}[0]", f"op {name!r} is not listed under augment.ops (add it with its range)")
        prob = r.number(step[1], f"{spath}[1]", 0.0, 1.0)
        has_mag = ops[name].range is not None
        if has_mag and len(step) != 3:
            r.fail(spath, f"op {name!r} takes a magnitude: write [{name}, {prob}, bin]")
        if not has_mag and len(step) == 3:
            r.fail(spath, f"op {name!r} takes no magnitude: write [{name}, {prob}]")
        bin_ = r.integer(step[2], f"{spath}[2]", 0, num_bins - 1) if has_mag else None
        if i == len(subpolicies):  # the first step of sub-policy i
            subpolicies.append([])
        subpolicies[i].append(Step(name, prob, bin_))
    return tuple(tuple(sp) for sp in subpolicies)


def load_policy(path_or_dict: str | os.PathLike | Mapping | Policy) -> Policy:
    """Load and validate a policy from a YAML file path or an already-parsed mapping.

    A bare name such as ``"randaugment"`` resolves to the shipped ``configs/randaugment.yaml``.
    """
    if isinstance(path_or_dict, Policy):
        return path_or_dict
    if isinstance(path_or_dict, Mapping):
        return parse_policy(path_or_dict, "<dict>")
    if not isinstance(path_or_dict, (str, os.PathLike)):
        hint = "; for a transform pipeline use policy=fusionflow.policy_from_transform(it)" * callable(path_or_dict)
        raise TypeError(f"policy must be a path, a mapping or a Policy, got {type(path_or_dict).__name__}{hint}")
    path = os.fspath(path_or_dict)
    if not os.path.exists(path) or os.path.isdir(path):  # (a project's eval/ is not a policy; a pipe is read)
        shipped = _shipped_config(path)
        if shipped is None and os.path.isdir(path):
            raise ValueError(f"policy {path!r} is a directory: give a YAML file or a shipped policy's name")
        if shipped is None:
            close = difflib.get_close_matches(os.path.basename(path).lower(), shipped_policies(), n=1, cutoff=0.75)
            raise ValueError(
                f"policy file {path!r} does not exist; "
                + (f"did you mean {close[0]!r}? " if close else "")
                + f"shipped policies: {', '.join(shipped_policies())} (or give a path to your own YAML file)"
            )
        path = shipped
    raw = read_yaml(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return parse_policy(raw, path, default_name=stem)


def configs_dir() -> str:
    """The shipped policies: package data (fusionflow/configs), so a wheel carries them too."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "configs")


def shipped_policies() -> list[str]:
    d = configs_dir()
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml")) if os.path.isdir(d) else []


def _shipped_config(name: str) -> str | None:
    """A bare policy name ("randaugment") or "configs/<name>.yaml" resolves to the shipped file."""
    head, tail = os.path.split(name)
    if head not in ("", "configs"):
        return None
    candidate = os.path.join(configs_dir(), tail if tail.endswith(".yaml") else tail + ".yaml")
    return candidate if os.path.exists(candidate) else None
