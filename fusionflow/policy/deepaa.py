"""Deep AutoAugment (DeepAA, ICLR 2022) as policy data (`augment.type: deepaa`, configs/deepaa.yaml).

A DeepAA policy is a stack of layers; each layer is a probability distribution over (op, magnitude bin)
pairs, and every sample draws one pair per layer, applied in layer order. The op semantics follow the
authors' evaluation code in meaning (their PIL functions): level = bin / (bins - 1), value = lo + level
* (hi - lo) in the op's range, and

  ShearX/Y        the affine matrix (1, v, 0, 0, 1, 0) / (1, 0, 0, v, 1, 0) as written (SkewX/Y here)
  TranslateX/Y    v x the image's width / height in pixels, fractional, matrix (1, 0, v*w, ...)
                  (ShiftX/Y here by -v*w)
  Rotate          v degrees, Pillow's rotate
                  -- these five are negated with p = 0.5; all geometric ops resample nearest, fill black
  Solarize        threshold v in 0..256;  Posterize: int(v) bits, at least 1
  Contrast, Color, Brightness, Sharpness   Pillow's enhancement with factor v (FusionFlow's value v - 1)
  AutoContrast, Invert, Equalize, Identity take no magnitude
  RandFlip        a left-right mirror with p = 0.5 (FlipX here)
  RandCutout      the search code's 60-px ImageNet cutout: centre (x, y) uniform in the image's central
                  256 x 256 box, filled rectangle from int(x - 30) to int(x + 30) inclusive (61 px
                  unclipped), colour (125, 123, 114) -- FusionFlow's Cutout of side 61 with that fill
  RandResizeCrop  torchvision's RandomResizedCrop to the output size (scale 0.08..1, ratio 3/4..4/3), bicubic

and a sample no layer cropped ends as the centre output-size crop of the image at its own resolution.

By default (`augment.order: crop_first`) FusionFlow decodes and crops first (the JPEG window decoder is where
its speed comes from), so the draw's crops -- all of them, composed into one window of the source image -- come
first and the other ops run in layer order on the output-size image. Where the authors' order differs (an op
drawn before the layer that crops runs, in theirs, on the full image), the result differs; docs/deepaa.md lists
each difference and measures it. `order: authors` (or `load_policy("deepaa", order="authors")`) runs theirs:
the whole image decoded, each layer in order at the image's size then (`op_at`: translations and the cutout's
box follow it), each crop resampled as drawn, an uncropped image padded and centre-cropped
(fusionflow/ops/deepaa_order.py; exact kernels in either decode mode, at full resolution: slower).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusionflow.policy.draws import OpDraw, TimmStep
from fusionflow.policy.op_specs import OPS
from fusionflow.policy.reader import Reader

CROP_OP = "RandResizeCrop_imagenet"
# the authors' op -> FusionFlow's op, and whether it takes a range
_MAPPED = {
    "Identity": None,
    "ShearX": "SkewX",
    "ShearY": "SkewY",
    "TranslateX": "ShiftX",
    "TranslateY": "ShiftY",
    "Rotate": "Rotate",
    "AutoContrast": "AutoContrast",
    "Invert": "Invert",
    "Equalize": "Equalize",
    "Solarize": "Solarize",
    "Posterize": "Posterize",
    "Contrast": "Contrast",
    "Color": "Color",
    "Brightness": "Brightness",
    "Sharpness": "Sharpness",
    "RandFlip": "FlipX",
    "RandCutout": "Cutout",
    CROP_OP: None,
}
RANGED = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Solarize", "Posterize")
ENHANCEMENTS = ("Contrast", "Color", "Brightness", "Sharpness")  # Pillow's factor v: FusionFlow's value v - 1
RANGED += ENHANCEMENTS
MIRRORED = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")  # their random_mirror
LAYER_UNIFORMS = 4  # per layer before the crop's: choice, sign / flip, cutout position x, y
ORDERS = ("crop_first", "authors")  # augment.order: see the module docstring
INTERPOLATIONS = ("nearest", "bilinear")  # the authors' ops resample with these two


@dataclass(frozen=True)
class DeepAASettings:
    ranges: tuple[tuple[str, float, float], ...]  # (op, lo, hi) of the ops with a magnitude
    pairs: tuple[tuple[str, int], ...]  # (op, bin) per probability position
    cdfs: tuple[tuple[float, ...], ...]  # per layer: cumulative probabilities, normalised to end at 1
    magnitude_bins: int = 13
    cutout_side: int = 60
    cutout_fill: tuple[int, int, int] = (125, 123, 114)
    order: str = "crop_first"  # ORDERS: the crops first (FusionFlow's window decode), or the authors' layer order

    @property
    def max_ops(self) -> int:
        return len(self.cdfs)

    def probabilities(self, layer: int) -> tuple[float, ...]:
        """The layer's distribution over `pairs`, as the file gives it (normalised)."""
        cdf = self.cdfs[layer]
        return tuple(b - a for a, b in zip((0.0, *cdf[:-1]), cdf))


def fusionflow_ops(s: DeepAASettings) -> list[str]:
    """The FusionFlow ops a policy's draws can contain, in pair order."""
    return [_MAPPED[name] for name, _ in s.pairs if _MAPPED[name] is not None]


def parse_deepaa(r: Reader, raw: Mapping):
    """`augment:` of type deepaa -> (DeepAASettings, interpolation, fill); ValueError naming the key."""
    keys = ("magnitude_bins", "ops", "pairs", "layers")
    a = r.mapping(raw, "augment", ("type", *keys), ("interpolation", "fill", "cutout", "order"))
    bins = r.integer(a["magnitude_bins"], "augment.magnitude_bins", 2, 1000)
    ranges, plain = _ranges(r, a["ops"])
    pairs = _pairs(r, a["pairs"], {name for name, *_ in ranges} | plain, bins)
    cdfs = tuple(_layer(r, layer, len(pairs), f"augment.layers[{i}]") for i, layer in enumerate(_list(r, a, "layers")))
    cut = r.mapping(a.get("cutout", {}), "augment.cutout", (), ("side", "fill"))
    settings = DeepAASettings(
        ranges=ranges,
        pairs=pairs,
        cdfs=cdfs,
        magnitude_bins=bins,
        cutout_side=r.integer(cut.get("side", 60), "augment.cutout.side", 0, 10000),
        cutout_fill=r.fill(cut.get("fill", [125, 123, 114]), "augment.cutout.fill"),
        order=r.choice(a.get("order", "crop_first"), "augment.order", ORDERS),
    )
    interpolation = r.choice(a.get("interpolation", "nearest"), "augment.interpolation", INTERPOLATIONS)
    fill = r.fill(a.get("fill", 0), "augment.fill")
    return settings, interpolation, fill


def _list(r: Reader, a: Mapping, key: str) -> list:
    value = a[key]
    if not isinstance(value, (list, tuple)) or not value:
        r.fail(f"augment.{key}", f"expected a non-empty list, got {value!r}")
    return list(value)


def _ranges(r: Reader, raw: Any) -> tuple[tuple[tuple[str, float, float], ...], set[str]]:
    """(the ops with a range as (op, lo, hi), the names of those without)."""
    if not isinstance(raw, Mapping) or not raw:
        r.fail("augment.ops", f"expected a mapping of DeepAA op -> [lo, hi] or null, got {raw!r}")
    out, plain = [], set()
    for name, rng in raw.items():
        path = f"augment.ops.{name}"
        if name not in _MAPPED:
            r.fail(path, f"unknown DeepAA op {name!r}; DeepAA's ops here: {', '.join(_MAPPED)}")
        if name in RANGED:
            lo, hi = r.pair(rng, path, *_limits(name), ordered=False)
            out.append((name, lo, hi))
        elif rng is not None:
            r.fail(path, f"{name} takes no magnitude: write null")
        else:
            plain.add(name)
    return tuple(out), plain


def _limits(name: str) -> tuple[float, float]:
    """The values a DeepAA op's range may hold, in the authors' units: the mapped FusionFlow op's domain
    (translations as fractions of the side, enhancement factors v where FusionFlow's value is v - 1)."""
    lo, hi = OPS[_MAPPED[name]].domain
    return (lo + 1.0, hi + 1.0) if name in ENHANCEMENTS else (lo, hi)


def _pairs(r: Reader, raw: Any, known: set[str], bins: int) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        r.fail("augment.pairs", f"expected a non-empty list of [op, bin], got {raw!r}")
    out = []
    for i, pair in enumerate(raw):
        path = f"augment.pairs[{i}]"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            r.fail(path, f"expected [op, bin], got {pair!r}")
        if not isinstance(pair[0], str) or pair[0] not in known:
            r.fail(path, f"op {pair[0]!r} is not one of augment.ops")
        out.append((pair[0], r.integer(pair[1], f"{path}[1]", 0, bins - 1)))
    return tuple(out)


def _layer(r: Reader, raw: Any, n: int, path: str) -> tuple[float, ...]:
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        r.fail(path, f"expected {n} probabilities, one per pair, got {len(raw) if isinstance(raw, list) else raw!r}")
    probs = [r.number(p, f"{path}[{i}]", 0.0, 1.0) for i, p in enumerate(raw)]
    total = sum(probs)
    if abs(total - 1.0) > 1e-3:
        r.fail(path, f"the probabilities sum to {total:.6f}, not 1")
    cdf = [c / total for c in itertools.accumulate(probs)]
    cdf[-1] = 1.0
    return tuple(cdf)


def draw_deepaa(s: DeepAASettings, size: tuple[int, int], rng, crop_uniforms: int):
    """(ops, crops, steps) of one sample: per layer a pair from its distribution (inverse CDF, as the
    authors' random.choices), then LAYER_UNIFORMS + `crop_uniforms` uniforms whether used or not."""
    h, w = size
    ranges = {name: (lo, hi) for name, lo, hi in s.ranges}
    ops, crops, steps = [], [], []
    for layer, cdf in enumerate(s.cdfs):
        k = min(bisect.bisect_right(cdf, rng.random()), len(cdf) - 1)
        u_coin, u_x, u_y = rng.random(3)
        crop_u = tuple(rng.random(crop_uniforms))
        name, b = s.pairs[k]
        negate = name in MIRRORED and u_coin > 0.5  # theirs: random.random() > 0.5 -> v = -v
        flipped = name == "RandFlip" and u_coin > 0.5  # theirs: mirrors when random.random() > 0.5
        steps.append(TimmStep(name, True, float(b), negate or flipped, "", layer))
        if name == CROP_OP:
            crops.append(crop_u)
            continue
        if _MAPPED[name] is None or (name == "RandFlip" and not flipped):  # Identity; a flip not taken
            continue
        v = 0.0
        if name in ranges:
            lo, hi = ranges[name]
            v = lo + (b / (s.magnitude_bins - 1)) * (hi - lo)
            v = -v if negate else v
        ops.append(_op(name, v, (u_x, u_y), s, h, w))
    return tuple(ops), tuple(crops), tuple(steps)


def op_at(s: DeepAASettings, step, aux, h: int, w: int) -> OpDraw:
    """The op of a non-crop `step` of a draw (its op, bin and sign) on an h x w image: what `draw_deepaa` makes at
    the output size, at any size (the authors' order runs ops before a crop on the full image). `aux`: the cutout
    position's uniforms (the draw's OpDraw's)."""
    v = 0.0
    ranges = {name: (lo, hi) for name, lo, hi in s.ranges}
    if step.op in ranges:
        lo, hi = ranges[step.op]
        v = lo + (step.level / (s.magnitude_bins - 1)) * (hi - lo)
        v = -v if step.op in MIRRORED and step.negate else v
    return _op(step.op, v, aux, s, h, w)


def _op(name: str, v: float, aux, s: DeepAASettings, h: int, w: int) -> OpDraw:
    ff = _MAPPED[name]
    if name == "TranslateX":
        return OpDraw(ff, -v * w, (0.0, 0.0))  # theirs: x_in = x + v * width
    if name == "TranslateY":
        return OpDraw(ff, -v * h, (0.0, 0.0))
    if name == "Posterize":
        return OpDraw(ff, float(max(1, int(v))), (0.0, 0.0))
    if name in ENHANCEMENTS:
        return OpDraw(ff, v - 1.0, (0.0, 0.0))
    if name == "RandCutout":  # int(x - side/2) .. int(x + side/2) inclusive: a square of side + 1
        return OpDraw(ff, float(2 * (s.cutout_side // 2) + 1), aux, fill=s.cutout_fill)
    return OpDraw(ff, v, (0.0, 0.0))
