"""torchvision's AugMix chains in exact mode: each op through torchvision's functional op on a uint8 CHW
tensor, called as torchvision's AugMix calls it.

torchvision's AugMix converts even a PIL image to a tensor before its chains, so its pixels are the
tensor backend's (grid_sample for the geometric ops, float blends for the colour ops), not Pillow's
that every other torchvision policy here follows. Exact mode therefore runs those very ops; fast mode
runs FusionFlow's own kernels (Pillow semantics, fusionflow/ops/fast.py) within the tolerance
measured in tests/test_augmix.py. torchvision is needed for exact AugMix only.
"""

from __future__ import annotations

import math

import numpy as np


def available() -> str | None:
    """None when exact AugMix can run here, else why not."""
    try:
        import torchvision.transforms.functional  # noqa: F401
    except ImportError as exc:
        return f"decode.mode exact with augment.type augmix runs torchvision's own tensor ops: {exc}"
    return None


def chain(base_chw: np.ndarray, ops, interpolation: str, fill) -> np.ndarray:
    """`base_chw` (uint8 CHW) after the ops of one chain, as a new uint8 CHW array."""
    import torch
    from torchvision.transforms import InterpolationMode

    mode = InterpolationMode(interpolation)
    fill = None if fill is None else [float(v) for v in fill]
    img = torch.from_numpy(base_chw)
    for op in ops:
        img = _apply(img, op.name, op.value, mode, fill)
    return img.numpy()


def _apply(img, name: str, v: float, mode, fill):
    import torchvision.transforms.functional as F

    if name in ("ShearX", "ShearY", "TranslateX", "TranslateY"):
        shear = math.degrees(math.atan(v))
        shear_xy = {"ShearX": [shear, 0.0], "ShearY": [0.0, shear]}.get(name, [0.0, 0.0])
        translate = {"TranslateX": [int(v), 0], "TranslateY": [0, int(v)]}.get(name, [0, 0])
        center = [0, 0] if name.startswith("Shear") else None
        return F.affine(img, 0.0, translate, 1.0, shear_xy, interpolation=mode, fill=fill, center=center)
    if name == "Rotate":
        return F.rotate(img, v, interpolation=mode, fill=fill)
    colour = {
        "Brightness": F.adjust_brightness,
        "Color": F.adjust_saturation,
        "Contrast": F.adjust_contrast,
        "Sharpness": F.adjust_sharpness,
    }
    if name in colour:
        return colour[name](img, 1.0 + v)
    if name == "Posterize":
        return F.posterize(img, int(v))
    if name == "Solarize":
        return F.solarize(img, v)
    if name == "AutoContrast":
        return F.autocontrast(img)
    if name == "Equalize":
        return F.equalize(img)
    raise ValueError(f"op {name!r} is not one of torchvision's AugMix ops")
