"""What every augmentation op *is*, declared once: its name, whether it takes a magnitude, the
domain a policy may map magnitudes into, and how a drawn value becomes concrete parameters.

This module is pure (math + numpy-free tuples): the policy layer validates files against it, and
both implementations -- CPU (`fusionflow.ops.exact`) and DALI (`fusionflow.accel.dali_ops`) -- consume the
parameters `resolve` produces, so the two can only disagree on pixel arithmetic, never on what
was asked for.

Value conventions (the unit of an op's `range` in a policy file):
  ShearX/ShearY    shear factor (tan of the shear angle), torchvision's convention
  TranslateX/Y     pixels (truncated to an int), of the op's input, i.e. the output size
  ShiftX/Y         pixels, fractional (timm's translations): the image moves right / down by v
                   pixels, resampled with the policy's interpolation
  SkewX/Y          shear factor as ShearX/Y, but the matrix (1, v, 0, 0, 1, 0) as written (timm's
                   shears; ShearX/Y go through torchvision's angle arithmetic, an ulp away)
  Rotate           degrees, counter-clockwise
  Brightness, Color, Contrast, Sharpness
                   v, enhancement factor = 1 + v (0 = unchanged, -1 = fully degenerate)
  Hue              v in [-0.5, 0.5], torchvision's hue_factor: the hue turns by int(255 v) of
                   Pillow's 255 hue steps (ColorJitter's hue; CPU only, the DALI graph has none)
  Posterize        bits kept per channel (integer, 0..8)
  Solarize         threshold in pixel values: pixels >= threshold are inverted (256 = no-op)
  SolarizeAdd      value added to pixels below 128, clipped to 255
  Cutout           side in pixels of a square filled with the policy's fill colour, centred at a
                   position drawn uniformly over the image
  Identity, AutoContrast, Equalize, Invert, FlipX (a left-right mirror) take no magnitude.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# Parameters handed to implementations: a fixed-length tuple of floats, so a DALI pipeline can take
# them as one per-sample tensor input. Unused slots are zero.
NUM_PARAMS = 6
ParamTuple = tuple  # of NUM_PARAMS floats


@dataclass(frozen=True)
class OpSpec:
    name: str
    has_magnitude: bool
    # Allowed values for the op's range; for size-relative ops, a fraction of `scale_by`.
    domain: tuple[float, float] = (0.0, 0.0)
    integer: bool = False  # value is rounded to an int after the bin -> value mapping
    scale_by: str | None = None  # "width" | "height" | "side": domain is relative to that size
    needs_aux: bool = False  # consumes the two extra uniforms drawn per op (Cutout's position)
    resolve: Callable[[float, tuple, int, int], ParamTuple] | None = None
    doc: str = ""
    dali: bool = True  # the DALI graph has it (fusionflow/accel/dali_ops.py); else the accelerator declines

    def domain_for(self, height: int, width: int) -> tuple[float, float]:
        scale = {"width": width, "height": height, "side": min(height, width), None: 1}[self.scale_by]
        return (self.domain[0] * scale, self.domain[1] * scale)


def _pad(*values: float) -> ParamTuple:
    return tuple(float(v) for v in values) + (0.0,) * (NUM_PARAMS - len(values))


def inverse_affine(center, angle, translate, shear) -> tuple[float, ...]:
    """Output -> input matrix (a, b, c, d, e, f) of the affine map ``T * C * R * Sh * C^-1``.

    Coordinates are continuous with pixel centres at +0.5, Pillow's convention for
    ``Image.transform(AFFINE)``. ``angle`` and ``shear`` (x, y) are in degrees, as torchvision's
    ``F.affine`` takes them; rotation R is followed by shears SHy(sy) * SHx(sx).
    """
    rot = math.radians(angle)
    sx, sy = math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    # forward 2x2 part: R(rot) * SHy(sy) * SHx(sx), determinant 1
    a = math.cos(rot - sy) / math.cos(sy)
    b = -a * math.tan(sx) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -c * math.tan(sx) + math.cos(rot)
    # inverse of [[a, b], [c, d]] (det = 1): [[d, -b], [-c, a]]
    ia, ib, ic, id_ = d, -b, -c, a
    # p_in = C + M^-1 (p_out - C - t)
    ox = cx - (ia * (cx + tx) + ib * (cy + ty))
    oy = cy - (ic * (cx + tx) + id_ * (cy + ty))
    return (ia, ib, ox, ic, id_, oy)


def rotation_matrix(angle: float, height: int, width: int) -> tuple[float, ...]:
    """Output -> input matrix of a counter-clockwise rotation by ``angle`` degrees about the image
    centre (width/2, height/2), same canvas size."""
    t = -math.radians(angle)
    cos_t, sin_t = math.cos(t), math.sin(t)
    cx, cy = width / 2.0, height / 2.0
    return (cos_t, sin_t, cx - cos_t * cx - sin_t * cy, -sin_t, cos_t, cy + sin_t * cx - cos_t * cy)


def _shear_x(v, aux, h, w):
    return _pad(*inverse_affine((0.0, 0.0), 0.0, (0, 0), (math.degrees(math.atan(v)), 0.0)))


def _shear_y(v, aux, h, w):
    return _pad(*inverse_affine((0.0, 0.0), 0.0, (0, 0), (0.0, math.degrees(math.atan(v)))))


def _translate_x(v, aux, h, w):
    return _pad(*inverse_affine((w * 0.5, h * 0.5), 0.0, (int(v), 0), (0.0, 0.0)))


def _translate_y(v, aux, h, w):
    return _pad(*inverse_affine((w * 0.5, h * 0.5), 0.0, (0, int(v)), (0.0, 0.0)))


def _skew_x(v, aux, h, w):
    return _pad(1.0, v, 0.0, 0.0, 1.0, 0.0)


def _skew_y(v, aux, h, w):
    return _pad(1.0, 0.0, 0.0, v, 1.0, 0.0)


def _shift_x(v, aux, h, w):
    return _pad(1.0, 0.0, -v, 0.0, 1.0, 0.0)  # x_in = x - v, the matrix as written (no centre terms)


def _shift_y(v, aux, h, w):
    return _pad(1.0, 0.0, 0.0, 0.0, 1.0, -v)


def _rotate(v, aux, h, w):
    return _pad(*rotation_matrix(v, h, w))


def _factor(v, aux, h, w):
    return _pad(1.0 + v)


def _scalar(v, aux, h, w):
    return _pad(v)


def _posterize(v, aux, h, w):
    bits = int(v)
    return _pad(bits, (0xFF << (8 - bits)) & 0xFF)  # bits, and the mask that keeps them


def _cutout(v, aux, h, w):
    """(top, left, height, width) of the square, clipped to the image."""
    side = int(v)
    cx, cy = min(int(aux[0] * w), w - 1), min(int(aux[1] * h), h - 1)
    x0, y0 = max(0, cx - side // 2), max(0, cy - side // 2)
    x1, y1 = min(w, cx - side // 2 + side), min(h, cy - side // 2 + side)
    return _pad(y0, x0, max(0, y1 - y0), max(0, x1 - x0))


def _none(v, aux, h, w):
    return _pad()


_SPECS = [
    OpSpec("Identity", False, resolve=_none, doc="returns the image unchanged"),
    OpSpec("ShearX", True, (-2.0, 2.0), resolve=_shear_x, doc="horizontal shear about the top-left corner"),
    OpSpec("ShearY", True, (-2.0, 2.0), resolve=_shear_y, doc="vertical shear about the top-left corner"),
    OpSpec("TranslateX", True, (-1.0, 1.0), scale_by="width", resolve=_translate_x, doc="shift right by pixels"),
    OpSpec("TranslateY", True, (-1.0, 1.0), scale_by="height", resolve=_translate_y, doc="shift down by pixels"),
    OpSpec("SkewX", True, (-2.0, 2.0), resolve=_skew_x, doc="horizontal shear, the factor's matrix as written"),
    OpSpec("SkewY", True, (-2.0, 2.0), resolve=_skew_y, doc="vertical shear, the factor's matrix as written"),
    OpSpec("ShiftX", True, (-1.0, 1.0), scale_by="width", resolve=_shift_x, doc="shift right by fractional pixels"),
    OpSpec("ShiftY", True, (-1.0, 1.0), scale_by="height", resolve=_shift_y, doc="shift down by fractional pixels"),
    OpSpec("Rotate", True, (-180.0, 180.0), resolve=_rotate, doc="counter-clockwise rotation in degrees"),
    OpSpec("Brightness", True, (-1.0, 10.0), resolve=_factor, doc="blend with black, factor 1+v"),
    OpSpec("Color", True, (-1.0, 10.0), resolve=_factor, doc="blend with grayscale (saturation), factor 1+v"),
    OpSpec("Contrast", True, (-1.0, 10.0), resolve=_factor, doc="blend with mean gray, factor 1+v"),
    OpSpec("Sharpness", True, (-1.0, 10.0), resolve=_factor, doc="blend with a smoothed copy, factor 1+v"),
    OpSpec("Hue", True, (-0.5, 0.5), resolve=_scalar, doc="turn the hue by v of a full turn", dali=False),
    OpSpec("Posterize", True, (0.0, 8.0), integer=True, resolve=_posterize, doc="keep the top v bits"),
    OpSpec("Solarize", True, (0.0, 256.0), resolve=_scalar, doc="invert pixels >= v"),
    OpSpec("SolarizeAdd", True, (0.0, 255.0), resolve=_scalar, doc="add v to pixels < 128, clip"),
    OpSpec("AutoContrast", False, resolve=_none, doc="stretch each channel to 0..255"),
    OpSpec("Equalize", False, resolve=_none, doc="histogram-equalize each channel"),
    OpSpec("Invert", False, resolve=_none, doc="255 - pixel"),
    OpSpec("FlipX", False, resolve=_none, doc="mirror left-right (DeepAA's RandFlip, an op of its policy)"),
    OpSpec(
        "GaussianBlur",
        True,
        (0.0, 50.0),
        resolve=_scalar,
        doc="Pillow's GaussianBlur, radius v (timm's 3a)",
        dali=False,
    ),
    OpSpec(
        "Cutout",
        True,
        (0.0, 1.0),
        scale_by="side",
        needs_aux=True,
        resolve=_cutout,
        doc="fill a v-pixel square at a random position",
    ),
]

OPS: dict[str, OpSpec] = {s.name: s for s in _SPECS}


def registrar(table: dict, kind: str):
    """A decorator factory that files implementations of registered ops into `table`."""

    def impl(*names: str):
        def register(fn):
            for name in names:
                if name not in OPS:
                    raise KeyError(f"{kind}({name!r}): no such op in fusionflow.policy.op_specs")
                table[name] = fn
            return fn

        return register

    return impl


OP_NAMES: tuple[str, ...] = tuple(OPS)
