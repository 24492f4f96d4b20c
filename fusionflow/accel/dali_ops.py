"""DALI implementations of every registered op: graph fragments for device 'cpu' or 'gpu'.

Each fragment takes (images, params, style): `images` a batch of uint8 HWC DataNodes, `params` the
per-sample float32 vector (NUM_PARAMS,) that the op's `resolve` in `fusionflow.policy.op_specs` produced
on the host -- the same numbers the CPU implementation gets -- and returns uint8 HWC.

The pixel arithmetic reproduces Pillow's where DALI allows it (blends truncate like Pillow's,
gray is Pillow's fixed-point ITU-R 601 luma); Equalize uses DALI's own histogram equalisation,
whose rounding differs. tests/test_ops_dali.py states each op's tolerance against the CPU ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from fusionflow.policy.op_specs import registrar

DaliOp = Callable[..., object]


@dataclass(frozen=True)
class DaliStyle:
    """What a fragment needs beyond its inputs: the policy's interpolation and fill, the image
    size (every op runs at the policy's output size) and where the graph runs."""

    interpolation: str = "nearest"
    fill: tuple[int, int, int] = (0, 0, 0)
    size: tuple[int, int] = (224, 224)
    device: str = "cpu"

    def constant(self, array: np.ndarray):
        node = fn.constant(fdata=array.ravel().tolist(), shape=list(array.shape), dtype=types.FLOAT)
        return node.gpu() if self.device == "gpu" else node

    def dev(self, node):
        """A per-sample parameter (a CPU input) moved to where the pixels are, for arithmetic."""
        return node.gpu() if self.device == "gpu" else node


DALI_IMPLS: dict[str, DaliOp] = {}

_INTERP = {"nearest": types.INTERP_NN, "bilinear": types.INTERP_LINEAR}


dali_impl = registrar(DALI_IMPLS, "dali_impl")


def _u8(x):
    """float -> uint8 the way Pillow stores blend results: clamp, then truncate."""
    return fn.cast(dmath.floor(dmath.clamp(x, 0.0, 255.0)), dtype=types.UINT8)


def _gray(images):
    """Pillow's RGB -> L: (R*19595 + G*38470 + B*7471 + 2^15) >> 16, as int32 HxWx1."""
    x = fn.cast(images, dtype=types.INT32)
    return (x[:, :, 0:1] * 19595 + x[:, :, 1:2] * 38470 + x[:, :, 2:3] * 7471 + 32768) >> 16


def _blend(images, degenerate, factor):
    """Pillow's ImageEnhance: degenerate + factor * (image - degenerate), truncated."""
    d = fn.cast(degenerate, dtype=types.FLOAT)
    return _u8(d + factor * (fn.cast(images, dtype=types.FLOAT) - d))


@dali_impl("Identity")
def identity(images, params, style):
    return images


@dali_impl("ShearX", "ShearY", "TranslateX", "TranslateY", "ShiftX", "ShiftY", "SkewX", "SkewY", "Rotate")
def affine(images, params, style):
    # Output -> input matrix in Pillow's pixel-centre convention, which DALI's warp_affine shares.
    matrix = fn.reshape(params[0:6], shape=[2, 3])
    return fn.warp_affine(
        images,
        matrix=matrix,
        fill_value=float(style.fill[0]),
        interp_type=_INTERP[style.interpolation],
        inverse_map=True,
    )


@dali_impl("FlipX")
def flip_x(images, params, style):
    return fn.flip(images, horizontal=1)


@dali_impl("Brightness")
def brightness(images, params, style):
    return _u8(fn.cast(images, dtype=types.FLOAT) * style.dev(params[0]))


@dali_impl("Color")
def color(images, params, style):
    return _blend(images, _gray(images), style.dev(params[0]))


@dali_impl("Contrast")
def contrast(images, params, style):
    mean = fn.reductions.mean(fn.cast(_gray(images), dtype=types.FLOAT))
    return _blend(images, dmath.floor(mean + 0.5), style.dev(params[0]))


_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13.0


@dali_impl("Sharpness")
def sharpness(images, params, style):
    # Pillow's SMOOTH filter rounds to nearest and leaves the one-pixel border unfiltered.
    img = fn.cast(images, dtype=types.FLOAT)
    smooth = dmath.floor(fn.filter(images, _SMOOTH, border="clamp", dtype=types.FLOAT) + 0.5)
    mask = style.constant(_interior_mask(*style.size))
    degenerate = smooth * mask + img * (1.0 - mask)
    return _u8(degenerate + style.dev(params[0]) * (img - degenerate))


def _interior_mask(height: int, width: int) -> np.ndarray:
    mask = np.zeros((height, width, 1), np.float32)
    mask[1:-1, 1:-1] = 1.0
    return mask


@dali_impl("Posterize")
def posterize(images, params, style):
    return images & style.dev(fn.cast(params[1], dtype=types.UINT8))


@dali_impl("Solarize")
def solarize(images, params, style):
    x = fn.cast(images, dtype=types.INT32)
    flip = fn.cast(fn.cast(images, dtype=types.FLOAT) >= style.dev(params[0]), dtype=types.INT32)
    return fn.cast(x + flip * (255 - 2 * x), dtype=types.UINT8)


@dali_impl("SolarizeAdd")
def solarize_add(images, params, style):
    x = fn.cast(images, dtype=types.FLOAT)
    low = fn.cast(x < 128.0, dtype=types.FLOAT)
    return _u8(x + low * style.dev(dmath.floor(params[0])))


@dali_impl("AutoContrast")
def autocontrast(images, params, style):
    x = fn.cast(images, dtype=types.FLOAT)
    lo = fn.reductions.min(x, axes=[0, 1])
    hi = fn.reductions.max(x, axes=[0, 1])
    spread = fn.cast(hi > lo, dtype=types.FLOAT)  # flat channels stay as they are, as in Pillow
    scale = 255.0 / dmath.max(hi - lo, 1.0)
    stretched = dmath.floor(dmath.clamp(x * scale - lo * scale, 0.0, 255.0))
    return fn.cast(stretched * spread + x * (1.0 - spread), dtype=types.UINT8)


@dali_impl("Equalize")
def equalize(images, params, style):
    return fn.equalize(images)


@dali_impl("Invert")
def invert(images, params, style):
    return fn.cast(255 - fn.cast(images, dtype=types.INT32), dtype=types.UINT8)


@dali_impl("Cutout")
def cutout(images, params, style):
    return fn.erase(
        images, anchor=params[0:2], shape=params[2:4], axis_names="HW", fill_value=[float(c) for c in style.fill]
    )
