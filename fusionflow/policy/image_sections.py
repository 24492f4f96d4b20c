"""The policy sections that say what image a sample becomes, apart from the augment ops: `output`
(size, normalize), `decode` (mode, max_pixels), `crop` (random resized or center), `jitter`
(ColorJitter after the flip) and `erase` (RandomErasing on the output). schema.py's `parse_policy`
calls one parser per section, and overrides.py reuses `parse_erase`, `parse_jitter` and
`check_center_resize` for load_policy's keyword overrides; each
raises the ValueError naming the file and the key path (configs/README.md documents the keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusionflow.policy import keep_ratio
from fusionflow.policy.reader import Reader

DECODE_MODES = ("exact", "fast")
# Pillow's default DecompressionBombError threshold (2 x its MAX_IMAGE_PIXELS of 89,478,485): images
# a stock Pillow opens still load, and one sample's RGB decode stays under ~512 MiB per worker.
DEFAULT_MAX_PIXELS = 178_956_970


@dataclass(frozen=True)
class Erase:
    """torchvision.transforms.v2.RandomErasing(p, scale, ratio, value), applied to the output; with
    `count` and `noise`, timm's RandomErasing (max_count, modes const / rand / pixel)."""

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: tuple[float, float, float] | None = (0.0, 0.0, 0.0)  # None: standard normal noise
    noise: str = "pixel"  # value None: "pixel" (per pixel, 'random') or "color" (per channel, 'random_color')
    count: tuple[int, int] = (1, 1)  # rectangles per erased sample, drawn uniformly; each gets area / count


@dataclass(frozen=True)
class Jitter:
    """torchvision's ColorJitter (in RandomApply's p): per sample, in a random order, brightness,
    contrast, saturation and hue adjusted by factors drawn uniformly from these ranges; None: not
    adjusted. Factors as torchvision's adjust_* take them (hue: a fraction of a turn)."""

    brightness: tuple[float, float] | None = None
    contrast: tuple[float, float] | None = None
    saturation: tuple[float, float] | None = None
    hue: tuple[float, float] | None = None
    p: float = 1.0

    KEYS = ("brightness", "contrast", "saturation", "hue")  # torchvision's fn_idx 0..3
    OPS = ("Brightness", "Contrast", "Color", "Hue")  # the ops that run them (fusionflow/policy/op_specs.py)

    @property
    def ranges(self) -> tuple:
        return (self.brightness, self.contrast, self.saturation, self.hue)


@dataclass(frozen=True)
class Blur:
    """torchvision's GaussianBlur(kernel_size, sigma) in RandomApply(p) (timm's gaussian_blur_prob):
    after the augment ops, sigma drawn uniformly per sample, reflected borders."""

    kernel_size: tuple[int, int] = (23, 23)  # as torchvision's kernel_size: (x, y), odd
    sigma: tuple[float, float] = (0.1, 2.0)
    p: float = 1.0


def parse_blur(r: Reader, raw: Any, path: str = "blur", size: tuple[int, int] | None = None) -> Blur:
    """A `blur:` mapping; with `size`, the output's (height, width), its kernel checked to fit (`check_blur_fits`)."""
    b = r.mapping(raw, path, (), ("kernel_size", "sigma", "p"))
    k = b.get("kernel_size", 23)
    k = [k, k] if not isinstance(k, (list, tuple)) else list(k)
    if len(k) != 2:
        r.fail(f"{path}.kernel_size", f"{k!r}: an odd integer or [x, y] of them")
    kernel = tuple(r.integer(v, f"{path}.kernel_size", 1, 255) for v in k)
    if any(v % 2 == 0 for v in kernel):
        r.fail(f"{path}.kernel_size", f"{list(kernel)}: must be odd, as torchvision's GaussianBlur requires")
    s = b.get("sigma", [0.1, 2.0])
    s = [s, s] if not isinstance(s, (list, tuple)) else list(s)
    sigma = tuple(r.number(v, f"{path}.sigma", 1e-6, 1e3) for v in s)
    if len(sigma) != 2 or sigma[0] > sigma[1]:
        r.fail(f"{path}.sigma", f"{s!r}: a number or [lo, hi] with 0 < lo <= hi")
    blur = Blur(kernel, sigma, r.number(b.get("p", 1.0), f"{path}.p", 0.0, 1.0))
    if size is not None:
        check_blur_fits(r, blur, size, f"{path}.kernel_size")
    return blur


def check_blur_fits(r: Reader, blur: Blur, size: tuple[int, int], path: str) -> None:
    """GaussianBlur pads the output image by half its kernel (reflecting, as torchvision's): half a side at most."""
    (kx, ky), (height, width) = blur.kernel_size, size
    if kx // 2 >= width or ky // 2 >= height:
        r.fail(
            path,
            f"{list(blur.kernel_size)} does not fit the {height}x{width} output (torchvision's GaussianBlur pads by "
            f"half the kernel and needs that below the side): at most {2 * width - 1} wide and {2 * height - 1} high",
        )


def parse_jitter(r: Reader, raw: Any, path: str = "jitter") -> Jitter | None:
    """A `jitter:` mapping (or a Jitter) -> Jitter; None when it adjusts nothing. A number v means
    torchvision's [max(0, 1 - v), 1 + v] (hue: [-v, v], v <= 0.5); a pair is the range itself."""
    if isinstance(raw, Jitter):
        raw = {k: v for k, v in zip(Jitter.KEYS, raw.ranges) if v is not None} | {"p": raw.p}
    j = r.mapping(raw, path, (), (*Jitter.KEYS, "p"))
    if not any(k in j for k in Jitter.KEYS):
        r.fail(path, f"name at least one of {', '.join(Jitter.KEYS)}")
    ranges = [_jitter_range(r, j.get(k), f"{path}.{k}", k == "hue") for k in Jitter.KEYS]
    p = r.number(j.get("p", 1.0), f"{path}.p", 0.0, 1.0)
    return Jitter(*ranges, p=p) if any(ranges) and p > 0 else None


def _jitter_range(r: Reader, raw: Any, path: str, hue: bool) -> tuple[float, float] | None:
    if raw is None:
        return None
    if isinstance(raw, (list, tuple)):
        lo, hi = r.pair(raw, path, -0.5 if hue else 0.0, 0.5 if hue else None)
    else:
        v = r.number(raw, path, 0.0, 0.5 if hue else None)
        lo, hi = (-v, v) if hue else (max(0.0, 1.0 - v), 1.0 + v)
    centre = 0.0 if hue else 1.0
    return None if lo == hi == centre else (float(lo), float(hi))


def parse_output(r: Reader, raw: Any):
    """The `output:` mapping -> (size as (height, width), normalize as (mean, std) or None)."""
    out = r.mapping(raw, "output", ("size",), ("normalize",))
    size_raw = out["size"]
    if isinstance(size_raw, int) and not isinstance(size_raw, bool):
        size = (r.integer(size_raw, "output.size", 8, 8192),) * 2
    elif isinstance(size_raw, (list, tuple)) and len(size_raw) == 2:
        size = tuple(r.integer(v, f"output.size[{i}]", 8, 8192) for i, v in enumerate(size_raw))
    else:
        r.fail("output.size", f"expected an int or [height, width], got {size_raw!r}")
    normalize = None
    if out.get("normalize") is not None:
        norm = r.mapping(out["normalize"], "output.normalize", ("mean", "std"), ())
        mean = r.triple(norm["mean"], "output.normalize.mean", 0.0, 1.0)
        std = r.triple(norm["std"], "output.normalize.std", 1e-6, None)
        normalize = (mean, std)
    return size, normalize


def parse_decode(r: Reader, top: dict) -> tuple[bool, int | None]:
    """The top level's `decode:` section -> (fast: mode is "fast", max_pixels or None for no limit);
    without the section, fast decoding with DEFAULT_MAX_PIXELS."""
    if "decode" not in top:
        return True, DEFAULT_MAX_PIXELS
    dec = r.mapping(top["decode"], "decode", (), ("mode", "fast_downscale", "max_pixels"))
    max_pixels = DEFAULT_MAX_PIXELS
    if "max_pixels" in dec:
        max_pixels = None if dec["max_pixels"] is None else r.integer(dec["max_pixels"], "decode.max_pixels", 1)
    if "mode" in dec and "fast_downscale" in dec:
        r.fail("decode", "give decode.mode (exact | fast) or its older spelling decode.fast_downscale, not both")
    if "mode" in dec:
        fast = r.choice(dec["mode"], "decode.mode", DECODE_MODES) == "fast"
    else:
        fast = r.boolean(dec.get("fast_downscale", True), "decode.fast_downscale")
    return fast, max_pixels


CROP_INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "random")  # random: bilinear or bicubic per sample (timm)


def parse_crop(r: Reader, top: dict, size: tuple[int, int]) -> dict:
    """The top level's `crop:` section -> the Policy's crop fields (scale, ratio, center_resize: None
    but for mode center, crop_interpolation, keep_ratio: None but for mode keep_ratio, trim); without
    the section, the random resized crop with torchvision's scale, ratio and (antialiased) bilinear resize."""
    out = dict(scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), center_resize=None, crop_interpolation="bilinear")
    if "crop" not in top:
        return out
    crop = r.mapping(top["crop"], "crop", (), ("interpolation", "trim", *keep_ratio.KEYS))
    out["crop_interpolation"] = interpolation = r.choice(
        crop.get("interpolation", "bilinear"), "crop.interpolation", CROP_INTERPOLATIONS
    )
    out["trim"] = r.integer(crop.get("trim", 0), "crop.trim", 0, 4096)
    mode = r.choice(crop.get("mode", "random"), "crop.mode", ("random", "center", "keep_ratio"))
    if mode == "keep_ratio":
        out["keep_ratio"] = keep_ratio.parse(r, crop, size)
        return out
    for key in sorted(set(crop) & set(keep_ratio.ONLY)):
        r.fail(f"crop.{key}", "applies to crop.mode keep_ratio: add mode: keep_ratio, or remove it")
    out["center_resize"] = _center_crop(r, crop, mode, size)
    if out["center_resize"] is not None and interpolation == "random":
        r.fail("crop.interpolation", "'random' (drawn per sample) is for the random crops, not crop.mode center")
    if "scale" in crop:
        out["scale"] = r.pair(crop["scale"], "crop.scale", 0.0, 1.0)
        if out["scale"][0] <= 0:
            r.fail("crop.scale[0]", "must be > 0 (an empty crop cannot be resized)")
    if "ratio" in crop:
        out["ratio"] = r.pair(crop["ratio"], "crop.ratio", 1e-3, 1e3)
    return out


def parse_erase(r: Reader, raw: Any, path: str, normalize) -> Erase:
    """An `erase:` mapping (or an Erase) -> Erase, checked against the output's units."""
    if isinstance(raw, Erase):
        raw = {
            "p": raw.p,
            "scale": raw.scale,
            "ratio": raw.ratio,
            "value": {"pixel": "random", "color": "random_color"}[raw.noise] if raw.value is None else raw.value,
            "count": list(raw.count),
        }
    e = r.mapping(raw, path, (), ("p", "scale", "ratio", "value", "count"))
    p = r.number(e.get("p", 0.5), f"{path}.p", 0.0, 1.0)
    scale = r.pair(e.get("scale", (0.02, 0.33)), f"{path}.scale", 0.0, 1.0)
    ratio = r.pair(e.get("ratio", (0.3, 3.3)), f"{path}.ratio", 1e-3, 1e3)
    raw_count = e.get("count", 1)
    if isinstance(raw_count, (list, tuple)):
        count = tuple(int(v) for v in r.pair(raw_count, f"{path}.count", 1, 100))
        if any(v != int(v) for v in raw_count):
            r.fail(f"{path}.count", f"expected integers, got {list(raw_count)!r}")
    else:
        count = (r.integer(raw_count, f"{path}.count", 1, 100),) * 2
    raw_value = e.get("value", 0)
    if raw_value in ("random", "random_color"):
        if normalize is None:
            r.fail(
                f"{path}.value",
                f"{raw_value!r} (standard normal noise) needs float output: add output.normalize "
                "(torchvision and timm erase after Normalize), or use a number or [r, g, b]",
            )
        return Erase(p, scale, ratio, None, "pixel" if raw_value == "random" else "color", count)
    if isinstance(raw_value, (list, tuple)) and len(raw_value) == 1:
        raw_value = raw_value[0]
    if isinstance(raw_value, (list, tuple)):
        value = r.triple(raw_value, f"{path}.value")
    elif isinstance(raw_value, (int, float)) and not isinstance(raw_value, bool):
        value = (r.number(raw_value, f"{path}.value"),) * 3
    else:
        r.fail(f"{path}.value", f"expected a number, [r, g, b], 'random' or 'random_color', got {raw_value!r}")
    if normalize is None and not all(v == int(v) and 0 <= v <= 255 for v in value):
        r.fail(
            f"{path}.value",
            f"{list(value)}: without output.normalize the output is uint8, so the value "
            "must be integers 0..255 (or add output.normalize to erase in normalised units)",
        )
    return Erase(p, scale, ratio, value, count=count)


def _center_crop(r: Reader, crop: dict, mode: str, size: tuple[int, int]) -> int | tuple[int, int] | None:
    """crop.mode center (evaluation): the resize of the shorter side; None for the random resized crop."""
    if mode == "random":
        if "resize" in crop:
            r.fail("crop.resize", "applies to crop.mode center (Resize + CenterCrop): add mode: center")
        return None
    for key in ("scale", "ratio"):
        if key in crop:
            r.fail(f"crop.{key}", "applies to the random resized crop, not crop.mode center: remove it")
    if "resize" not in crop:
        r.fail("crop.resize", "missing required key for crop.mode center (e.g. 256 for a 224 crop)")
    return check_center_resize(r, crop["resize"], "crop.resize", size)


def check_center_resize(r: Reader, raw: Any, path: str, size: tuple[int, int]) -> int | tuple[int, int]:
    """An int (Resize(int): the shorter side) or [height, width] (Resize((h, w)): the image squashed to
    exactly that size, as timm's no-aug and 'squash' transforms resize), at least the crop's size."""
    if isinstance(raw, (list, tuple)):
        if len(raw) != 2:
            r.fail(path, f"{list(raw)!r}: give the shorter side (an int) or [height, width]")
        both = tuple(r.integer(v, path, 8, 16384) for v in raw)
        if both[0] < size[0] or both[1] < size[1]:
            r.fail(path, f"{list(both)} is smaller than the {size[0]}x{size[1]} center crop")
        return both
    resize = r.integer(raw, path, 8, 16384)
    if resize < max(size):
        r.fail(path, f"{resize} is smaller than the {size[0]}x{size[1]} center crop: use resize >= {max(size)}")
    return resize
