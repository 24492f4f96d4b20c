"""Per-sample augmentation draws: a pure function of (policy, seed, epoch, sample index, copy).

`copy` tells apart the occurrences of one index within an epoch (repeated augmentation: a sampler
such as timm's RASampler yields each index several times); copy 0 is every sample of an ordinary
sampler.

The uniforms come from a counter-based generator (`uniforms`): numpy's Philox4x64 (Salmon et al.,
SC'11) keyed by the seed, its 256-bit counter holding (position, copy, index, epoch), so samples'
streams are disjoint by construction. Re-keying one thread-local generator and taking the sample's
uniforms as one block costs about a tenth of seeding numpy's PCG64 through a SeedSequence per sample
as before. Draws made before this change came from `numpy.random.default_rng([seed, epoch, index(,
copy)])`: the same seed now gives other, equally distributed augmentations (docs/status.md).

Whichever worker runs a sample -- a CPU process, the DALI GPU worker, or a retry after a crash --
computes the same `SampleDraw`, so augmentation is reproducible and placement-independent.

A draw is image-size independent: the random resized crop keeps its uniforms and is resolved
against the real image size by `crop_window` (torchvision's algorithm: ten tries at a random area
and log-uniform aspect ratio, then a centre crop of the clamped ratio).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fusionflow.policy import keep_ratio, philox
from fusionflow.policy.deepaa import draw_deepaa
from fusionflow.policy.draws import EraseDraw, MixDraw, OpDraw, SampleDraw, TimmStep
from fusionflow.policy.image_sections import Erase, Jitter
from fusionflow.policy.schema import Policy
from fusionflow.policy.timm_augment import draw_timm
from fusionflow.policy.tv_augmix import draw_augmix

__all__ = ["EraseDraw", "MixDraw", "OpDraw", "SampleDraw", "TimmStep", "crop_window", "draw", "uniforms"]

CROP_TRIES = 10


_WORD = (1 << 64) - 1
_DRAWS = 96  # uniforms taken per sample at once: a shipped policy's draw uses 41 to about 90


def _check(name: str, v) -> int:
    if type(v) is int and 0 <= v <= _WORD:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name}={v!r} must be a non-negative integer")
    if name != "seed" and v > _WORD:
        raise ValueError(f"{name}={v!r} must be below 2**64")
    return int(v)


def _key(seed: int, epoch: int, index: int, copy: int) -> tuple[int, int]:
    """The Philox key of `seed` (128 bits; wider seeds fold their higher words in), the other parts checked."""
    seed = _check("seed", seed)
    for name, v in (("epoch", epoch), ("index", index), ("copy", copy)):
        _check(name, v)
    key0, key1 = seed & _WORD, (seed >> 64) & _WORD
    seed >>= 128
    while seed:
        key0, key1, seed = key0 ^ (seed & _WORD), key1 ^ ((seed >> 64) & _WORD), seed >> 128
    return key0, key1


def uniforms(seed: int, epoch: int, index: int, copy: int = 0, n: int = _DRAWS) -> np.ndarray:
    """The first n uniforms in [0, 1) of the sample's stream (float64, 53 random bits each): a pure
    function of (seed, epoch, index, copy) that any process, thread or retry recomputes -- numpy's
    Philox4x64 keyed by the seed, its counter (position, copy, index, epoch) (policy/philox.py). `draw`
    consumes them in a fixed order: crop (40), flip (1), then the policy's ops, then erasing, then
    the crop's filter when drawn, then ColorJitter (9), then RandomGrayscale (1), then the vertical flip (1),
    then GaussianBlur (2)."""
    return philox.numpy_generator(_key(seed, epoch, index, copy), epoch, index, copy).random(n)


def run_uniforms(seed: int, epoch: int, indices, copies=None) -> np.ndarray:
    """`uniforms` of many samples of one epoch in one call, (len(indices), _DRAWS): row i is sample
    (indices[i], copies[i] or 0)'s, what `draw(..., first=row)` takes."""
    idx = np.asarray(indices)
    cps = np.zeros(len(idx), np.uint64) if copies is None else np.asarray(copies)
    if len(idx) and (idx.dtype.kind not in "iu" or cps.dtype.kind not in "iu" or min(idx.min(), cps.min()) < 0):
        raise ValueError("indices and copies must be non-negative integers")
    return philox.uniforms_many(_key(seed, epoch, 0, 0), int(epoch), idx, cps, 0, _DRAWS)


class _Stream:
    """The sample's uniforms consumed in order, with the two calls `draw` makes of a Generator. `first`: its
    first _DRAWS uniforms when already computed (`run_uniforms`' row)."""

    def __init__(self, seed: int, epoch: int, index: int, copy: int, first=None):
        self._at = (seed, epoch, index, copy)
        self._u = (uniforms(seed, epoch, index, copy) if first is None else first).tolist()
        self._next = 0

    def random(self, n: int | None = None):
        while self._next + (n or 1) > len(self._u):  # a policy with many ops: the stream goes on
            seed, epoch, index, copy = self._at
            gen = philox.numpy_generator(_key(seed, epoch, index, copy), epoch, index, copy, len(self._u))
            self._u += gen.random(_DRAWS).tolist()
        i = self._next
        self._next += n or 1
        return self._u[i] if n is None else self._u[i : i + n]

    def integers(self, high: int) -> int:
        return min(int(self.random() * high), high - 1)


_VIEW_BASE = 1 << 63  # the shared crop's stream of a sample with views: an index no sample has


def draw(policy: Policy, seed: int, epoch: int, index: int, copy: int = 0, first=None) -> SampleDraw:
    """The sample's draw; `copy` is the occurrence of `index` in the epoch (0 for the first). `first`: the
    sample's `run_uniforms` row when computed with its run's (the same draw, without a call of its own).

    A policy with `crop_epochs` = R > 1 (refurbishing, `DecodedCache(reuse_crop_epochs=R)`): the crop,
    its filter and the flips are those drawn for epoch R * (epoch // R); everything else is this epoch's.
    So every worker kind draws the same reused crop, and a CPU worker with the cache may keep the
    cropped sample for those R epochs (fusionflow/cache/crops.py)."""
    d = _draw_views(policy, seed, epoch, index, copy, first)
    reuse = policy.crop_epochs
    if reuse > 1 and epoch % reuse:
        base = _draw_views(policy, seed, epoch - epoch % reuse, index, copy)
        d = dataclasses.replace(
            d, crop_u=base.crop_u, flip=base.flip, vflip=base.vflip, crop_resample=base.crop_resample
        )
    return d


def _draw_views(policy: Policy, seed: int, epoch: int, index: int, copy: int, first=None) -> SampleDraw:
    """`draw` without crop reuse.

    A policy with `views` = S > 1 (timm's AugMix splits): `index` is view index % S of sample index // S.
    Every view of a sample shares the crop, flip and crop filter (drawn from the sample's own stream,
    keyed apart from every view's); view 0 is the clean view (crop and flips only: no augment ops, jitter,
    grayscale or blur, as timm's AugMixDataset normalises its first split), the others draw their
    augmentation and erasing each from their own stream."""
    if policy.views == 1:
        return _draw(policy, seed, epoch, index, copy, first)
    if _check("index", index) >= _VIEW_BASE:
        raise ValueError(f"index={index} must be below 2**63 with views")
    base = _draw(policy, seed, epoch, _VIEW_BASE | index // policy.views, copy)
    own = _draw(policy, seed, epoch, index, copy, first)
    shared = dict(crop_u=base.crop_u, flip=base.flip, vflip=base.vflip, crop_resample=base.crop_resample)
    if index % policy.views == 0:
        shared.update(ops=(), mix=None, steps=(), jitter=(), grayscale=False, blur=None)  # timm's secondary: off
    return dataclasses.replace(own, **shared)


def _draw(policy: Policy, seed: int, epoch: int, index: int, copy: int, first=None) -> SampleDraw:
    rng = _Stream(seed, epoch, index, copy, first)
    crop_u = tuple(rng.random(CROP_TRIES * 4))
    flip = bool(rng.random() < policy.flip)
    aug = policy.augment
    ops: list[OpDraw] = []
    if aug.type == "rand":
        for _ in range(aug.num_ops):
            choice = aug.ops[int(rng.integers(len(aug.ops)))]
            ops.append(_op(choice, aug.magnitude, aug.num_bins, rng))
    elif aug.type == "trivial":
        choice = aug.ops[int(rng.integers(len(aug.ops)))]
        bin_ = int(rng.integers(aug.num_bins))
        ops.append(_op(choice, bin_, aug.num_bins, rng))
    elif aug.type == "subpolicy":
        sub = aug.subpolicies[int(rng.integers(len(aug.subpolicies)))]
        for step in sub:
            apply = rng.random() < step.prob
            op = _op(aug.op(step.op), step.bin or 0, aug.num_bins, rng)
            if apply:
                ops.append(op)
    mix, steps = None, ()
    if aug.timm is not None:
        ops, mix, steps = draw_timm(aug, policy.size, rng)
    elif aug.type == "augmix":
        mix, steps = draw_augmix(aug.augmix, policy.size, rng)
    crops = None
    if aug.type == "deepaa":
        ops, crops, steps = draw_deepaa(aug.deepaa, policy.size, rng, CROP_TRIES * 4)
    erase = _erase(policy.erase, policy.size, rng) if policy.erase is not None else None
    crop_resample = None
    if policy.crop_interpolation == "random":  # timm's RandomResizedCropAndInterpolation: one of two per sample
        crop_resample = "bilinear" if rng.random() < 0.5 else "bicubic"
    jitter = _jitter(policy.jitter, rng) if policy.jitter is not None else ()
    gray = bool(rng.random() < policy.grayscale) if policy.grayscale > 0 else False
    vflip = bool(rng.random() < policy.vflip) if policy.vflip > 0 else False  # last: other draws stay as they were
    blur = _blur(policy.blur, rng) if policy.blur is not None else None
    return SampleDraw(crop_u, flip, tuple(ops), erase, mix, crop_resample, steps, crops, jitter, gray, vflip, blur)


def _blur(blur, rng: _Stream) -> float | None:
    """GaussianBlur's sigma (two uniforms: whether it applies, the sigma), or None."""
    apply, u = rng.random() < blur.p, rng.random()
    lo, hi = blur.sigma
    return lo + u * (hi - lo) if apply else None


def _jitter(jitter: Jitter, rng: _Stream) -> tuple[OpDraw, ...]:
    """ColorJitter's draw, last of all (a policy's other draws are the same with or without it) and
    always nine uniforms: whether it applies (RandomApply's p), a uniform order of the four (the
    argsort of four uniforms, as torchvision's randperm(4)), a uniform factor per range. The ops
    take factor - 1 (Brightness, Contrast, Color: factor 1 + v) or the hue turn itself."""
    apply = rng.random() < jitter.p
    keys, u = rng.random(4), rng.random(4)
    if not apply:
        return ()
    ops = []
    for k in sorted(range(4), key=keys.__getitem__):
        if jitter.ranges[k] is not None:
            lo, hi = jitter.ranges[k]
            factor = lo + u[k] * (hi - lo)
            ops.append(OpDraw(Jitter.OPS[k], factor if k == 3 else factor - 1.0, (0.0, 0.0)))
    return tuple(ops)


def _erase(erase: Erase, size: tuple[int, int], rng: _Stream) -> EraseDraw | None:
    """RandomErasing at the output size from a fixed number of draws (after every other draw, so a
    policy's other draws do not depend on whether it erases): torchvision's make_params, and for
    count > 1 timm's -- the count, then one rectangle of area / count per count, each given up after
    CROP_TRIES misses."""
    apply = rng.random() < erase.p
    tries = [rng.random(CROP_TRIES * 4)]
    noise_seed = rng.integers(1 << 53)
    lo, hi = erase.count
    count = lo
    if hi > 1:  # more draws only for timm's counts: a torchvision policy's draws stay as they were
        count = lo + rng.integers(hi - lo + 1)
        tries += [rng.random(CROP_TRIES * 4) for _ in range(hi - 1)]
    if not apply:
        return None
    img_h, img_w = size
    rects = []
    for u in tries[:count]:
        for h, w, ut, ul in _area_ratio_tries(
            u, img_h * img_w, erase.scale, erase.ratio, count
        ):  # h from target*aspect
            if h < img_h and w < img_w:
                top = min(int(ut * (img_h - h + 1)), img_h - h)
                left = min(int(ul * (img_w - w + 1)), img_w - w)
                rects.append((top, left, h, w))
                break
    if not rects:
        return None  # torchvision leaves the image as it is when no try fits
    return EraseDraw(*rects[0], noise_seed, tuple(rects[1:]))


def _area_ratio_tries(u, area: float, scale, ratio, count: int = 1):
    """torchvision's CROP_TRIES tries of a rectangle of random area (a fraction in `scale` of `area`) and
    log-uniform aspect ratio in `ratio` (the area divided by `count`: timm's erasing), four uniforms
    of `u` each: yields (round(sqrt(target * aspect)),
    round(sqrt(target / aspect)), u_top, u_left). RandomResizedCrop reads the first as the width,
    RandomErasing as the height."""
    (s0, s1), (r0, r1) = scale, ratio
    log_r0, log_r1 = math.log(r0), math.log(r1)
    for t in range(CROP_TRIES):
        ua, ur, ut, ul = u[4 * t : 4 * t + 4]
        target = area * (s0 + ua * (s1 - s0)) / count  # timm's erasing: area / count per rectangle
        aspect = math.exp(log_r0 + ur * (log_r1 - log_r0))
        yield int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect))), ut, ul


def _op(choice, bin_index: int, num_bins: int, rng: _Stream) -> OpDraw:
    # Always consume the same number of draws per op so one op's settings never shift the next's.
    negate = rng.random() < 0.5
    aux = tuple(rng.random(2))
    value = choice.value(bin_index, num_bins)
    if choice.signed and negate:
        value = -value
    return OpDraw(choice.name, value, aux)


def crop_window(policy: Policy, d: SampleDraw, height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, crop_height, crop_width) of the crop for an image of this size, in whole source
    pixels (a keep_ratio crop: the part of the source its output covers)."""
    if policy.trim:
        (ty, th), (tx, tw) = trim_side(policy.trim, height), trim_side(policy.trim, width)
        top, left, h, w = _untrimmed_window(policy, d, th, tw)
        return top + ty, left + tx, h, w
    return _untrimmed_window(policy, d, height, width)


def _untrimmed_window(policy: Policy, d: SampleDraw, height: int, width: int) -> tuple[int, int, int, int]:
    if policy.keep_ratio is not None:
        return _whole_pixels(
            *keep_ratio.plan(policy.keep_ratio, policy.size, d.crop_u, height, width)[0], height, width
        )
    if policy.center_resize is not None:
        return center_window(policy.center_resize, policy.size, height, width)
    if d.crops is not None:
        return layered_window(policy, d.crops, height, width)
    return random_window(policy, d.crop_u, height, width)


def layered_window(policy: Policy, crops, height: int, width: int) -> tuple[int, int, int, int]:
    """DeepAA's crops as one window of the source image: none -> the centre output-size window at the
    image's own resolution (an image smaller than the output: its centre, resized up, where theirs pads
    with black); one -> that random resized crop; more -> each later crop drawn on the output-size image
    of the one before, mapped back into the source and rounded to whole source pixels."""
    out_h, out_w = policy.size
    if not crops:
        h, w = min(out_h, height), min(out_w, width)
        return int(round((height - h) / 2.0)), int(round((width - w) / 2.0)), h, w
    top, left, h, w = (float(v) for v in random_window(policy, crops[0], height, width))
    for u in crops[1:]:
        t2, l2, h2, w2 = random_window(policy, u, out_h, out_w)
        sy, sx = h / out_h, w / out_w
        top, left, h, w = top + t2 * sy, left + l2 * sx, h2 * sy, w2 * sx
    return _whole_pixels(left, top, left + w, top + h, height, width)


def crop_plan(policy: Policy, d: SampleDraw, height: int, width: int):
    """The evaluation and keep_ratio crops, unrounded: (source box (x0, y0, x1, y1), the size it is
    resampled to, pads (top, bottom, left, right) to output.size after it -- all zero for the centre
    crop); crop.trim applied."""
    (ty, th), (tx, tw) = trim_side(policy.trim, height), trim_side(policy.trim, width)
    if policy.keep_ratio is not None:
        box, covered, pads = keep_ratio.plan(policy.keep_ratio, policy.size, d.crop_u, th, tw)
    else:
        box, covered, pads = center_box(policy.center_resize, policy.size, th, tw), policy.size, (0, 0, 0, 0)
    return (box[0] + tx, box[1] + ty, box[2] + tx, box[3] + ty), covered, pads


def trim_side(trim: int, side: int) -> tuple[int, int]:
    """(offset, length) of one side after cutting `trim` pixels from each edge (at least 1 pixel kept)."""
    t = min(trim, (side - 1) // 2)
    return t, side - 2 * t


def random_window(policy: Policy, crop_u, height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop window from 40 uniforms."""
    for w, h, ut, ul in _area_ratio_tries(crop_u, height * width, policy.scale, policy.ratio):
        if 0 < w <= width and 0 < h <= height:
            top = min(int(ut * (height - h + 1)), height - h)
            left = min(int(ul * (width - w + 1)), width - w)
            return top, left, h, w
    in_ratio, (r0, r1) = width / height, policy.ratio  # no try fit: centre crop of the clamped ratio
    if in_ratio < r0:  # (torchvision's rounding, but never to an empty window: its resize then fails)
        w, h = width, max(1, int(round(width / r0)))
    elif in_ratio > r1:
        h, w = height, max(1, int(round(height * r1)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_layout(resize, size: tuple[int, int], height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """torchvision's Resize(resize) + CenterCrop(size) of a height x width image: ((the resized height, width),
    (the crop's top, left) in it). `resize` an int: the shorter side; (h, w): the image squashed to that size."""
    if isinstance(resize, tuple):
        new_h, new_w = resize
    else:
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = resize, int(resize * long / short)  # torchvision's Resize(int) output size
        new_h, new_w = (new_short, new_long) if height <= width else (new_long, new_short)
    crop_h, crop_w = size
    return (new_h, new_w), (int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0)))  # CenterCrop


def center_box(resize, size: tuple[int, int], height: int, width: int) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) in the source image, fractional: the region torchvision's Resize(resize) +
    CenterCrop(size) keeps -- the resized image's centre crop mapped back through the resize (`center_layout`)."""
    (new_h, new_w), (top_r, left_r) = center_layout(resize, size, height, width)
    crop_h, crop_w = size
    sy, sx = height / new_h, width / new_w
    return left_r * sx, top_r * sy, (left_r + crop_w) * sx, (top_r + crop_h) * sy


def center_window(resize, size: tuple[int, int], height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, crop_height, crop_width) in the source image of torchvision's Resize(resize) +
    CenterCrop(size): `center_box` rounded to whole source pixels (so it differs from torchvision by
    under half a source pixel at the edges; the exact mode resamples the fractional box itself)."""
    return _whole_pixels(*center_box(resize, size, height, width), height, width)


def _whole_pixels(x0: float, y0: float, x1: float, y1: float, height: int, width: int) -> tuple[int, int, int, int]:
    """A fractional box (x0, y0, x1, y1) as (top, left, height, width) of whole source pixels, inside the image."""
    top, left = min(int(round(y0)), height - 1), min(int(round(x0)), width - 1)
    h = max(1, min(int(round(y1)) - top, height - top))
    w = max(1, min(int(round(x1)) - left, width - left))
    return top, left, h, w
