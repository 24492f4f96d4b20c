"""Deep AutoAugment in the authors' order (`augment.order: authors`, fusionflow/policy/deepaa.py).

The whole image is decoded and goes through the draw's layers in order: an op drawn before the layer that crops
runs on the full image (a translation by a fraction of the full width, a rotation about the full image's centre,
AutoContrast and Equalize over the full image's histogram, the cutout in the full image's central 256 x 256 box);
each crop is the random resized crop of the image as it is then, resampled to the output size from its box; an
image no layer cropped is padded with black to the output size where smaller, then centre-cropped. Each op runs
FusionFlow's exact kernel (Pillow's, as the authors' PIL functions) in either decode mode: this order decodes the
whole image and runs ops at its resolution, so the window decoder and the fast kernels' savings do not apply.
"""

from __future__ import annotations

from PIL import Image

from fusionflow.ops import exact
from fusionflow.ops.decode import load_rgb, open_image
from fusionflow.policy.deepaa import CROP_OP, op_at
from fusionflow.policy.op_specs import NUM_PARAMS
from fusionflow.policy.sampling import layered_window

CUTOUT_BOX = 256  # the cutout's centre is uniform in the image's central box of this side (clipped to the image)


def authors_image(policy, data, d, what: str | None, style) -> Image.Image:
    """Draw `d`'s sample of encoded `data` in the authors' order, as an RGB image of the output size. `style(op)`:
    the exact kernels' Style for an OpDraw (the policy's interpolation and fill, the cutout's own fill)."""
    s, (out_h, out_w) = policy.augment.deepaa, policy.size
    img = load_rgb(open_image(data, what, policy.max_pixels), what)
    drawn, crops = iter(d.ops), iter(d.crops)
    resample = exact.RESAMPLE[policy.crop_interpolation]
    for step in d.steps:
        if step.op == CROP_OP:
            top, left, h, w = layered_window(policy, [next(crops)], img.height, img.width)
            img = img.resize((out_w, out_h), resample, box=(left, top, left + w, top + h))
            continue
        if step.op == "Identity" or (step.op == "RandFlip" and not step.negate):  # nothing drawn for it
            continue
        op = op_at(s, step, next(drawn).aux, img.height, img.width)
        params = _cutout(s.cutout_side, op.aux, img.height, img.width) if op.name == "Cutout" else None
        img = exact.apply(op.name, img, op.value, params or op.params(img.height, img.width), style(op))
    return img if img.size == (out_w, out_h) else _centre(img, out_h, out_w)


def _cutout(side: int, aux, height: int, width: int) -> tuple:
    """(top, left, h, w) of the search code's ImageNet cutout on a height x width image: centre (x, y) uniform in the
    central CUTOUT_BOX box, the square from int(x - side/2) to int(x + side/2) inclusive, clipped to the image."""
    half, box = side // 2, CUTOUT_BOX // 2
    x_lo, x_hi = max(0, width // 2 - box), min(width, width // 2 + box)
    y_lo, y_hi = max(0, height // 2 - box), min(height, height // 2 + box)
    x, y = x_lo + aux[0] * (x_hi - x_lo), y_lo + aux[1] * (y_hi - y_lo)
    x0, x1 = int(min(width, max(0, x - half))), int(min(width - 1, max(0, x + half)))
    y0, y1 = int(min(height, max(0, y - half))), int(min(height - 1, max(0, y + half)))
    return (y0, x0, y1 - y0 + 1, x1 - x0 + 1) + (0.0,) * (NUM_PARAMS - 4)


def _centre(img: Image.Image, out_h: int, out_w: int) -> Image.Image:
    """An uncropped image's end: padded with black to the output size where smaller (centred), then the centre
    output-size crop (offsets rounded, as torchvision's CenterCrop)."""
    w, h = img.size
    if w < out_w or h < out_h:
        canvas = Image.new("RGB", (max(w, out_w), max(h, out_h)))
        canvas.paste(img, ((canvas.width - w) // 2, (canvas.height - h) // 2))
        img, (w, h) = canvas, canvas.size
    top, left = int(round((h - out_h) / 2.0)), int(round((w - out_w) / 2.0))
    return img.crop((left, top, left + out_w, top + out_h))
