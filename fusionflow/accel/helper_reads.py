"""A DALI run's encoded bytes read by the input helpers, not in the training process.

Reading a run's samples costs the training process CPU and GIL: a file-backed dataset's open + read + close is
~20 us a sample of thread CPU on the H200 (2026-11-28, session 27's step track: the largest step of the accelerator
thread's after the input helpers took the draws) and 40-95 us on the 2-core VM for 170 KB JPEGs, over issue 41's
budget of 20 us for everything the accelerator does there. So the helpers (input_helpers.py's InputHelper) read
their share of each run too -- the dataset's batched read, header sizes, the draws -- and write the encoded bytes
into memory shared with the training process, which feeds DALI views of it (DALI reads them in place, as it read
the bytes objects before).

The memory: one anonymous segment per helper (`os.memfd_create`: no name in /dev/shm to leak, not counted against
a container's /dev/shm size; the training process and the helper map it, the memory goes with the last mapping),
cut into `slots` slots of `slot_bytes`. Each run takes a slot (the same in every helper) for as long as DALI may
read the bytes: the pipeline holds a run's `keep` (a `Slot`) until the next run is collected, as it held its bytes
objects (dali_graph.py), so `slots` = the runs in flight + 2. A sample that does not fit in its helper's slot is
left unplaced and read by the training process; so is a whole run when no slot is free. `SAMPLE_BYTES` sizes a
slot for the run's share of samples at 256 KiB each (ImageNet's JPEGs average ~110 KB), at most `MAX_SLOT_BYTES`.
Pages are touched only as bytes are written (a slot holds what the largest run that used it wrote).

The helpers carry the targets back pickled, unless they hold tensors (costlier to unpickle in the training process
than to read there: then it reads every run, `TargetsStayHome`). A run a helper failed to read is read by the
training process; once it has read MAX_READ_FAILURES such runs itself (a failure that is the dataset's -- a corrupt
file fails there too -- is not counted) the helpers stop reading. A helper seeds Python's, NumPy's and torch's
random streams from the loader's seed and its number; get_worker_info() is None there, as in the training process.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from fusionflow.accel.header_sizes import HeaderSizes
from fusionflow.accel.run_read import pairs, read_items
from fusionflow.runtime.gm.link import close_inherited
from fusionflow.runtime.shm import ChildFd, close_owned_fds, disown_fd, own_fd
from fusionflow.runtime.targets import NoTarget

log = logging.getLogger(__name__)
SAMPLE_BYTES = 256 * 1024  # a slot's room per sample of the helper's share
MAX_SLOT_BYTES = 64 << 20  # one slot of one helper at most


def slot_bytes(run_samples: int, helpers: int, min_share: int) -> int:
    """A slot's bytes: room for the most samples one helper is given of a run of `run_samples` (a run under
    2 * min_share samples goes to one helper whole)."""
    share = max(-(-run_samples // helpers), min(run_samples, 2 * min_share - 1))
    return min(MAX_SLOT_BYTES, share * SAMPLE_BYTES)


class Slot:
    """A slot taken for one run; it goes back to its ByteSlots when released or let go (garbage)."""

    def __init__(self, owner: ByteSlots, index: int):
        self.index = index
        self._finalizer = weakref.finalize(self, owner.give_back, index)

    def release(self) -> None:
        self._finalizer()


class ByteSlots:
    """The training process's side: one shared segment per helper (`child_fd(k)` hands helper k its
    descriptor; `forget_fds` once every helper has started), `take` a slot per run, `segments[k]` helper k's bytes."""

    def __init__(self, helpers: int, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = slots, slot_bytes
        self._fds: list[int] = []
        self._dups: list[int] = []  # the descriptors the mappings keep (mmap duplicates the one it maps)
        self._maps: list[mmap.mmap] = []
        self.segments: list[np.ndarray] = []
        self._free = list(range(slots))
        self._lock = threading.Lock()
        try:
            for k in range(helpers):
                fd = os.memfd_create(f"fusionflow-dali-bytes-{k}", os.MFD_CLOEXEC)
                self._fds.append(fd)
                os.ftruncate(fd, slots * slot_bytes)
                self._maps.append(mmap.mmap(fd, slots * slot_bytes))
                self._dups += copies_of(fd)
                self.segments.append(np.frombuffer(self._maps[-1], np.uint8))
        except BaseException:
            self.close()
            raise
        for dup in self._dups:  # forked CPU workers close them (runtime/shm.py), as they close the ring's
            own_fd(dup)
        # dropped unclosed, they are disowned all the same: a number left owned after its mapping closed it could
        # name another file later, which forked children would then close
        self._disown_at_gc = weakref.finalize(self, _disown, list(self._dups))

    def child_fd(self, k: int) -> ChildFd:
        return ChildFd(self._fds[k])

    def fds_but(self, k: int) -> list[int]:
        """This process's descriptors of the segments but helper k's own (a forked helper closes its copies)."""
        return [fd for j, fd in enumerate(self._fds) if j != k] + self._dups

    def forget_fds(self) -> None:
        """Close this process's descriptors (the helpers have theirs; the mappings stay)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def take(self) -> Slot | None:
        """A free slot, or None (every slot still read by DALI: the run is read by the training process)."""
        with self._lock:
            return Slot(self, self._free.pop()) if self._free else None

    def give_back(self, index: int) -> None:  # a Slot let go
        with self._lock:
            self._free.append(index)

    def close(self) -> None:
        """Unmap (a view DALI still holds keeps its mapping until it goes)."""
        self.forget_fds()
        if getattr(self, "_disown_at_gc", None) is not None:
            self._disown_at_gc.detach()  # not later: by then another segment may own the numbers again
        _disown(self._dups)  # closed with their mappings (or when the last view goes)
        self._dups = []
        self.segments = []
        maps, self._maps = self._maps, []
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view still exported: the mapping goes with it
                pass


def copies_of(fd: int) -> list[int]:
    """The process's other descriptors of `fd`'s file, told by device and inode: for a memfd just made and mapped,
    the one the mapping keeps (Python's mmap duplicates the descriptor it maps)."""
    st = os.fstat(fd)
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            other = os.fstat(int(name))
            if int(name) != fd and (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                found.append(int(name))
        except (OSError, ValueError):
            pass  # closed meanwhile, or the listing's own descriptor
    return found


def _disown(fds) -> None:
    for fd in fds:
        disown_fd(fd)


class ReadFailed(RuntimeError):
    """A helper could not read its share of a run from the dataset (the training process reads it instead)."""


class TargetsStayHome(ReadFailed):
    """The dataset's targets hold tensors: unpickling them costs the training process more than reading them (torch's
    shared-memory pickling, ~2 ms a run of 61): it reads every run from now on."""


SIMPLE_TARGETS = {int, float, bool, str, bytes, type(None), NoTarget}  # the common case, told in one set check


def holds_tensor(value) -> bool:
    """A torch tensor in `value` (a target: a number, a string, an array, or tuples, lists, dicts of them)."""
    if type(value).__module__.startswith("torch"):
        return True
    if isinstance(value, (tuple, list)):
        return any(map(holds_tensor, value))
    if isinstance(value, dict):
        return any(map(holds_tensor, value.values()))
    return False


@dataclass
class HelperRun:
    """A run as the helpers read it: per sample (height, width) ((0, 0): not an image they could read), target,
    host inputs (one array per input, a row per sample) and encoded bytes (views of the slot's shared memory;
    empty at `unplaced`: samples that did not fit in their helper's slot, for the caller to read), and the
    slot (helper_reads.Slot), which DALI's pipeline holds while it may read the views."""

    hw: np.ndarray
    labels: list
    columns: list
    samples: list
    unplaced: list
    slot: object


def byte_slots(reads, processes: int, min_share: int):
    """The helpers' shared byte slots for `reads` (dataset, run_samples, runs_in_flight, seed), or None (no reads)."""
    if reads is None:
        return None
    _, run_samples, depth, _ = reads
    try:  # two runs more than in flight: the one DALI's pipeline keeps after its collection, the one being fed
        return ByteSlots(processes, depth + 2, slot_bytes(run_samples, processes, min_share))
    except (OSError, AttributeError) as exc:  # AttributeError: no memfd_create (not Linux)
        log.warning("no shared memory for the DALI input helpers' reads (%s); the accelerator reads the runs", exc)
        return None


class HelperReader:
    """A helper's side: reads its share of a run from `dataset`, writes the bytes into its slot, and
    returns what the training process needs: per sample (height, width) ((0, 0): not an image it can read),
    the targets, the offset and length of its bytes in the segment (offset -1: not placed)."""

    def __init__(self, dataset, fd: ChildFd, slots: int, slot_bytes: int, siblings=()):
        """`siblings`: descriptors a forked helper closes: the training process's ends of the helpers' pipes, and its
        descriptors of the segments but this helper's own."""
        self.dataset, self.fd, self.slots, self.slot_bytes = dataset, fd, slots, slot_bytes
        self.siblings, self.segment = list(siblings), None

    def attach(self, forked: bool, seed: int) -> None:
        """In the helper, first. A forked helper closes what a forked CPU worker closes -- the loaders' rings, caches
        and listening sockets -- and its `siblings`, and keeps every other inherited descriptor: the dataset's may be
        among them (a file it holds open), and closing one under it could have it read another file that got its
        number. Then the segment is mapped (the mapping outlives the descriptor) and the random streams seeded."""
        if forked:
            close_inherited()
            close_owned_fds(*self.siblings)
        m = mmap.mmap(self.fd.fd, self.slots * self.slot_bytes)
        os.close(self.fd.fd)
        self.segment = np.frombuffer(m, np.uint8)
        self.dims = HeaderSizes(len(self.dataset) if hasattr(self.dataset, "__len__") else 0)
        reseed(seed)

    def read(self, indices: np.ndarray, slot: int):
        idx = indices.tolist()
        samples, labels = pairs(read_items(self.dataset, idx), idx)
        if not set(map(type, labels)) <= SIMPLE_TARGETS and any(map(holds_tensor, labels)):
            raise TargetsStayHome("the dataset's targets hold tensors")
        hw = self.dims.many(indices, samples)
        offsets, lengths = np.full(len(idx), -1, np.int64), np.zeros(len(idx), np.int64)
        pos, end = slot * self.slot_bytes, (slot + 1) * self.slot_bytes
        for k in np.flatnonzero(hw[:, 0] > 0).tolist():
            data = np.frombuffer(samples[k], np.uint8)
            if pos + len(data) <= end:
                self.segment[pos : pos + len(data)] = data
                offsets[k], lengths[k], pos = pos, len(data), pos + len(data)
        return hw, labels, offsets, lengths


def reseed(seed: int) -> None:
    """Python's, NumPy's and (where loaded) torch's random streams in a helper, from `seed` (the loader's seed and the
    helper's number): a dataset drawing at random in its reads gets a stream of its own there, reproducible with
    the loader's seed, not the training process's stream copied at the fork."""
    import random
    import sys

    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
