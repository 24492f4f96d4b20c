"""A tiny-batch's samples, read and augmented into their slots: the body every CPU path runs -- a CPU worker
process (runtime/worker.py `run_task`), a Ray worker (remote/task.py) and the training process itself with
num_workers=0 (`FusionFlowLoader`'s inline iteration) -- so all report failures and targets alike. A dataset
with a batched read, `__getitems__(indices)` (PyTorch's protocol: DataLoader's fetcher reads a batch with it), is
read so, a tiny-batch a call (`run_samples`); where that raises, each sample is read alone (by `__getitems__([i])`
where the dataset has no __getitem__), so the failing one is told from the rest."""

from __future__ import annotations

import os
import signal
import traceback

from fusionflow.datasets.wrappers import batched_read, single_read
from fusionflow.errors import class_name, exception_attributes
from fusionflow.runtime import targets
from fusionflow.runtime.messages import SampleFailure

_READ = [False, False]  # [this process is inside dataset[i], a stop came meanwhile]: end_after_read


def end_after_read(signum=None, frame=None) -> None:
    """A CPU worker's SIGUSR1 handler (the pool's stop of a busy worker: an iteration that ended early): inside
    dataset[i] the process ends as soon as the read returns -- a dataset that writes a file, a cache entry or a
    transaction as it reads is not cut in the middle, as DataLoader lets a fetch finish -- elsewhere at once (the
    stop's grace, then SIGTERM and SIGKILL, bound a read that does not return; any SIGTERM ends it at once)."""
    if _READ[0]:
        _READ[1] = True
    else:
        _terminate()


def _terminate() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_UNREAD = object()  # run_sample's `item`: not read yet


def _read(dataset, index: int, batch_error: BaseException | None = None):
    """dataset[index]; after its batched read raised (`batch_error`), the sample alone: by `__getitems__([index])`
    where the dataset has no __getitem__ of its own (datasets/wrappers.py single_read), so the bad sample is told
    from its tiny-batch's others."""
    _READ[0] = True
    try:
        return single_read(dataset)(index) if batch_error is not None else dataset[index]
    except NotImplementedError:  # (a __getitem__ that says so): a dataset read by __getitems__ only
        if batch_error is not None:
            raise batch_error from None
        raise
    finally:
        _READ[0] = False
        if _READ[1]:
            _terminate()


def read_many(dataset, indices, clock=None) -> tuple[list | None, BaseException | None]:
    """(items, None) by the dataset's `__getitems__`; (None, None) where it has none; (None, the exception) where
    it raised or gave another count of items."""
    if getattr(dataset, "__getitems__", None) is None:
        return None, None
    if clock is not None:
        clock.start()
    _READ[0] = True
    try:
        return batched_read(dataset, indices), None
    except Exception as exc:
        return None, exc
    finally:
        _READ[0] = False
        if clock is not None:
            clock("read")
        if _READ[1]:
            _terminate()


def run_samples(dataset, pipe, positions, indices, copies, seed: int, epoch: int, images, labels, side, clock=None):
    """`run_sample` for each sample of a tiny-batch (positions, indices and copy numbers, None: all 0), read by the
    dataset's batched read where it has one; the failures, in order."""
    items, batch_error = read_many(dataset, indices, clock)
    failures = []
    for k, (pos, index, copy) in enumerate(zip(positions, indices, copies or (0,) * len(indices))):
        item = items[k] if items is not None else _UNREAD
        failure = run_sample(
            dataset, pipe, pos, index, copy, seed, epoch, images, labels, side, clock, item, batch_error
        )
        if failure is not None:
            failures.append(failure)
    return failures


def describe(dataset, index: int) -> str:
    fn = getattr(dataset, "describe", None)
    if fn is not None:
        try:
            return f"sample {index} ({fn(index)})"
        except Exception:  # a describe() that fails must not hide the real error
            pass
    return f"sample {index}"


def split_item(item, index: int):
    """(sample, target): the target as the dataset gave it (runtime/targets.py says how it travels); for an
    item of several targets, (sample, a, b, ...), the target `Columns((a, b, ...))` (`Fields` for a namedtuple,
    which keeps its class); for a bare sample (an
    image alone: bytes, an array or tensor, a PIL image) `NO_TARGET`. Batches take the shape back."""
    if isinstance(item, dict):
        from fusionflow.datasets.wrappers import dict_sample_error

        raise dict_sample_error(item, index)
    if targets.is_namedtuple(item) and len(item) >= 2:  # a namedtuple keeps its class
        return item[0], targets.Fields(type(item), item[1:])
    if isinstance(item, (tuple, list)):
        if len(item) == 2:
            return item[0], item[1]
        if len(item) > 2:
            return item[0], targets.Columns(item[1:])
    elif _bare_image(item):
        return item, targets.NO_TARGET
    size = f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
    raise TypeError(
        f"dataset[{index}] must return (sample, target), (sample, target, ...) or a bare image, "
        f"got a {type(item).__name__}{size}"
    )


def _bare_image(item) -> bool:
    """Encoded bytes, a (uint8) array or tensor, or a PIL image."""
    return (
        isinstance(item, (bytes, bytearray, memoryview))
        or hasattr(item, "__array_interface__")
        or (type(item).__module__.startswith("torch") and hasattr(item, "dtype"))
        or hasattr(item, "getpixel")
    )


def run_sample(
    dataset,
    pipe,
    pos: int,
    index: int,
    copy: int,
    seed: int,
    epoch: int,
    images,
    labels,
    side: dict,
    clock=None,
    item=_UNREAD,
    batch_error=None,
) -> SampleFailure | None:
    """Read dataset[index] (unless `item` holds it, read already) and augment it for (seed, epoch, copy) into
    images[pos]; its target goes into labels[pos] if it is an int, else into `side` (runtime/targets.py). `clock`
    (a stages.StageClock), if given, times the stages. Any exception is returned as a SampleFailure (data: it
    travels to the training process and on_error decides), never raised."""
    try:
        if clock is not None:
            clock.start()
        item = _read(dataset, index, batch_error) if item is _UNREAD else item
        sample, target = split_item(item, index)
        if clock is not None:
            clock("read")
        pipe(sample, index, seed, epoch, out=images[pos], what=describe(dataset, index), tick=clock, copy=copy)
        targets.store(labels, pos, target, side)
    except Exception as exc:
        return SampleFailure(
            pos,
            index,
            describe(dataset, index),
            type(exc).__name__,
            str(exc),
            traceback.format_exc(),
            class_name(exc),
            exception_attributes(exc),
        )
    return None
