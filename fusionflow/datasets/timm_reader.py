"""A timm `ImageDataset` read as FusionFlow reads datasets: encoded bytes and targets, no decoding.

timm's dataset opens each file and decodes it to a PIL image (then applies its transform); FusionFlow
decodes itself, so `timm_samples(dataset)` reads the same samples through the dataset's reader: a
folder reader (timm's `ReaderImageFolder`: its `samples` list) becomes FusionFlow's ImageFolder of the
same files in the same order (sizes from the directory scan, for the size-sorted tiny-batches); any
other reader is read item by item (`TimmSamples`: a file object's bytes, or the image it gives). The
dataset's `target_transform` applies, and a missing target is -1, as timm's dataset has it. timm's
dataset skips an unreadable file by reading the next index; FusionFlow reports it (`on_error`).
A dataset without a reader (timm's `torch/...` datasets: torchvision's ImageFolder, CIFAR10, ...), or one whose
class reads its own way (a `__getitem__` of its own), is read through its own items (`torch_samples`)."""

from __future__ import annotations

import os


def timm_samples(dataset):
    """`dataset` (timm's ImageDataset) as raw samples; the refusals name what to change."""
    if getattr(dataset, "additional_features", None):
        raise ValueError(
            "dataset: a timm ImageDataset with additional_features: FusionFlow delivers (image, target) "
            "pairs; leave additional_features unset"
        )
    mode = getattr(dataset, "input_img_mode", "RGB")
    if mode not in ("RGB", None):
        raise ValueError(
            f"dataset: input_img_mode={mode!r}: FusionFlow delivers 3-channel RGB images (input_img_mode='RGB')"
        )
    reader = getattr(dataset, "reader", None)
    if reader is None or _reads_its_own_way(dataset):
        return torch_samples(dataset)
    if type(reader).__name__ == "ReaderImageFolder" and dataset.target_transform is None:
        from fusionflow.datasets.folder import ImageFolder

        classes = sorted(reader.class_to_idx, key=reader.class_to_idx.get)
        return ImageFolder.of_samples(reader.root, reader.samples, classes)
    return TimmSamples(reader, dataset.target_transform)


def _reads_its_own_way(dataset) -> bool:
    """A subclass of timm's ImageDataset with a __getitem__ of its own (remapped targets, a filter): read item by
    item, as timm's loader reads it, not through the reader its own reads go around."""
    try:
        from timm.data.dataset import ImageDataset
    except ImportError:
        return False
    return isinstance(dataset, ImageDataset) and type(dataset).__getitem__ is not ImageDataset.__getitem__


def torch_samples(dataset):
    """A map-style dataset with no timm reader, as create_dataset("torch/...") makes them: a torchvision
    DatasetFolder of files read with torchvision's default loader becomes FusionFlow's ImageFolder of the same
    files; any other (CIFAR10, FakeData: PIL images in memory) is read item by item as it is, its images
    decoded from there. Its transform must be None: timm's create_loader sets it from its arguments, and
    FusionFlow makes its policy from those same arguments instead."""
    name = type(dataset).__name__
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError(f"dataset: a {name} is not a map-style dataset (timm's ImageDataset or a torchvision one)")
    if getattr(dataset, "transform", None) is not None:
        raise ValueError(
            f"dataset: a {name} with a transform: create_loader makes the augmentation from its own arguments "
            "(timm's overwrites the dataset's transform with them); leave its transform None"
        )
    try:
        from torchvision.datasets import DatasetFolder
        from torchvision.datasets.folder import default_loader, pil_loader
    except ImportError:
        return dataset
    files = isinstance(dataset, DatasetFolder) and dataset.loader in (default_loader, pil_loader)
    files = files and type(dataset).__getitem__ is DatasetFolder.__getitem__  # else its own reads
    if files and dataset.target_transform is None:
        from fusionflow.datasets.folder import ImageFolder

        return ImageFolder.of_samples(dataset.root, dataset.samples, dataset.classes)
    return dataset


class TimmSamples:
    """A timm reader's items as (encoded bytes or image, target)."""

    def __init__(self, reader, target_transform=None):
        self.reader, self.target_transform = reader, target_transform

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int):
        image, target, *_ = self.reader[index]
        if hasattr(image, "read"):
            with image:
                image = image.read()
        elif isinstance(image, (str, os.PathLike)):
            with open(image, "rb") as f:
                image = f.read()
        if target is None:
            target = -1
        elif self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def describe(self, index: int) -> str:
        try:
            return str(self.reader.filename(index, absolute=True))
        except Exception:  # a reader without file names
            return f"sample {index}"
