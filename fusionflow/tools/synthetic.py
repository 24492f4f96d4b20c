"""Deterministic synthetic photographs-ish images, for the demo, the benchmarks and the tests.

Smooth gradients, overlapping shapes and sensor-like noise: enough structure that JPEG sizes vary
like real photos and that histogram and geometric ops have visible work to do.
"""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def make_image(height: int, width: int, seed: int) -> np.ndarray:
    """A uint8 HxWx3 image that is a pure function of (height, width, seed)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 6.28)
        base[..., c] = 110 + 70 * np.sin(fx * 6.28 * x / width + ph) * np.cos(fy * 6.28 * y / height)
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, x1 = sorted(rng.integers(0, width, 2).tolist())
        y0, y1 = sorted(rng.integers(0, height, 2).tolist())
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1 + 1, y1 + 1), fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    return arr.clip(0, 255).astype(np.uint8)


def encode(arr: np.ndarray, fmt: str = "JPEG", quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_jpegs(count: int, min_side: int = 200, max_side: int = 1000, seed: int = 0) -> list[bytes]:
    """`count` JPEGs whose sides are drawn uniformly from [min_side, max_side]."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        h, w = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
        out.append(encode(make_image(h, w, seed * 1_000_003 + i)))
    return out


def make_imagenet_like_jpegs(count: int, seed: int = 11) -> list[bytes]:
    """`count` JPEGs shaped like ImageNet's typical photo: 500x375 and 375x500 alternating, each side
    jittered by up to 10%."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        long, short = (int(round(v * rng.uniform(0.9, 1.1))) for v in (500, 375))
        h, w = (short, long) if i % 2 == 0 else (long, short)
        out.append(encode(make_image(h, w, seed * 1_000_000 + 3 + i)))
    return out


def sample_set(sizes: str, count: int, seed: int = 11) -> list[bytes]:
    """The benchmarks' image sets: "imagenet", or "lo-hi" (sides uniform in lo..hi px)."""
    if sizes == "imagenet":
        return make_imagenet_like_jpegs(count, seed)
    lo, hi = (int(v) for v in sizes.split("-"))
    return make_jpegs(count, lo, hi, seed=seed)


class EncodedImages:
    """An in-memory dataset of encoded images: (bytes, label), with the encoded sizes FusionFlow sorts
    tiny-batches by, as ImageFolder gives them. It carries its bytes, so it pickles to any worker or
    node. Labels cycle through `classes`."""

    def __init__(self, data: list[bytes], classes: int = 10):
        self.data, self.classes = data, classes
        self.sizes = [len(d) for d in data]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i % self.classes

    def __getitems__(self, indices):
        """PyTorch's batched read (DataLoader's fetcher and the DALI accelerator use it); a subclass that
        reads its own way (`__getitem__` overridden) is read through it."""
        if type(self).__getitem__ is not EncodedImages.__getitem__:
            return [self[i] for i in indices]
        return [(self.data[i], i % self.classes) for i in indices]

    def describe(self, i):
        return f"synthetic image {i}"


def make_image_folder(
    root: str, num_classes: int = 4, per_class: int = 64, min_side: int = 200, max_side: int = 1000, seed: int = 0
) -> str:
    """Write an ImageFolder tree (root/class_k/img_i.jpg) of mixed-size JPEGs; returns root.
    Existing files are kept, so a second call is free."""
    rng = np.random.default_rng(seed)
    for c in range(num_classes):
        d = os.path.join(root, f"class_{c}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
            path = os.path.join(d, f"img_{i:05d}.jpg")
            if not os.path.exists(path):
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(encode(make_image(h, w, seed * 1_000_003 + c * 100_003 + i)))
                os.replace(tmp, path)
    return root


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height 1-bit grey pixels, with one tiny compressed row:
    a few hundred bytes that a decoder without a pixel limit would expand to width x height bytes.
    For tests of decode.max_pixels; nothing here allocates the image."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64, 9)) + chunk(b"IEND", b"")
    )
