"""A loader's use of its node's decoded-image cache: `CacheAttachment`, opened when the loader's
runtime first starts and closed with the loader (not per epoch: the cache outlives epochs).

It owns the link to the node's keeper (fusionflow/cache/keeper.py) -- or, for a dataset that has no
fingerprint (it does not pickle and has no `fingerprint()`), a private segment its workers share --
the store mapped in the training process, and the counter rows of its CPU workers (one each) and of
the training process itself (num_workers=0). Workers get `CacheHandle`s: the descriptor (inherited
or passed as the ring's is) and their row. With fill_share="auto" it also tells those rows whether
the training loop waits for the loader (`FillPacer`): the workers then pace their fills.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time

from fusionflow.cache import keeper, record_lock
from fusionflow.cache.config import DecodedCache
from fusionflow.cache.store import R_PACE, ROWS, CacheStore, segment_bytes
from fusionflow.datasets.wrappers import ReadAhead
from fusionflow.errors import SharedMemoryError
from fusionflow.runtime.shm import SHM_DIR, ChildFd, disown_fd, free_bytes, own_fd

log = logging.getLogger("fusionflow.cache")
PACE_ABOVE = 0.05  # "auto" fills are paced while the training loop waits for the loader more than this share
PACE_SMOOTHING = 0.2  # weight of the newest batch in the moving average of that share


class FillPacer:
    """fill_share="auto": is the training loop waiting for the loader? The share of the time between
    two batches spent waiting for the second, averaged over recent batches. While it is above
    PACE_ABOVE the loader is the bottleneck and a whole-image decode would slow training: fills are
    paced; below it the workers have spare time and fill as samples come (the feedback settles the
    fill rate at what the spare time allows). Paced until the first interval is measured: free filling
    must be earned, or a loader-bound job's first batches would pay it."""

    def __init__(self):
        self.waiting_share: float | None = None
        self._last: float | None = None

    def delivered(self, waited_s: float, now: float | None = None) -> bool:
        """A batch was delivered after the training loop waited `waited_s` for it; whether to pace now."""
        now = time.monotonic() if now is None else now
        if self._last is not None:
            share = min(1.0, waited_s / (now - self._last)) if now > self._last else 1.0
            old = self.waiting_share
            self.waiting_share = share if old is None else old + PACE_SMOOTHING * (share - old)
        self._last = now
        return self.waiting_share is None or self.waiting_share > PACE_ABOVE


def fingerprint(dataset) -> str | None:
    """What identifies a dataset across processes: its own `fingerprint()`, else a hash of its pickle
    (its file list, root, ...); None when it has neither."""
    if isinstance(dataset, ReadAhead):  # how it reads, not what: its inner dataset says what
        dataset = dataset.dataset
    fn = getattr(dataset, "fingerprint", None)
    if callable(fn):
        return f"{type(dataset).__qualname__}:{fn()}"
    try:
        blob = pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    return f"{type(dataset).__qualname__}:{len(dataset)}:{hashlib.sha256(blob).hexdigest()}"


def check_room(spec: DecodedCache, entries: int) -> None:
    """Refuse, before anything is made, a budget the backing filesystem cannot hold."""
    where = spec.path or SHM_DIR
    need, free = segment_bytes(entries, spec.size), free_bytes(where)
    if free is not None and free < need:
        gib = 2**30
        raise SharedMemoryError(
            f"the decoded-image cache needs {need / gib:.2f} GiB ({need} bytes: size={spec.size} plus the index of "
            f"{entries} samples) but {where} has {free / gib:.2f} GiB free. Fixes: a smaller budget (cache='4GB'), "
            f"a larger {SHM_DIR} (docker run --shm-size=...), or DecodedCache(size=..., path='/a/local/disk/dir')"
        )


class CacheHandle:
    """What a CPU worker needs: the segment's descriptor (and the crop store's, when crops are reused)
    and its counter row (picklable for spawn)."""

    def __init__(self, fd: int, row: int | None, fill_share: float | str | None = None, crops_fd: int | None = None):
        self.fd, self.row, self.fill_share = ChildFd(fd), row, fill_share
        self.crops_fd = ChildFd(crops_fd) if crops_fd is not None else None

    def take(self) -> tuple:
        """In the worker, before it closes the parent's descriptors (`map_from_child_fd`, which closes the
        inherited numbers): duplicates of its own, for `reader`."""
        return os.dup(self.fd.fd), (os.dup(self.crops_fd.fd) if self.crops_fd is not None else None)

    def reader(self, fds: tuple):
        """The CacheReader the worker's pipeline uses, on the descriptors from `take` (kept open: the
        lock is on the store's)."""
        from fusionflow.cache.crops import CropStore
        from fusionflow.cache.reader import CacheReader

        fd, crops_fd = fds
        crops = CropStore(crops_fd) if crops_fd is not None else None
        return CacheReader(CacheStore(fd), self.row, self.fill_share, crops)


class CacheAttachment:
    def __init__(self, store: CacheStore, link, workers: int, spec: DecodedCache, crop_size=None):
        """`crop_size`: the policy's output size when crops are reused (its crop store is made here)."""
        self.store, self.link, self.fill_share, self.crops = store, link, spec.fill_share, None
        self.rows, self._reader, self._pid = [], None, os.getpid()  # the mapping is not inherited by a fork
        self._said_short = False  # the node's counter table was found full (said once)
        self.pacer = FillPacer() if spec.fill_share == "auto" else None
        self._owned = [store.fd] + ([link.conn.fileno()] if link is not None else [])
        for fd in self._owned:  # forked workers (of any loader) close them: they must not keep this cache alive
            own_fd(fd)
        try:
            self.rows = store.claim_rows(workers + 1, os.getpid())  # the first: the training process's own; then
            if self.pacer is not None:  # worker w's at 1 + w (claimed later for a worker added later: `handle`)
                store.rows[self.rows, R_PACE] = 1  # paced until the training loop is seen not to wait
            self._say_if_short(workers + 1)
            if crop_size is not None:
                self.crops = _crop_store(spec, len(store.entries), crop_size)
                self._owned.append(self.crops.fd)
                own_fd(self.crops.fd)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, spec: DecodedCache, dataset, workers: int, crop_size=None) -> CacheAttachment | None:
        """The node's cache for `dataset` (shared when it has a fingerprint), or None when it could not
        be set up (one log line: the loader runs without it). A budget the node cannot hold raises, as
        does a crop store (`crop_size`: the output size, when crops are reused) that does not fit."""
        entries = len(dataset)
        found = fingerprint(dataset)
        try:
            if found is None:
                log.info(
                    "fusionflow: the dataset has no fingerprint (it does not pickle): its cache is this loader's own"
                )
                check_room(spec, entries)
                return cls(_private(spec, entries), None, workers, spec, crop_size)
            key = keeper.cache_key(found, spec.max_side, spec.admission)
            link = keeper.attach(
                key, entries, spec.size, spec.max_side, spec.admission, spec.path, lambda: check_room(spec, entries)
            )
            return cls(link.store, link, workers, spec, crop_size)  # on failure it closes what it was given
        except SharedMemoryError:
            raise  # the budget does not fit: the user's to fix (the message says how)
        except Exception as exc:  # the keeper, its socket, a refused attach, a malformed record, ...
            log.warning(
                "fusionflow: the decoded-image cache could not be set up (%r); this loader runs without it", exc
            )
            return None

    @property
    def max_side(self) -> int:
        return self.store.max_side

    def handle(self, wid: int) -> CacheHandle:
        crops_fd = self.crops.fd if self.crops is not None else None
        return CacheHandle(self.store.fd, self._worker_row(wid), self.fill_share, crops_fd)

    def _worker_row(self, wid: int) -> int | None:
        """CPU worker `wid`'s counter row, claimed now for a worker beyond those of the open (a raised worker target,
        `gm workers N`): it counted nothing and, under fill_share="auto", filled unpaced. None: the node's table is
        full (the worker is then uncounted and paced, `CacheReader`)."""
        missing = wid + 2 - len(self.rows)
        if missing > 0 and self.store is not None and self._pid == os.getpid():
            try:
                got = self.store.claim_rows(missing, os.getpid())
            except TimeoutError:  # a stopped process holds the lock
                got = []
            if self.pacer is not None and got:
                self.store.rows[got, R_PACE] = self.store.rows[self.rows[0], R_PACE] if self.rows else 1
            self.rows += got
            self._say_if_short(wid + 2)
        return self.rows[1 + wid] if 1 + wid < len(self.rows) else None

    def _say_if_short(self, wanted: int) -> None:
        if len(self.rows) < wanted and not self._said_short:
            self._said_short = True
            log.warning(
                "fusionflow: the decoded-image cache's counter table is full (%d rows for the node's loaders): %d of "
                "this loader's processes go uncounted in loader.stats.cache, and fill paced",
                ROWS,
                wanted - len(self.rows),
            )

    def reader(self):
        """The training process's own CacheReader (num_workers=0)."""
        if self._reader is None:
            from fusionflow.cache.reader import CacheReader

            row = self.rows[0] if self.rows else None
            self._reader = CacheReader(self.store, row, self.fill_share, self.crops)
        return self._reader

    def delivered(self, waited_s: float) -> None:
        """A batch went to the training loop after it waited `waited_s` (fill_share="auto": pace or not)."""
        if self.pacer is not None and self.store is not None and self.rows:
            self.store.rows[self.rows, R_PACE] = int(self.pacer.delivered(waited_s))

    @property
    def keeper_pid(self) -> int | None:
        """The node's keeper process serving this cache (None: a private cache)."""
        return self.link.keeper_pid if self.link is not None else None

    def counts(self) -> dict | None:
        """This loader's counters and the cache's size; None once closed, and in a forked process (the segment is
        mapped MADV_DONTFORK: reading the parent's rows there crashed it with SIGSEGV)."""
        return self.store.counts(self.rows) if self.store is not None and self._pid == os.getpid() else None

    def close(self) -> None:
        store, self.store = self.store, None
        if store is None:
            return
        self._reader = None
        try:
            store.release_rows(self.rows)
        except TimeoutError:
            pass  # a stopped worker holds the lock: the rows are freed when this process is gone
        for fd in self._owned:
            disown_fd(fd)
        crops, self.crops = self.crops, None
        for part in (store, crops):
            if part is not None:
                with record_lock.threads():  # closing any descriptor of the segment drops this process's record
                    fd = part.fd  # lock on it: never while another loader's thread here holds it
                    part.close()
                    os.close(fd)
        if self.link is not None:
            self.link.close()


def _crop_store(spec: DecodedCache, entries: int, size):
    """The loader's own crop store (refurbishing), its every page reserved now; refused with the fix
    when the room is not there."""
    from fusionflow.cache.crops import CropStore, crops_bytes

    need, free = crops_bytes(entries, size), free_bytes(spec.path or SHM_DIR)
    if free is not None and free < need:
        raise SharedMemoryError(
            f"reuse_crop_epochs keeps every sample's crop: {need / 2**30:.2f} GiB ({entries} samples of "
            f"{size[0]}x{size[1]}x3) but {spec.path or SHM_DIR} has {free / 2**30:.2f} GiB free. Fixes: "
            "reuse_crop_epochs=None, a larger /dev/shm, or DecodedCache(path='/a/local/disk/dir')"
        )
    fd = keeper.segment(spec.path)
    try:
        return CropStore.create(fd, entries, size)
    except BaseException:
        os.close(fd)
        raise


def _private(spec: DecodedCache, entries: int) -> CacheStore:
    fd = keeper.segment(spec.path)
    try:
        return CacheStore.create(fd, entries, spec.size, spec.max_side, spec.admission)
    except BaseException:
        os.close(fd)
        raise
