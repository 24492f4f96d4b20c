"""What FusionFlowLoader wraps a dataset in: `DictSamples` (dict samples seen through
`sample_keys`) and `ReadAhead` (reads started ahead with `read_ahead`). Both carry the wrapped
dataset's `sizes` and `describe` over, and return encoded samples, never decoded ones.
"""

from __future__ import annotations

import os
import re


class DictSamples:
    """A dataset whose items are dicts, seen as (encoded image, target): what
    `FusionFlowLoader(..., sample_keys=(image_key, target_key))` wraps the dataset in.

    A key matches with or without a leading dot (`"jpg"` finds `".jpg"`, as `wids` names them), and
    a tuple of keys gives alternatives (the first present wins). An image value may be bytes, a PIL
    image or a uint8 array, or Hugging Face's `Image(decode=False)` dict `{"bytes": ..., "path": ...}`
    (the file at `path` is read when `bytes` is None), or a file-like object (`wids` with
    `transformations=[]` gives io.BytesIO: the fast path, encoded bytes). A target given as bytes (or a
    file-like object) holding an integer (a WebDataset `.cls` member) becomes an int; other targets
    are kept as given; `target_key=None` gives None targets. The wrapped dataset's `sizes` and
    `describe` carry over; pickles as the dataset does.
    """

    loader_wrapper = True  # the loader's view of the user's dataset (`dataset`): unwrapped for get_worker_info()

    def __init__(self, dataset, image_key, target_key=None):
        self.dataset = dataset
        self.image_keys = _dict_keys(image_key, "sample_keys' image key")
        self.target_keys = None if target_key is None else _dict_keys(target_key, "sample_keys' target key")
        _carry_sizes_and_names(self, dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self._pair(single_read(self.dataset)(index), index)  # (a dataset read by __getitems__ only, too)

    def __getitems__(self, indices):
        """The dataset's batched read where it has one (a Hugging Face dataset: one Arrow read a tiny-batch, as
        DataLoader's fetcher reads it), else item by item."""
        items = batched_read(self.dataset, indices)
        items = items if items is not None else [self.dataset[i] for i in indices]
        return [self._pair(item, index) for item, index in zip(items, indices)]

    def _pair(self, item, index: int):
        if not isinstance(item, dict):
            raise TypeError(
                f"dataset[{index}] is a {type(item).__name__}, not a dict: sample_keys applies to datasets "
                "whose samples are dicts; leave it out for (image, target) samples"
            )
        image = _image_value(_lookup(item, self.image_keys, index, "image"), index)
        if self.target_keys is None:
            return image, None
        return image, _target_value(_lookup(item, self.target_keys, index, "target"))


def _carry_sizes_and_names(wrapper, dataset) -> None:
    """What the loader reads from a dataset besides its samples (`sizes`, `describe`), on a wrapper,
    where the dataset has them."""
    for name in ("sizes", "describe"):
        if getattr(dataset, name, None) is not None:
            setattr(wrapper, name, getattr(dataset, name))


def _dict_keys(key, what: str) -> tuple[str, ...]:
    keys = (key,) if isinstance(key, str) else tuple(key) if isinstance(key, (tuple, list)) else None
    if not keys or not all(isinstance(k, str) and k.lstrip(".") for k in keys):
        raise ValueError(f"{what} {key!r} must be a key such as 'jpg' or 'image' (or a tuple of them)")
    return tuple(k.lstrip(".") for k in keys)


def _lookup(item: dict, keys: tuple[str, ...], index: int, what: str):
    for k in keys:
        for name in (k, "." + k):
            if name in item:
                return item[name]
    raise KeyError(
        f"dataset[{index}] has no {what} key {' or '.join(repr(k) for k in keys)} (its keys: "
        f"{', '.join(map(repr, item))}); set sample_keys=(image key, target key) to the sample's own keys"
    )


def _file_bytes(value):
    """A file-like value (wids without transformations gives io.BytesIO) -> its bytes; else the value."""
    if hasattr(value, "getvalue"):
        return value.getvalue()
    if hasattr(value, "read"):
        return value.read()
    return value


def _image_value(value, index: int):
    value = _file_bytes(value)
    if isinstance(value, dict):  # Hugging Face datasets' Image(decode=False): {"bytes": ..., "path": ...}
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return data
        if path:
            with open(path, "rb") as f:
                return f.read()
        raise ValueError(f"dataset[{index}]'s image is a dict with neither 'bytes' nor 'path': {sorted(value)}")
    return value


def _target_value(value):
    value = _file_bytes(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).strip()
        if re.fullmatch(rb"[+-]?\d+", text):  # as TarShards reads a .cls (datasets/shards.py parse_target)
            return int(text)
        return bytes(value)
    return value


def dict_sample_error(item: dict, index: int) -> ValueError:
    keys = ", ".join(repr(k) for k in item)
    image = next(
        (k for k in item if str(k).lstrip(".").lower() in ("jpg", "jpeg", "png", "webp", "image", "img")), None
    )
    target = next((k for k in item if str(k).lstrip(".").lower() in ("cls", "label", "labels", "target", "txt")), None)
    hint = (
        f"sample_keys=({image!r}, {target!r})"
        if image is not None and target is not None
        else "sample_keys=(image key, target key)"
    )
    return ValueError(
        f"dataset[{index}] is a dict (keys: {keys}), not (image, target): tell FusionFlowLoader which keys "
        f"hold the image and the target, e.g. FusionFlowLoader(dataset, ..., {hint})"
    )


class ReadAhead:
    """`dataset` with its reads started ahead: what `FusionFlowLoader(..., read_ahead=N)` wraps the
    dataset in, for storage where a read waits (network filesystems, object stores).

    A CPU worker calls `prefetch(indices)` with its tiny-batch's sample indices before it reads the
    first; up to `threads` reads then run at once on a thread pool of the worker's own (reads release
    the GIL), while the worker augments the samples already read. What is read ahead is at most one
    tiny-batch per worker, so the memory it holds is bounded by the tiny-batch's encoded bytes. A read
    that fails raises when its sample is taken, exactly where the plain read would have. The
    dataset's `sizes` and `describe` carry over; pickles without its pool (each process starts its own).
    """

    loader_wrapper = True  # the loader's view of the user's dataset (`dataset`): unwrapped for get_worker_info()

    def __init__(self, dataset, threads: int):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"read_ahead={threads!r} must be an integer >= 1 (0 or None: no read-ahead)")
        self.dataset, self.threads = dataset, threads
        _carry_sizes_and_names(self, dataset)
        self._pool, self._pending, self._pid = None, {}, os.getpid()

    def __len__(self) -> int:
        return len(self.dataset)

    def prefetch(self, indices) -> None:
        """Start reading these samples (dropping any started earlier and never taken)."""
        if self._pool is None or self._pid != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fusionflow-read")
            self._pid = os.getpid()
        read = single_read(self.dataset)
        self._pending = {}
        for i in indices:
            if i not in self._pending:
                self._pending[i] = self._pool.submit(read, i)

    def __getitem__(self, index: int):
        pending = self._pending.pop(index, None)
        if pending is not None:
            return pending.result()
        return single_read(self.dataset)(index)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool"], state["_pending"] = None, {}
        return state


def batched_read(dataset, indices) -> list | None:
    """The dataset's `__getitems__(indices)` (PyTorch's batched read) as a list, its count checked; None where the
    dataset has none. What every reader of a batch calls: the CPU workers (runtime/sample.py), the accelerator's run
    read (accel/run_read.py), DictSamples."""
    many = getattr(dataset, "__getitems__", None)
    if many is None:
        return None
    items = list(many(list(indices)))  # (a tuple, a generator)
    if len(items) != len(indices):
        raise ValueError(f"{type(dataset).__name__}.__getitems__ returned {len(items)} items for {len(indices)}")
    return items


def single_read(dataset):
    """How ReadAhead reads one sample: dataset[i], or, for a dataset read only by `__getitems__` (no __getitem__ of
    its own beside torch Dataset's, which raises NotImplementedError), `__getitems__([i])`: the reads run apart, on
    the pool's threads, as read-ahead does."""
    many, own = getattr(dataset, "__getitems__", None), getattr(type(dataset), "__getitem__", None)
    torchs = getattr(own, "__module__", None) == "torch.utils.data.dataset"  # (Dataset's, which raises)
    if many is not None and (own is None or torchs):
        return lambda index: many([index])[0]
    return dataset.__getitem__


def start_reads(dataset, indices) -> None:
    """Start the reads of a tiny-batch's samples when `dataset` is the loader's ReadAhead (`read_ahead=`); a
    user dataset's own `prefetch`, whatever it is, is not FusionFlow's to call."""
    if isinstance(dataset, ReadAhead):
        dataset.prefetch(indices)
