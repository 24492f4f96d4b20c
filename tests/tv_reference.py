"""torchvision as the independent reference: its own op dispatch on PIL images, and its pipeline."""

import math
from unittest import mock

import numpy as np
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as F
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode

_MODES = {
    "nearest": InterpolationMode.NEAREST,
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
}


def tv_cutout(img: Image.Image, side: float, aux, fill):
    """Cutout by its definition: a side x side square centred on the pixel (aux * size), clipped."""
    side = int(side)
    w, h = img.size
    cx, cy = int(aux[0] * w), int(aux[1] * h)
    x0, y0 = max(0, cx - side // 2), max(0, cy - side // 2)
    x1, y1 = min(w, cx - side // 2 + side), min(h, cy - side // 2 + side)
    t = F.pil_to_tensor(img)
    if x1 > x0 and y1 > y0:
        t = F.erase(t, y0, x0, y1 - y0, x1 - x0, torch.tensor(fill, dtype=torch.uint8).view(3, 1, 1))
    return F.to_pil_image(t)


def tv_op(name: str, img: Image.Image, value: float, fill=(0, 0, 0), interpolation="nearest", aux=(0.5, 0.5)):
    """Apply op `name` at `value` (FusionFlow's unit) through torchvision's own op dispatch."""
    if name == "SolarizeAdd":  # no torchvision op: the definition, on a tensor
        t = F.pil_to_tensor(img).to(torch.int16)
        t = torch.where(t < 128, (t + int(value)).clamp(max=255), t)
        return F.to_pil_image(t.to(torch.uint8))
    if name == "Posterize" and int(value) == 0:  # Pillow refuses 0 bits; torchvision's tensor op takes it
        return F.to_pil_image(F.posterize(F.pil_to_tensor(img), 0))
    if name == "Cutout":
        return tv_cutout(img, value, aux, fill)
    if name == "FlipX":
        return F.horizontal_flip(img)
    if name == "Hue":  # ColorJitter's hue; RandAugment has none
        return F.adjust_hue(img, value)
    if name in ("ShiftX", "ShiftY"):  # a fractional translation: torchvision's affine takes float offsets
        shift = [value, 0.0] if name == "ShiftX" else [0.0, value]
        return F.affine(img, 0.0, shift, 1.0, [0.0, 0.0], _MODES[interpolation], list(fill))
    if name in ("SkewX", "SkewY"):  # a shear factor: torchvision's affine about the top-left corner
        shear = math.degrees(math.atan(value))
        shear = [shear, 0.0] if name == "SkewX" else [0.0, shear]
        return F.affine(img, 0.0, [0, 0], 1.0, shear, _MODES[interpolation], list(fill), center=[0, 0])
    aug = T.RandAugment(interpolation=_MODES[interpolation], fill=list(fill))
    magnitude = value / 255.0 if name == "Solarize" else value  # torchvision: threshold = 255 * m
    return aug._apply_image_or_video_transform(img, name, magnitude, interpolation=aug.interpolation, fill=aug._fill)


def _tv_color(policy, img, d):
    """ColorJitter in the draw's order, then RandomGrayscale: torchvision's functional ops."""
    if getattr(policy, "jitter", None) is not None:
        img = tv_color_jitter(policy.jitter, img, d)
    if getattr(d, "grayscale", False):
        img = F.rgb_to_grayscale(img, num_output_channels=3)
    return img


def tv_sample(policy, data: bytes, d, crop) -> np.ndarray:
    """torchvision's path for one drawn sample: decode, resized_crop, flip, ops -> uint8 CHW."""
    import io

    img = Image.open(io.BytesIO(data)).convert("RGB")
    top, left, h, w = crop
    mode = _MODES[getattr(policy, "crop_interpolation", "bilinear")]
    img = F.resized_crop(img, top, left, h, w, list(policy.size), mode, antialias=True)
    if d.flip:
        img = F.horizontal_flip(img)
    if getattr(d, "vflip", False):
        img = F.vertical_flip(img)
    after = getattr(policy, "color_after_augment", False)
    img = img if after else _tv_color(policy, img, d)
    aug = policy.augment
    for op in d.ops:
        img = tv_op(op.name, img, op.value, op.fill or aug.fill, aug.interpolation, op.aux)
    img = _tv_color(policy, img, d) if after else img
    if aug.type == "augmix":
        img = Image.fromarray(tv_augmix(augmix_transform(aug), img, d))
    return np.asarray(img).transpose(2, 0, 1)


def tv_color_jitter(jitter, img: Image.Image, d) -> Image.Image:
    """torchvision's ColorJitter with the policy's ranges on `img`, FusionFlow's draw injected as its
    make_params (the order and the factors); RandomApply's miss (no adjustments drawn) leaves img."""
    if not d.jitter:
        return img
    t = T.ColorJitter(*(None if r is None else list(r) for r in jitter.ranges))
    names = ("Brightness", "Contrast", "Color", "Hue")
    drawn = {op.name: op.value for op in d.jitter}
    order = [names.index(op.name) for op in d.jitter] + [k for k, n in enumerate(names) if n not in drawn]
    factor = lambda n: None if n not in drawn else drawn[n] if n == "Hue" else 1.0 + drawn[n]  # noqa: E731
    params = dict(
        fn_idx=torch.tensor(order),
        brightness_factor=factor("Brightness"),
        contrast_factor=factor("Contrast"),
        saturation_factor=factor("Color"),
        hue_factor=factor("Hue"),
    )
    with mock.patch.object(t, "make_params", lambda flat_inputs: params):
        return t(img)


def augmix_transform(aug):
    """torchvision's AugMix (v1, the recipe's) with a policy's augmix settings."""
    import torchvision.transforms as T1

    s = aug.augmix
    fill = None if s.fill is None else list(s.fill)
    mode = T1.InterpolationMode(aug.interpolation)
    return T1.AugMix(s.severity, s.mixture_width, s.chain_depth, s.alpha, s.all_ops, mode, fill)


def tv_augmix(t, img: Image.Image, d) -> np.ndarray:
    """torchvision's AugMix `t` on `img` with FusionFlow's draw `d` injected: its two Dirichlet samples and,
    in its call order, every randint (chain depth, op index, magnitude bin, sign)."""
    space = t._augmentation_space(t._PARAMETER_MAX, (img.height, img.width))
    names = list(space)
    ints = []
    for k, chain in enumerate(d.mix.chains):
        if t.chain_depth <= 0:
            ints.append(len(chain))
        for step in (s for s in d.steps if s.group == k):
            ints.append(names.index(step.op))
            magnitudes, signed = space[step.op]
            if magnitudes.ndim > 0:
                ints.append(int(step.level))
            if signed:
                ints.append(int(step.negate))
    answers = iter(ints)
    dirichlet = iter([torch.tensor([[d.mix.m, d.mix.m_mix]]), torch.tensor([list(d.mix.weights)])])
    with (
        mock.patch.object(t, "_sample_dirichlet", lambda params: next(dirichlet)),
        mock.patch("torch.randint", lambda *a, **k: torch.tensor([next(answers)])),
    ):
        out = np.asarray(t(img))
    assert next(answers, None) is None, "torchvision asked for fewer draws than FusionFlow made"
    return out


def tv_recipe(policy, data: bytes, d) -> np.ndarray:
    """torchvision's whole recipe on draw `d`: the pipeline (tv_sample), then ToDtype(scale) + Normalize
    when the policy normalises, then F.erase with the draw's rectangle and fill."""
    import io

    from fusionflow.policy import crop_window

    W, H = Image.open(io.BytesIO(data)).size
    t = torch.from_numpy(tv_sample(policy, data, d, crop_window(policy, d, H, W)).copy())
    if policy.normalize:
        t = F.normalize(F.to_dtype(t, torch.float32, scale=True), list(policy.normalize[0]), list(policy.normalize[1]))
    if d.erase is not None:
        e = d.erase
        t = F.erase(t, e.top, e.left, e.height, e.width, torch.from_numpy(e.fill(policy.erase)))
    return t.numpy()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)
