"""Deep AutoAugment in the authors' order, re-expressed here from their evaluation code's meaning (their
PIL functions, github.com/AIoT-MLSys-Lab/DeepAA DeepAA_evaluate/deep_autoaugment.py, and the search
code's 60-px ImageNet cutout): the whole decoded image goes through the five layers' ops in layer order
(geometric and colour ops on the full image until a RandResizeCrop crops it to 224 x 224), then an
uncropped image is centre-cropped. Given a FusionFlow draw (its steps, ops and crops), this is the
baseline FusionFlow's crop-first pipeline is measured against (experiments/bench_cpu_pipeline.py
--policy deepaa, docs/deepaa.md) and the op-by-op reference of tests/test_deepaa.py.
"""

from __future__ import annotations

import io

from PIL import Image, ImageDraw, ImageEnhance, ImageOps

from fusionflow.policy.sampling import layered_window

ENHANCERS = {
    "Contrast": ImageEnhance.Contrast,
    "Color": ImageEnhance.Color,
    "Brightness": ImageEnhance.Brightness,
    "Sharpness": ImageEnhance.Sharpness,
}


def value(settings, name: str, b: int, negate: bool) -> float:
    lo, hi = {n: (lo, hi) for n, lo, hi in settings.ranges}[name]
    v = (b / (settings.magnitude_bins - 1)) * (hi - lo) + lo
    return -v if negate else v


def authors_op(img: Image.Image, settings, name: str, b: int, negate: bool, aux=(0.5, 0.5)) -> Image.Image:
    """One (op, bin) of the policy on `img` at its current size, as the authors' PIL functions do it."""
    w, h = img.size
    if name == "Identity":
        return img
    if name in ("ShearX", "ShearY"):
        v = value(settings, name, b, negate)
        matrix = (1, v, 0, 0, 1, 0) if name == "ShearX" else (1, 0, 0, v, 1, 0)
        return img.transform(img.size, Image.Transform.AFFINE, matrix)
    if name in ("TranslateX", "TranslateY"):
        v = value(settings, name, b, negate)
        matrix = (1, 0, v * w, 0, 1, 0) if name == "TranslateX" else (1, 0, 0, 0, 1, v * h)
        return img.transform(img.size, Image.Transform.AFFINE, matrix)
    if name == "Rotate":
        return img.rotate(value(settings, name, b, negate))
    if name == "AutoContrast":
        return ImageOps.autocontrast(img)
    if name == "Invert":
        return ImageOps.invert(img)
    if name == "Equalize":
        return ImageOps.equalize(img)
    if name == "Solarize":
        return ImageOps.solarize(img, value(settings, name, b, False))
    if name == "Posterize":
        return ImageOps.posterize(img, max(1, int(value(settings, name, b, False))))
    if name in ENHANCERS:
        return ENHANCERS[name](img).enhance(value(settings, name, b, False))
    if name == "RandFlip":
        return ImageOps.mirror(img) if negate else img
    if name == "RandCutout":  # the search code's ImageNet cutout: centre in the central 256 x 256 box
        half = settings.cutout_side // 2
        x_lo, x_hi = max(0, w // 2 - 128), min(w, w // 2 + 128)
        y_lo, y_hi = max(0, h // 2 - 128), min(h, h // 2 + 128)
        x, y = x_lo + aux[0] * (x_hi - x_lo), y_lo + aux[1] * (y_hi - y_lo)
        x0, x1 = int(min(w, max(0, x - half))), int(min(w, max(0, x + half)))
        y0, y1 = int(min(h, max(0, y - half))), int(min(h, max(0, y + half)))
        img = img.copy()
        ImageDraw.Draw(img).rectangle((x0, y0, x1, y1), settings.cutout_fill)
        return img
    raise ValueError(f"no authors' op {name!r}")


def authors_sample(policy, data: bytes, d) -> Image.Image:
    """The sample of draw `d` in the authors' order: full image, layers in order, centre crop if uncropped."""
    settings, (out_h, out_w) = policy.augment.deepaa, policy.size
    img = Image.open(io.BytesIO(data)).convert("RGB")
    ops, crops = iter(d.ops), iter(d.crops)
    for step in d.steps:
        if step.op == "RandResizeCrop_imagenet":
            # torchvision's RandomResizedCrop window from the crop's uniforms (one crop: no composition)
            t, le, h, w = layered_window(policy, [next(crops)], img.height, img.width)
            img = img.resize((out_w, out_h), Image.Resampling.BICUBIC, box=(le, t, le + w, t + h))
            continue
        aux = (0.5, 0.5)
        if step.op != "Identity" and (step.op != "RandFlip" or step.negate):
            aux = next(ops).aux
        img = authors_op(img, settings, step.op, int(step.level), step.negate, aux)
    if img.size == (out_w, out_h):
        return img
    w, h = img.size
    if w < out_w or h < out_h:  # theirs pads with black to the output size first
        canvas = Image.new("RGB", (max(w, out_w), max(h, out_h)))
        canvas.paste(img, ((canvas.width - w) // 2, (canvas.height - h) // 2))
        img, (w, h) = canvas, canvas.size
    top, left = int(round((h - out_h) / 2.0)), int(round((w - out_w) / 2.0))
    return img.crop((left, top, left + out_w, top + out_h))
