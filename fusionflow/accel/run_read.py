"""A DALI run's samples, read in the training process with whole-run operations.

The accelerator thread reads each sample of a run (its encoded bytes and target), looks up its image
size (accel/header_sizes.py) and checks it against the policy's pixel limit before DALI sees it. Done
sample by sample in Python that cost ~50 interpreter calls a sample (issue 41: the GIL taken from the
training loop grows with the GPU's share). Here the common case takes the same calls whatever the
run's size (tests/test_run_read.py counts them):
  * the dataset's batched read, `__getitems__(indices)` (PyTorch's protocol, which DataLoader's fetcher
    uses too), where the dataset has one; else one `dataset[i]` per sample;
  * (sample, target) pairs checked and split with C-level calls (`map`, `zip`);
  * sizes looked up in one gather (a header is read only the first time a sample is met);
  * the pixel limit checked as one array comparison, per tiny-batch with `reduceat`.
Anything unusual -- a read that raises, an item that is not a (sample, target) pair, a header that cannot be
read, a sample over the limit -- takes the per-tiny-batch path, whose tiny-batches are given back to the CPU
workers (they report the sample precisely), never counted as a failed DALI run.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from fusionflow.datasets.wrappers import batched_read
from fusionflow.runtime.sample import split_item

_COPIES = operator.attrgetter("copies")  # a Work's copies


@dataclass
class RunRead:
    """What a run's tiny-batches gave: the ones DALI may run (their samples, targets and (height, width)
    sizes, in order) and the ones given back to the CPU workers."""

    runnable: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    sizes: np.ndarray | list = field(default_factory=list)
    given_back: list = field(default_factory=list)
    columns: list | None = None  # the runnable samples' host inputs, when the helpers made them with the read
    keep: object = None  # what DALI's pipeline holds while it may read the samples (helper_reads.Slot)
    unreadable: str = ""  # why a sample's read raised here (its tiny-batch given back): the dataset's failure


def read_items(dataset, indices: list) -> list:
    """dataset[i] for each of `indices`, by the dataset's batched read when it has one."""
    items = batched_read(dataset, indices)
    return items if items is not None else [dataset[i] for i in indices]


def pairs(items: list, indices: list) -> tuple[list, list]:
    """([sample], [target]) of (sample, target) items; split_item's errors for anything else."""
    if set(map(type, items)) <= {tuple, list} and set(map(len, items)) <= {2}:
        samples, labels = zip(*items) if items else ((), ())
        return list(samples), list(labels)
    pairs = [split_item(item, index) for item, index in zip(items, indices)]  # raises, naming the index
    return [s for s, _ in pairs], [t for _, t in pairs]


def read_run(dataset, group: list, dims, max_pixels: int | None) -> RunRead:
    """Read the samples of `group` (tiny-batches, in order) for one DALI run. `dims`: the loader's
    HeaderSizes; a tiny-batch with a sample whose header cannot be read (not encoded bytes, or not
    an image) or over `max_pixels` is given back whole."""
    indices = [i for w in group for i in w.indices]
    try:
        samples, labels = pairs(read_items(dataset, indices), indices)
    except Exception:  # a sample the dataset cannot read: not a failed DALI run (a few bad files retired DALI)
        return read_each(dataset, group, dims, max_pixels)
    return runnable(group, samples, labels, dims.many(indices, samples), max_pixels)


def read_each(dataset, group: list, dims, max_pixels: int | None) -> RunRead:
    """`read_run` tiny-batch by tiny-batch, after the run's read raised: a tiny-batch whose read raises is given
    back to the CPU workers, which report its sample as on_error says (or skip it), the rest run."""
    ok, back, samples, labels, why = [], [], [], [], ""
    for work in group:
        try:
            got = pairs(read_items(dataset, list(work.indices)), list(work.indices))
        except Exception as exc:
            back.append(work)
            why = why or f"reading samples {list(work.indices)} raised {exc!r}"
            continue
        ok.append(work)
        samples += got[0]
        labels += got[1]
    indices = [i for w in ok for i in w.indices]
    read = runnable(ok, samples, labels, dims.many(indices, samples), max_pixels) if ok else RunRead(sizes=[])
    read.given_back += back
    read.unreadable = why
    return read


def runnable(group: list, samples: list, labels: list, hw: np.ndarray, max_pixels: int | None, columns=None) -> RunRead:
    """The run's tiny-batches DALI may take, given each sample's (height, width) `hw` ((0, 0): unreadable) and,
    when made already, the host inputs `columns` (one array per input, a row per sample): a tiny-batch with a
    sample unreadable or over `max_pixels` is given back whole, its rows dropped."""
    ok = hw[:, 0] > 0
    if max_pixels is not None:
        ok &= hw[:, 0] * hw[:, 1] <= max_pixels
    if ok.all():
        return RunRead(list(group), samples, labels, hw, [], columns)
    starts = np.cumsum([0] + [len(w.indices) for w in group[:-1]])
    works_ok = np.logical_and.reduceat(ok, starts)  # every tiny-batch holds at least one sample
    read, rows = RunRead(sizes=[]), np.zeros(len(samples), bool)
    for work, fine, start in zip(group, works_ok.tolist(), starts.tolist()):
        if not fine:
            read.given_back.append(work)
            continue
        end = start + len(work.indices)
        read.runnable.append(work)
        read.samples += samples[start:end]
        read.labels += labels[start:end]
        read.sizes += [tuple(z) for z in hw[start:end].tolist()]
        rows[start:end] = True
    if columns is not None:
        read.columns = [c[rows] for c in columns]
    return read


def read_by_helpers(helper, dataset, group: list, max_pixels: int | None, seed: int) -> RunRead | None:
    """`group` read by the input helpers (InputHelper.read: bytes in shared memory, with the run's host inputs), the
    samples that did not fit in their slots read here; None where the helpers do not read it (the caller does)."""
    indices = [i for w in group for i in w.indices]
    any_copies = any(map(_COPIES, group))  # C-level calls: a run's Python calls do not grow with its tiny-batches
    copies = [c for w in group for c in (w.copies or (0,) * len(w.indices))] if any_copies else None
    got = helper.read(indices, copies, seed, group[0].epoch)
    if got is None:
        return None
    if got.unplaced:
        more = [indices[k] for k in got.unplaced]
        try:
            for k, sample in zip(got.unplaced, pairs(read_items(dataset, more), more)[0]):
                got.samples[k] = sample
        except Exception:  # a sample the dataset cannot read: the caller reads the run tiny-batch by tiny-batch
            got.slot.release()
            return None
        except BaseException:
            got.slot.release()  # now, not when the traceback goes
            raise
    read = runnable(group, got.samples, got.labels, got.hw, max_pixels, got.columns)
    read.keep = got.slot
    return read


def read_for_run(helper, dataset, group: list, dims, max_pixels: int | None, seed: int) -> RunRead:
    """`group` read by the input helpers where they read it (`read_by_helpers`), else here (`read_run`: a tiny-batch
    the dataset cannot read is given back); a run the helpers failed and this process read whole is theirs
    (InputHelper.read_here)."""
    if helper is None:
        return read_run(dataset, group, dims, max_pixels)
    read = read_by_helpers(helper, dataset, group, max_pixels, seed)
    if read is None:
        read = read_run(dataset, group, dims, max_pixels)
        if not read.unreadable:  # else the helpers' failure (if any) was the dataset's: not counted against them
            helper.read_here()
    return read
