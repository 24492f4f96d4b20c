"""DALI implementations of every registered op: graph fragments for device 'cpu' or 'gpu'.

Each fragment takes (images, params, style): `images` a batch of uint8 HWC DataNodes, `params` the
per-sample float32 vector (NUM_PARAMS,) that the op's `resolve` in `fusionflow.policy.op_specs` produced
on the host -- the same numbers the CPU implementation gets -- and returns uint8 HWC.

The pixel arithmetic reproduces Pillow's where DALI allows it (blends truncate like Pillow's,
gray is Pillow's fixed-point ITU-R 601 luma); Equalize uses DALI's own histogram equalisation,
whose rounding differs. tests/test_ops_dali.py states each op's tolerance against the CPU ops.

Each fragment is written in as few DALI operators as give the same pixels: every operator is a node
that DALI's `Run` walks in the calling thread and a task its scheduler signals, on every run, whatever
the run's size (on a GPU, a kernel launch too). A pipeline's fixed cost per run follows its node count.
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


# DALI's cast saturates (ConvertSat on the CPU and the GPU): after a floor, casting to uint8 is
# Pillow's clamp-then-truncate in one operator.
def _u8(x):
    """float -> uint8 the way Pillow stores blend results: clamp, then truncate."""
    return fn.cast(dmath.floor(x), dtype=types.UINT8)


# Pillow's L = (R*19595 + G*38470 + B*7471 + 2^15) >> 16 as one weighted sum over the channels, with the
# weights divided by 2^16: every product and partial sum is a multiple of 2^-16 below 256, exact in
# float32's 24 bits in any order of evaluation, so the floor is the shift's result exactly.
_GRAY_M = [19595 / 65536, 38470 / 65536, 7471 / 65536]


def _gray(images):
    """Pillow's RGB -> L as float HxWx1 (integer values)."""
    return dmath.floor(fn.coord_transform(images, M=_GRAY_M, T=[0.5], dtype=types.FLOAT))


def _blend(images, degenerate, factor):
    """Pillow's ImageEnhance: degenerate + factor * (image - degenerate), truncated (`degenerate` float)."""
    return _u8(degenerate + factor * (fn.cast(images, dtype=types.FLOAT) - degenerate))


_U255 = types.Constant(255, dtype=types.UINT8)  # keeps uint8 arithmetic in uint8


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
    return _blend(images, dmath.floor(fn.reductions.mean(_gray(images)) + 0.5), style.dev(params[0]))


_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13.0


@dali_impl("Sharpness")
def sharpness(images, params, style):
    # Pillow's SMOOTH filter rounds to nearest and leaves the one-pixel border unfiltered.
    img = fn.cast(images, dtype=types.FLOAT)
    smooth = dmath.floor(fn.filter(images, _SMOOTH, border="clamp", dtype=types.FLOAT) + 0.5)
    mask = style.constant(_interior_mask(*style.size))
    degenerate = img + mask * (smooth - img)  # integers below 256 and a 0/1 mask: exact either side
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
    # 255 - x is x ^ 255 for uint8: the pixels at or above the threshold xor-ed with 255
    return images ^ ((images >= style.dev(params[0])) * _U255)


@dali_impl("SolarizeAdd")
def solarize_add(images, params, style):
    x = fn.cast(images, dtype=types.FLOAT)
    return _u8(x + (x < 128.0) * style.dev(dmath.floor(params[0])))


@dali_impl("AutoContrast")
def autocontrast(images, params, style):
    # Pillow maps each channel by x * scale - lo * scale, scale = 255 / (hi - lo), and leaves a flat
    # channel (hi == lo) as it is. The per-channel gain and offset below give exactly those values
    # (the gain is 1 and the offset 0 for a flat channel), so only three operators touch every pixel.
    x = fn.cast(images, dtype=types.FLOAT)
    lo = fn.reductions.min(x, axes=[0, 1])
    hi = fn.reductions.max(x, axes=[0, 1])
    spread = hi - lo
    gain = 255.0 / dmath.max(spread, (spread == 0.0) * 255.0)
    offset = lo * gain * (spread > 0.0)
    return _u8(x * gain - offset)


@dali_impl("Equalize")
def equalize(images, params, style):
    return fn.equalize(images)


@dali_impl("Invert")
def invert(images, params, style):
    return _U255 - images


@dali_impl("Cutout")
def cutout(images, params, style):
    return fn.erase(
        images, anchor=params[0:2], shape=params[2:4], axis_names="HW", fill_value=[float(c) for c in style.fill]
    )


def slot_branches(names) -> tuple[list, list[int], list[int]]:
    """The op slot's branches for local op ids `names`: one per distinct DALI fragment, so that ops
    sharing one (the affine ops: their matrix is a parameter) share one conditional. Returns the
    fragments in order of first use, and the (keys, values) of the lookup table from local op id to
    branch number (1 on; 0, Identity's and an empty slot's, runs no branch)."""
    fragments, values = [], []
    for name in names[1:]:
        impl = DALI_IMPLS[name]
        if impl is not DALI_IMPLS["Identity"] and impl not in fragments:
            fragments.append(impl)
        values.append(fragments.index(impl) + 1 if impl in fragments else 0)
    return fragments, list(range(1, len(names))), values


def apply_slot(images, branch, params, fragments, style):
    """images after the op of each sample's `branch`: one per-sample DALI conditional per fragment, each
    reassigning the images of the samples it takes (a sample takes at most one)."""
    for b, impl in enumerate(fragments, 1):
        if branch == b:
            images = impl(images, params, style)
    return images


def erase_fragment(images, erase, device, anchor, shape):
    """torchvision's RandomErasing on CHW output: the drawn rectangle (`anchor` [top, left], `shape`
    [h, w]; empty when the sample is not erased) set to the policy's value; for 'random', set to 0 and
    the host's noise (zero outside the rectangle) added, so the rectangle holds exactly the CPU path's
    noise."""
    fill = [0.0, 0.0, 0.0] if erase.value is None else [float(v) for v in erase.value]
    images = fn.erase(images, anchor=anchor, shape=shape, axis_names="HW", fill_value=fill)
    if erase.value is None:
        noise = fn.external_source(name="erase_noise", dtype=types.FLOAT, ndim=3, layout="CHW")
        images = images + (noise.gpu() if device == "gpu" else noise)
    return images
