"""CPU implementations of every registered op, on Pillow images (mode RGB).

Each takes (image, value, params, style) -- `value` in the op's unit, `params` from the op's
`resolve` in `fusionflow.ops.specs`, `style` the policy's interpolation and fill -- and returns a
new image. Semantics equal torchvision.transforms.v2's functional op of the same name on a PIL
image (checked op by op in tests/test_ops_cpu.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from PIL import Image, ImageEnhance, ImageOps

from fusionflow.ops.specs import registrar

CpuOp = Callable[[Image.Image, float, tuple, "Style"], Image.Image]
CPU_IMPLS: dict[str, CpuOp] = {}

_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR}


@dataclass(frozen=True)
class Style:
    interpolation: str = "nearest"
    fill: tuple[int, int, int] = (0, 0, 0)

    @property
    def resample(self):
        return _RESAMPLE[self.interpolation]


cpu_impl = registrar(CPU_IMPLS, "cpu_impl")


@cpu_impl("Identity")
def identity(img, value, params, style):
    return img


@cpu_impl("ShearX", "ShearY", "TranslateX", "TranslateY")
def affine(img, value, params, style):
    return img.transform(img.size, Image.Transform.AFFINE, params[:6], style.resample, fillcolor=style.fill)


@cpu_impl("Rotate")
def rotate(img, value, params, style):
    # Pillow's own rotate (not the shared matrix): it turns exact multiples of 90 degrees into
    # lossless transposes, as torchvision does on PIL images.
    return img.rotate(value, style.resample, fillcolor=style.fill)


@cpu_impl("Brightness")
def brightness(img, value, params, style):
    return ImageEnhance.Brightness(img).enhance(params[0])


@cpu_impl("Color")
def color(img, value, params, style):
    return ImageEnhance.Color(img).enhance(params[0])


@cpu_impl("Contrast")
def contrast(img, value, params, style):
    return ImageEnhance.Contrast(img).enhance(params[0])


@cpu_impl("Sharpness")
def sharpness(img, value, params, style):
    return ImageEnhance.Sharpness(img).enhance(params[0])


@cpu_impl("Posterize")
def posterize(img, value, params, style):
    # a LUT rather than ImageOps.posterize, which refuses 0 bits (the paper's policy can draw 0)
    mask = int(params[1])
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


@cpu_impl("Solarize")
def solarize(img, value, params, style):
    return ImageOps.solarize(img, params[0])


@cpu_impl("SolarizeAdd")
def solarize_add(img, value, params, style):
    add = params[0]
    lut = [min(255, int(i + add)) if i < 128 else i for i in range(256)]
    return img.point(lut * len(img.getbands()))


@cpu_impl("AutoContrast")
def autocontrast(img, value, params, style):
    return ImageOps.autocontrast(img)


@cpu_impl("Equalize")
def equalize(img, value, params, style):
    return ImageOps.equalize(img)


@cpu_impl("Invert")
def invert(img, value, params, style):
    return ImageOps.invert(img)


@cpu_impl("Cutout")
def cutout(img, value, params, style):
    top, left, h, w = (int(v) for v in params[:4])
    if h <= 0 or w <= 0:
        return img
    out = img.copy()
    out.paste(style.fill, (left, top, left + w, top + h))
    return out


def apply(name: str, img: Image.Image, value: float, params: tuple, style: Style) -> Image.Image:
    return CPU_IMPLS[name](img, value, params, style)
