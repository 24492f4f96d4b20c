"""The dataset as FusionFlowLoader reads it, resolved at construction: a map-style dataset (a stream
is refused, saying what to use), its dict samples seen through `sample_keys`
(fusionflow.datasets.wrappers.DictSamples), its reads started ahead with `read_ahead`
(fusionflow.datasets.wrappers.ReadAhead),
and, with num_workers=0, a look at dataset[0] (already-transformed samples and dicts without sample_keys are
refused; with workers, the workers' first reads refuse them).
A torchvision ImageFolder given without `policy=` is adopted (`adopt_folder`): its files, and its
transform as the policy."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

log = logging.getLogger("fusionflow.loader")


def adopt_folder(dataset, policy):
    """(dataset, policy) as the loader uses them: a torchvision ImageFolder / DatasetFolder with a
    transform and no `policy=` (in a Subset too) becomes FusionFlow's reader of the same files (same order
    and targets) with `policy_from_transform(dataset.transform)`, said in one warning -- so replacing
    DataLoader by FusionFlowLoader is the whole change. A folder's transform that FusionFlow would run
    before its own policy (one that resizes, crops or augments: augmenting twice) is refused beside `policy=` or in
    a ConcatDataset, as is a subclass with its own __getitem__ to adopt. Anything else passes through."""
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:
        return dataset, policy
    folder, subsets = dataset, []
    while isinstance(folder, torch.utils.data.Subset):
        subsets.append(folder.indices)
        folder = folder.dataset
    if not isinstance(folder, DatasetFolder) or folder.transform is None:
        _refuse_transformed_parts(dataset, DatasetFolder)
        return dataset, policy
    name = type(folder).__name__
    if policy is not None:
        if _augments(folder.transform):
            raise ValueError(
                f"dataset: a torchvision {name} with a transform, and policy=: its transform would run before the "
                "policy (augmenting twice). Set the dataset's transform=None (FusionFlow reads its files), or leave "
                "out policy= to use the transform as the policy"
            )
        return dataset, policy  # a conversion of the script's own (to RGB, say): read through it, as before
    picked = None  # a Subset's folder indices (nested ones composed): the same files, with their sizes and paths
    for indices in subsets:
        picked = list(indices) if picked is None else [indices[i] for i in picked]
    return _adopted(folder, name, DatasetFolder, picked)


def _adopted(folder, name: str, DatasetFolder, picked=None):
    """(FusionFlow's ImageFolder of `folder`'s files -- those at `picked`, if given --, the policy of its
    transform), or ValueError saying why not."""
    from torchvision.datasets.folder import default_loader, pil_loader

    if type(folder).__getitem__ is not DatasetFolder.__getitem__:
        raise ValueError(
            f"dataset: a torchvision {name} with its own __getitem__ and a transform: FusionFlow reads the files "
            "itself and would not run your __getitem__; set its transform=None and pass policy= (FusionFlow then "
            "augments what __getitem__ returns), or pass fusionflow.ImageFolder(root) and policy="
        )
    if folder.target_transform is not None:
        raise ValueError(
            f"dataset: a torchvision {name} with a target_transform: FusionFlow reads the files itself and "
            "delivers class indices; apply the target transform in collate_fn, or pass fusionflow.ImageFolder(root) "
            "and policy="
        )
    if folder.loader not in (default_loader, pil_loader):
        raise ValueError(
            f"dataset: a torchvision {name} with its own loader {folder.loader!r}: FusionFlow decodes the files "
            "itself; pass fusionflow.ImageFolder(root) and policy="
        )
    from fusionflow.datasets.folder import ImageFolder
    from fusionflow.policy.from_torchvision import policy_from_transform

    adopted = policy_from_transform(folder.transform)  # raises, naming the transform, when not expressible
    samples = folder.samples if picked is None else [folder.samples[int(i)] for i in picked]
    warnings.warn(  # visible in a script that never configures logging; Python shows it once per call site
        f"fusionflow: reading the {len(samples)} files of torchvision {name} {folder.root!r} itself, "
        f"augmenting with its transform (policy_from_transform: output {'x'.join(map(str, adopted.size))}, "
        f"augment {adopted.augment.type}); pass policy= to choose the augmentation yourself",
        UserWarning,
        stacklevel=4,
    )
    return ImageFolder.of_samples(folder.root, samples, folder.classes), adopted


def folder_transforms(dataset) -> tuple:
    """(transform, target_transform) of the torchvision folder `dataset` is (in Subsets too)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return getattr(dataset, "transform", None), getattr(dataset, "target_transform", None)


class AdoptedTransform:
    """The transforms of the torchvision folder the loader adopted (`adopt_folder`), watched at each iter(): the
    loader runs the policy it read at construction and delivers the class indices, so a transform set later
    (`loader.dataset.transform = ...`, progressive resizing) that reads as another policy, or a target_transform
    set later, is refused, not silently ignored."""

    def __init__(self, given, policy):
        self.given, self.policy, self.transforms = given, policy, folder_transforms(given)

    def check(self) -> None:
        now = folder_transforms(self.given)
        if now[0] is self.transforms[0] and now[1] is self.transforms[1]:
            return
        if now[1] is not self.transforms[1]:
            raise ValueError(
                "loader.dataset.target_transform was set after the loader was built: FusionFlow reads the folder's "
                "files itself and delivers their class indices; apply it in collate_fn, or build a new loader"
            )
        from fusionflow.policy.from_torchvision import policy_from_transform

        try:
            same = now[0] is not None and policy_from_transform(now[0]) == self.policy
        except Exception:  # not expressible: not the adopted policy
            same = False
        if not same:
            raise ValueError(
                "loader.dataset.transform changed since the loader was built (to "
                f"{'None' if now[0] is None else 'another ' + type(now[0]).__name__}): FusionFlow read the folder's "
                "transform once, as its policy (policy_from_transform), and its workers run that. Build a new "
                "FusionFlowLoader for the new transform (progressive resizing: one loader per size), or put it back"
            )
        self.transforms = now  # the same policy: a transform made again


_CONVERSIONS = {"PILToTensor", "ToImage", "ToTensor", "ToDtype", "ConvertImageDtype", "Normalize", "ToPureTensor"}
_CONVERSIONS |= {"Grayscale", "Lambda"}  # (a float output is refused at its first sample: check_raw_samples)


def _augments(transform) -> bool:
    """Whether a dataset's transform holds a torchvision or timm transform that resizes, crops or augments: run
    before FusionFlow's policy, its samples would be cropped or augmented twice. Conversions, and callables of the
    script's own, pass (as they did)."""
    if transform is None:
        return False
    from fusionflow.policy.tv_flatten import flatten

    try:
        steps = flatten(transform)
    except Exception:  # torchvision missing or an odd container: judged as a whole
        steps = [transform]
    return any(
        type(t).__module__.startswith(("torchvision.", "timm.")) and type(t).__name__ not in _CONVERSIONS for t in steps
    )


def _refuse_transformed_parts(dataset, DatasetFolder) -> None:
    """A ConcatDataset (in Subsets, nested) holding a torchvision folder with a transform: FusionFlow would
    augment that transform's output again, so say how to give the files instead."""
    parts = [dataset]
    while parts:
        part = parts.pop()
        if isinstance(part, torch.utils.data.Subset):
            parts.append(part.dataset)
        elif isinstance(part, torch.utils.data.ConcatDataset):
            parts.extend(part.datasets)
        elif part is not dataset and isinstance(part, DatasetFolder) and _augments(part.transform):
            raise ValueError(
                f"dataset: a {type(dataset).__name__} holding a torchvision {type(part).__name__} with a transform: "
                "FusionFlow would augment that transform's output again. Set each part's transform=None and pass "
                "policy= (e.g. fusionflow.policy_from_transform(the transform))"
            )


def resolve_samples(dataset, sample_keys, read_ahead, num_workers: int = 0) -> tuple[tuple | None, int | None]:
    """(sample_keys, read_ahead) resolved, after the dataset they describe was checked: its first sample read
    here only when this process reads the samples (num_workers=0). With workers, a dataset that opens its file
    at its first read (HDF5, LMDB, a raw file) must not open it here: forked workers would share the handle's
    offset (other samples' bytes) and a spawned one could not take the dataset; a worker's first sample says
    the same (ops/decoded.py, runtime/sample.py)."""
    sample_keys, read_ahead = resolve_sample_keys(sample_keys), resolve_read_ahead(read_ahead)
    wrapped = wrap_samples(dataset, sample_keys)
    if num_workers == 0:
        check_raw_samples(wrapped)
    return sample_keys, read_ahead


def check_map_style(dataset) -> None:
    """Augmentation is a pure function of (seed, epoch, sample index): FusionFlow needs random access."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"FusionFlowLoader needs a map-style dataset (dataset[i]); got {type(dataset).__name__}, "
            "a stream: FusionFlow's augmentation is a function of (seed, epoch, sample index), its epochs are "
            "orders of indices (shuffle, DistributedSampler, checkpoints) and its tiny-batches are sorted by "
            "each sample's size, which all need random access. For WebDataset tar shards use "
            "fusionflow.TarShards(shards) (indexed, random access); for a map-style dataset of dict samples "
            "(wids.ShardListDataset, Hugging Face datasets) pass sample_keys=(image key, target key)"
        )


def resolve_sample_keys(sample_keys) -> tuple | None:
    if sample_keys is None:
        return None
    keys = (sample_keys,) if isinstance(sample_keys, str) else sample_keys
    if not isinstance(keys, (tuple, list)) or not 1 <= len(keys) <= 2:
        raise ValueError(
            f"sample_keys={sample_keys!r} must be (image key, target key) -- e.g. ('jpg', 'cls') or "
            "('image', 'label') -- or (image key,) for samples without targets"
        )
    return tuple(keys)


def resolve_read_ahead(read_ahead) -> int | None:
    if read_ahead is None or read_ahead == 0 and not isinstance(read_ahead, bool):
        return None
    if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
        raise ValueError(
            f"read_ahead={read_ahead!r} must be an integer >= 0: the reads each CPU worker runs at once "
            "ahead of the sample it augments (e.g. 4 for a network filesystem; 0 or None: off)"
        )
    return read_ahead


def wrap_samples(dataset, sample_keys, read_ahead=None):
    """The dataset as the loader reads it: `dataset` itself, its dict samples seen through
    `sample_keys` (resolved; datasets/wrappers.py DictSamples), its reads started ahead (`read_ahead`,
    datasets/wrappers.py ReadAhead). A stream is refused (check_map_style)."""
    check_map_style(dataset)
    from fusionflow.datasets.wrappers import DictSamples, ReadAhead

    if sample_keys is not None:
        dataset = DictSamples(dataset, *sample_keys)
    if read_ahead is not None:
        dataset = ReadAhead(dataset, read_ahead)
    return dataset


def check_raw_samples(dataset) -> None:
    """FusionFlow augments raw images itself; a dataset that already transforms (float tensors or
    arrays) would be augmented twice or fail at the first batch, so say so now. Dict samples without
    sample_keys: say which keys to give."""
    try:
        if len(dataset) == 0:
            return
        item = dataset[0]
    except Exception:  # a dataset whose first sample fails is reported, with its index, at the first batch
        log.debug("dataset[0] could not be read at construction; not checked", exc_info=True)
        return
    if isinstance(item, dict):
        from fusionflow.datasets.wrappers import dict_sample_error

        raise dict_sample_error(item, 0)
    sample = item[0] if isinstance(item, (tuple, list)) and item else item
    dtype = getattr(sample, "dtype", None)
    floating = (
        sample.is_floating_point()
        if isinstance(sample, torch.Tensor)
        else isinstance(sample, np.ndarray) and np.issubdtype(dtype, np.floating)
    )
    if floating:
        raise ValueError(
            f"dataset[0] returns an already-transformed {type(sample).__name__} of dtype {dtype} "
            f"(shape {tuple(sample.shape)}): FusionFlow decodes and augments the samples itself; "
            "give FusionFlow the raw images (fusionflow.ImageFolder, or this dataset without its transform: "
            "transform=None) and a policy"
        )
