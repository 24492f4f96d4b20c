"""A loader's use of its node's decoded-image cache: `CacheAttachment`, opened when the loader's
runtime first starts and closed with the loader (not per epoch: the cache outlives epochs).

It owns the link to the node's keeper (fusionflow/cache/keeper.py) -- or, for a dataset that has no
fingerprint (it does not pickle and has no `fingerprint()`), a private segment its workers share --
the store mapped in the training process, and the counter rows of its CPU workers (one each) and of
the training process itself (num_workers=0). Workers get `CacheHandle`s: the descriptor (inherited
or passed as the ring's is) and their row.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle

from fusionflow.cache import keeper
from fusionflow.cache.config import DecodedCache
from fusionflow.cache.store import CacheStore, segment_bytes
from fusionflow.datasets.wrappers import ReadAhead
from fusionflow.errors import SharedMemoryError
from fusionflow.runtime.shm import SHM_DIR, ChildFd, disown_fd, free_bytes, own_fd

log = logging.getLogger("fusionflow.cache")


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
    """What a CPU worker needs: the segment's descriptor and its counter row (picklable for spawn)."""

    def __init__(self, fd: int, row: int | None, fill_share: float | None = None):
        self.fd, self.row, self.fill_share = ChildFd(fd), row, fill_share

    def take(self) -> int:
        """In the worker, before it closes the parent's descriptors (`map_from_child_fd`, which closes the
        inherited number): a duplicate of its own, for `reader`."""
        return os.dup(self.fd.fd)

    def reader(self, fd: int):
        """The CacheReader the worker's pipeline uses, on `fd` from `take` (kept open: the lock is on it)."""
        from fusionflow.cache.reader import CacheReader

        return CacheReader(CacheStore(fd), self.row, self.fill_share)


class CacheAttachment:
    def __init__(self, store: CacheStore, link, workers: int, fill_share: float | None = None):
        self.store, self.link, self.fill_share = store, link, fill_share
        self.rows, self._reader = [], None
        self._owned = [store.fd] + ([link.conn.fileno()] if link is not None else [])
        for fd in self._owned:  # forked workers (of any loader) close them: they must not keep this cache alive
            own_fd(fd)
        try:
            self.rows = store.claim_rows(workers + 1, os.getpid())  # the last: the training process's own
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, spec: DecodedCache, dataset, workers: int) -> CacheAttachment | None:
        """The node's cache for `dataset` (shared when it has a fingerprint), or None when it could not
        be set up (one log line: the loader runs without it). A budget the node cannot hold raises."""
        entries = len(dataset)
        found = fingerprint(dataset)
        try:
            if found is None:
                log.info(
                    "fusionflow: the dataset has no fingerprint (it does not pickle): its cache is this loader's own"
                )
                check_room(spec, entries)
                return cls(_private(spec, entries), None, workers, spec.fill_share)
            key = keeper.cache_key(found, spec.max_side, spec.admission)
            link = keeper.attach(
                key, entries, spec.size, spec.max_side, spec.admission, spec.path, lambda: check_room(spec, entries)
            )
            return cls(link.store, link, workers, spec.fill_share)
        except SharedMemoryError:
            raise  # the budget does not fit: the user's to fix (the message says how)
        except Exception as exc:  # the keeper, its socket, a refused attach, a malformed record, ...
            log.warning(
                "fusionflow: the decoded-image cache could not be set up (%r); this loader runs without it", exc
            )
            return None

    def handle(self, wid: int) -> CacheHandle:
        rows = self.rows
        return CacheHandle(self.store.fd, rows[wid] if wid < len(rows) - 1 else None, self.fill_share)

    def reader(self):
        """The training process's own CacheReader (num_workers=0)."""
        if self._reader is None:
            from fusionflow.cache.reader import CacheReader

            self._reader = CacheReader(self.store, self.rows[-1] if self.rows else None, self.fill_share)
        return self._reader

    @property
    def keeper_pid(self) -> int | None:
        """The node's keeper process serving this cache (None: a private cache)."""
        return self.link.keeper_pid if self.link is not None else None

    def counts(self) -> dict | None:
        """This loader's counters and the cache's size; None once closed."""
        return self.store.counts(self.rows) if self.store is not None else None

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
        fd = store.fd
        store.close()
        os.close(fd)
        if self.link is not None:
            self.link.close()


def _private(spec: DecodedCache, entries: int) -> CacheStore:
    fd = keeper.segment(spec.path)
    try:
        return CacheStore.create(fd, entries, spec.size, spec.max_side, spec.admission)
    except BaseException:
        os.close(fd)
        raise
