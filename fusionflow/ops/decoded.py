"""Samples that come decoded (a uint8 numpy array or torch tensor, a PIL image of any mode) as the RGB
Pillow images the pipeline starts from.

Layout of a 3-d tensor (torchvision's decoders give CHW): CHW when its first dimension is 1, 3 or 4
channels, else HWC when its last is; so a 3x3x4 tensor is CHW, and an HWC tensor only 1, 3 or 4
pixels tall must be permuted to CHW (or passed as a numpy array, which is always HWC, as
np.asarray(pil_image) gives). A tensor gives the same pixels as the equivalent array. Grayscale,
palette, RGBA/LA (alpha dropped) and 16-bit inputs come out as 8-bit RGB (`to_rgb`).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

CHANNELS = (1, 3, 4)
# a 1-D uint8 tensor or array is most often a file's encoded bytes (torchvision.io.read_file gives one)
ENCODED_HINT = "; if it holds an encoded file (torchvision.io.read_file), return its bytes: bytes(x.numpy())"
# a float sample is most often one the dataset's own transform made (ToTensor, Normalize)
TRANSFORMED_HINT = (
    "; an already-transformed sample? FusionFlow decodes and augments the raw images itself: give it them "
    "(fusionflow.ImageFolder, or the dataset without its transform: transform=None) and a policy"
)


def _hint(dtype, ndim: int, floating: bool) -> str:
    return TRANSFORMED_HINT if floating else ENCODED_HINT if ndim == 1 and dtype in (torch.uint8, np.uint8) else ""


def tensor_to_hwc(t: torch.Tensor, what) -> np.ndarray:
    """A uint8 CPU tensor (HW, CHW or HWC; see the module docstring for the 3-d rule) as an HW/HWC array."""
    shape = tuple(t.shape)
    if (
        t.dtype != torch.uint8
        or t.ndim not in (2, 3)
        or (t.ndim == 3 and shape[0] not in CHANNELS and shape[2] not in CHANNELS)
    ):
        raise TypeError(
            f"{what or 'sample'}: a tensor sample must be uint8 HW, CHW or HWC with 1, 3 or 4 "
            f"channels, got {t.dtype} {shape}" + _hint(t.dtype, t.ndim, t.is_floating_point())
        )
    if t.device.type != "cpu":
        raise TypeError(
            f"{what or 'sample'}: a tensor sample must be on the CPU, got one on {t.device}; "
            "return it before moving it (workers write into host shared memory)"
        )
    if t.ndim == 3 and shape[0] in CHANNELS:
        t = t.permute(1, 2, 0)  # CHW -> HWC (a view; _from_array makes it contiguous)
    return not_empty(t.numpy(), what)


def not_empty(arr: np.ndarray, what) -> np.ndarray:
    """`arr` (HW or HWC), refused when it has no pixels: the crop's window would divide by its size."""
    if 0 in arr.shape[:2]:
        raise ValueError(f"{what or 'sample'}: an empty image ({arr.shape[0]}x{arr.shape[1]} pixels)")
    return arr


def from_array(arr: np.ndarray, what) -> Image.Image:
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
        raise TypeError(
            f"{what or 'sample'}: an array sample must be uint8 HW or HWC with 1, 3 or 4 "
            f"channels, got {arr.dtype} {arr.shape}" + _hint(arr.dtype, arr.ndim, np.issubdtype(arr.dtype, np.floating))
        )
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(not_empty(arr, what)))


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` as 8-bit RGB. 16-bit images -- PNG/TIFF's I;16, and a 16-bit PGM/PPM, which Pillow opens as 32-bit "I" --
    keep their high byte (>> 8): Pillow's own convert("RGB"), which torchvision's ImageFolder loader calls, clips them
    at 255, nearly all white (so here, and only here, decode.mode exact differs from torchvision); other "I" images
    are clipped as Pillow clips them. Palette transparency goes through RGBA, as Pillow advises."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PPM"):
        return Image.fromarray((np.asarray(img) >> 8).astype(np.uint8)).convert("RGB")
    if img.mode == "I":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8)).convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return img.convert("RGB")
