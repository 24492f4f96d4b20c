"""ImageFolder: a folder of images as raw encoded samples (no decoding) with each sample's byte size.

Decoding and augmentation belong to the pipeline (CPU worker or DALI), so a dataset only reads
bytes. `sizes` lets the loader sort tiny-batches by encoded size without reading any file.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class ImageFolder:
    """``root/<class>/<image>`` -> (encoded bytes, class index), classes sorted by name.

    A class folder's images are found at any depth, in torchvision's ImageFolder order (directories by path,
    sorted; each one's files by name; linked directories followed), so both give the same samples.
    ``sizes[i]`` is sample i's file size in bytes (from the directory scan, not from reading it);
    ``describe(i)`` names it (its path) for error messages.
    """

    def __init__(self, root: str, extensions: tuple[str, ...] = IMAGE_EXTENSIONS):
        if not os.path.isdir(root):
            raise ValueError(f"ImageFolder root {root!r} is not a directory")
        self.root, self._base = root, _cwd()  # paths stay as given; read from here in any process (`_file`)
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise ValueError(f"ImageFolder root {root!r} has no class sub-directories (expected root/<class>/<image>)")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.paths: list[str] = []
        self.targets: list[int] = []
        self.sizes: list[int] = []
        stats = []  # what the files held at the scan: `fingerprint`
        exts, left_out = tuple(e.lower() for e in extensions), []
        for c in self.classes:
            for path, st in _images_under(os.path.join(root, c), exts, left_out):
                stats.append(st)
                self.paths.append(path)
                self.targets.append(self.class_to_idx[c])
                self.sizes.append(st.st_size)
        if not self.paths:
            raise ValueError(f"ImageFolder root {root!r} holds no files ending in {', '.join(exts)}")
        have = set(self.targets)
        _warn_left_out(root, left_out, [c for c, i in self.class_to_idx.items() if i not in have])
        if looks_like_splits(self.classes):  # nested images count (as torchvision's): say what this most likely is
            warnings.warn(
                f"ImageFolder root {root!r} has the classes {self.classes}: they look like a dataset's splits "
                f"(each one class here); pass a split's own folder, e.g. {os.path.join(root, self.classes[0])!r}",
                UserWarning,
                stacklevel=2,
            )
        self._content = _content_of(stats, self.targets)

    @classmethod
    def of_samples(cls, root: str, samples, classes) -> ImageFolder:
        """The reader of a list of (path, class index), e.g. torchvision's `ImageFolder.samples`, in its order."""
        self, samples = cls.__new__(cls), list(samples)  # (an iterator is read once)
        self.root, self.classes, self._base = root, list(classes), _cwd()
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.paths = [os.fspath(p) for p, _ in samples]
        self.targets = [int(t) for _, t in samples]
        stats = [_stat_or_gone(p) for p in self.paths]  # one that cannot be read fails at its read, as torchvision's
        self.sizes = [st.st_size for st in stats]
        self._content = _content_of(stats, self.targets)
        return self

    def fingerprint(self) -> str:
        """What identifies these samples across processes (the decoded-image cache's key): every file (its device and
        inode, not its path's spelling), size, modification time and class, as scanned. A file rewritten since, even
        at the same length, makes another."""
        content = getattr(self, "_content", None)  # (a subclass that skipped the scan: its files read now)
        if content is None:
            files = [self._file(i) for i in range(len(self.paths))]
            content = _content_of([os.stat(p) for p in files], self.targets)
        return f"{len(self.paths)}:{content}"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        with open(self._file(index), "rb") as f:
            return f.read(), self.targets[index]

    def _file(self, index: int) -> str:
        """Sample `index`'s file, a relative path taken from the directory the dataset was made in: a worker lent by
        another process (its own working directory) reads the same files."""
        return os.path.join(getattr(self, "_base", ""), self.paths[index])

    def describe(self, index: int) -> str:
        return self.paths[index]


def _cwd() -> str:
    """The working directory, or "" where it was removed (absolute paths still read; relative ones cannot)."""
    try:
        return os.getcwd()
    except OSError:
        return ""


MISSING = os.stat_result((0,) * 10)  # a listed file that cannot be stat'ed: size 0, no identity


def _stat_or_gone(path) -> os.stat_result:
    """os.stat(path), or MISSING where it fails (a dangling link, a file removed since the list was made): the
    sample then fails when it is read, where on_error applies, not the loader's construction."""
    try:
        return os.stat(path)
    except OSError:
        return MISSING


def _content_of(stats, targets) -> str:
    """A digest of every file's identity (device and inode: one file however its path is spelled -- relative,
    absolute, through a symlink -- and another directory's files are other files), size, modification time and
    class, in the samples' order."""
    lines = [
        f"{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{target}\n" for st, target in zip(stats, targets)
    ]
    return hashlib.sha256("".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


SPLIT_NAMES = {"train", "training", "val", "valid", "validation", "test", "testing", "eval"}


def looks_like_splits(classes) -> bool:
    """Whether the class folders are named as a dataset's splits (train/, val/): images found under them at any
    depth would make each split one class."""
    return bool(classes) and {c.lower() for c in classes} <= SPLIT_NAMES


def _warn_left_out(root: str, left_out: list, empty: list) -> None:
    """Say what torchvision's ImageFolder would have listed or refused: files that cannot be read (dangling links:
    torchvision lists them, so its indices differ from these) and classes without an image (torchvision raises)."""
    if left_out:
        warnings.warn(
            f"ImageFolder {root!r}: {len(left_out)} file(s) cannot be read and are left out (e.g. {left_out[0]!r}: a "
            "dangling link?); torchvision's ImageFolder lists them, so sample indices differ from its",
            UserWarning,
            stacklevel=3,
        )
    if empty:
        warnings.warn(
            f"ImageFolder {root!r}: class folder(s) {empty[:5]} hold no image (torchvision's ImageFolder refuses "
            "this); their class indices are kept, with no samples",
            UserWarning,
            stacklevel=3,
        )


def _images_under(folder: str, exts: tuple[str, ...], left_out: list | None = None):
    """(path, stat) of each regular file (or link to one) ending in `exts` under `folder`, at any depth, in the
    order torchvision's ImageFolder lists them: sorted(os.walk(folder, followlinks=True)), each directory's files
    sorted by name. A dangling link is left out (there is nothing to read; its path goes to `left_out`), and so is
    a linked directory met before (a link to an ancestor would list the same images again down to the system's
    link limit)."""
    seen, found = {os.path.realpath(folder)}, []
    for where, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()  # which of two links to one directory is kept: the first by name
        real = [os.path.realpath(os.path.join(where, d)) for d in dirs]
        dirs[:] = [d for d, r in zip(dirs, real) if r not in seen]
        seen.update(real)
        found.append((where, dirs, names))
    for where, _dirs, names in sorted(found):
        for name in sorted(names):
            if not name.lower().endswith(exts):
                continue
            path = os.path.join(where, name)
            try:
                st = os.stat(path)
            except OSError:
                if left_out is not None:
                    left_out.append(path)
                continue
            if stat.S_ISREG(st.st_mode):
                yield path, st
