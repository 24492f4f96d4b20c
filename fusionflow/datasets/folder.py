"""ImageFolder: a folder of images as raw encoded samples (no decoding) with each sample's byte size.

Decoding and augmentation belong to the pipeline (CPU worker or DALI), so a dataset only reads
bytes. `sizes` lets the loader sort tiny-batches by encoded size without reading any file.
"""

from __future__ import annotations

import os

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class ImageFolder:
    """``root/<class>/<image>`` -> (encoded bytes, class index), classes sorted by name.

    ``sizes[i]`` is sample i's file size in bytes (from the directory scan, not from reading it);
    ``describe(i)`` names it (its path) for error messages.
    """

    def __init__(self, root: str, extensions: tuple[str, ...] = IMAGE_EXTENSIONS):
        if not os.path.isdir(root):
            raise ValueError(f"ImageFolder root {root!r} is not a directory")
        self.root = root
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise ValueError(f"ImageFolder root {root!r} has no class sub-directories (expected root/<class>/<image>)")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.paths: list[str] = []
        self.targets: list[int] = []
        self.sizes: list[int] = []
        exts = tuple(e.lower() for e in extensions)
        for c in self.classes:
            entries = sorted(
                (e for e in os.scandir(os.path.join(root, c)) if e.is_file() and e.name.lower().endswith(exts)),
                key=lambda e: e.name,
            )
            for e in entries:
                self.paths.append(e.path)
                self.targets.append(self.class_to_idx[c])
                self.sizes.append(e.stat().st_size)
        if not self.paths:
            raise ValueError(f"ImageFolder root {root!r} holds no files ending in {', '.join(exts)}")

    @classmethod
    def of_samples(cls, root: str, samples, classes) -> ImageFolder:
        """The reader of a list of (path, class index), e.g. torchvision's `ImageFolder.samples`, in its order."""
        self = cls.__new__(cls)
        self.root, self.classes = root, list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.paths = [os.fspath(p) for p, _ in samples]
        self.targets = [int(t) for _, t in samples]
        self.sizes = [os.stat(p).st_size for p in self.paths]
        return self

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        with open(self.paths[index], "rb") as f:
            return f.read(), self.targets[index]

    def describe(self, index: int) -> str:
        return self.paths[index]
