"""One process's use of the decoded-image cache: `CacheReader`, the `cache=` a CpuPipeline is given.

Encoded samples only: a dataset that returns arrays or PIL images has nothing to decode. A sample the
cache does not hold and will not take (full, or not admitted) takes the uncached path (`source` gives
None), so a full cache costs the lookup only. The image work (the reduced decode, the crop from the
cached image) is fusionflow/ops/cached.py's.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from fusionflow.cache import store as st
from fusionflow.cache.crops import crop_tag
from fusionflow.errors import DecodeError
from fusionflow.ops.cached import decode_reduced
from fusionflow.ops.decode import check_pixels

log = logging.getLogger("fusionflow.cache")
PACE_BURST_NS = 200_000_000  # paced filling: at most 0.2 s of fills saved up
AUTO_SHARE = 0.1  # fill_share="auto": the share of time a process fills while its training loop waits
FILL_BACKOFF_S = 5.0  # a fill that found the lock held by a stopped process (or busy): no fill tried for this long


class CacheReader:
    """One process's use of the cache: lookups, fills, and its counter row (only it writes there).

    A fault of the cache itself (a lock the filesystem refuses, a store closed under a running
    iterator, ...) never fails a sample: the sample takes the uncached path, and so does every later
    one of this process, said once in the log. A sample's own fault (a corrupt file) takes the
    uncached path too, which reports it as it always does."""

    def __init__(self, store: st.CacheStore, row: int | None, fill_share: float | str | None = None, crops=None):
        """`row`: this process's counter row (None: not counted); `fill_share`: DecodedCache's pacing;
        `crops`: the loader's CropStore when crops are reused (refurbishing), else None."""
        self.store, self.max_side, self.fill_share, self.crops = store, store.max_side, fill_share, crops
        self.row = store.rows[row] if row is not None else np.zeros(st.ROW_FIELDS, np.int64)
        if row is None:  # uncounted (the node's table full): paced, as fill_share="auto" starts (R_PACE 1)
            self.row[st.R_PACE] = 1
        self.broken: str | None = None  # why this process stopped using the cache
        self._fill_ns, self._started = 0, None  # fill time so far; the first lookup's time
        self._credit, self._last = 0.0, None  # paced filling: fill time allowed now (ns)
        self._fill_after = 0  # perf_counter_ns before which no fill is tried (the lock's holder was stopped), or 0

    def source(self, data, index: int, what=None, max_pixels: int | None = None):
        """(image at the cache's resolution, (source h, w), hit) for encoded `data`, from the cache or
        decoded and filled now; None: take the uncached path (not encoded, the cache will not take it,
        or a fault)."""
        if self.broken is not None or not isinstance(data, (bytes, bytearray, memoryview)):
            return None
        try:
            return self._source(data, index, what, max_pixels)
        except DecodeError:
            return None  # the sample's own fault: the uncached path reports it (or decodes its window)
        except Exception as exc:
            self.broken = repr(exc)
            log.warning(
                "fusionflow: the decoded-image cache failed in process %d (%r); it runs uncached", os.getpid(), exc
            )
            return None

    def _source(self, data, index: int, what, max_pixels):
        if not 0 <= index < self.store.entries_count:
            return None
        row = self.row
        content = st.content_key(data)
        got = self.store.get(index, content)
        if got is not None:
            img, source, decode_ns = got
            check_pixels(source[1], source[0], max_pixels, what)
            row[st.R_HITS] += 1
            row[st.R_SAVED_NS] += decode_ns
            return img, source, True
        row[st.R_MISSES] += 1
        backing_off = self._fill_after and time.perf_counter_ns() < self._fill_after
        if self.store.being_written(index) or (backing_off and self.store.wants(index)):
            # another process fills it (or this one would, but for the lock): rendered as the entry will hold it, so
            # its pixels are every later epoch's (the uncached path's differ within the cache's bound)
            return (*decode_reduced(data, self.max_side, what, max_pixels), False)
        if backing_off or not self.store.wants(index) or not self._may_fill():
            return None
        t0 = time.perf_counter_ns()
        img, source = decode_reduced(data, self.max_side, what, max_pixels)
        spent = time.perf_counter_ns() - t0
        try:
            view = self.store.claim(index, img.shape, source, content, spent)
            if view is not None:
                view[...] = img
                self.store.publish(index)
                row[st.R_FILLS] += 1
                row[st.R_FILL_BYTES] += img.nbytes
        except TimeoutError:  # the lock's holder is stopped (a paused job's worker): uncached, no fill for a while
            self._fill_after = time.perf_counter_ns() + int(FILL_BACKOFF_S * 1e9)
        row[st.R_FILL_NS] += spent
        took = time.perf_counter_ns() - t0  # pacing counts the claim and the copy too
        self._fill_ns += took
        self._credit -= took
        return img, source, False

    def _may_fill(self) -> bool:
        """Paced filling (`fill_share`): a token bucket of fill time, earning `fill_share` of the time
        that passes and holding at most PACE_BURST_NS, so time spent idle (an evaluation, a pause
        between epochs) cannot be spent later as one long burst of fills. "auto": every fill while the
        loader says its training loop does not wait (R_PACE 0), AUTO_SHARE while it does."""
        share = self.fill_share
        if share is None:
            return True
        now = time.perf_counter_ns()
        if self._last is None:
            self._started = self._last = now
        if share == "auto":
            if not self.row[st.R_PACE]:
                self._credit, self._last = 0.0, now  # filling freely: pacing, when it starts, starts even
                return True
            share = AUTO_SHARE
        self._credit = min(PACE_BURST_NS, self._credit + share * (now - self._last))
        self._last = now
        return self._credit >= 0

    def kept_crop(self, index: int, d, data):
        """Sample `index`'s cropped image kept for draw `d`'s crop of these encoded bytes (refurbishing), a copy, or
        None."""
        if self.crops is None or self.broken is not None:
            return None
        got = self.crops.get(index, crop_tag(d, _content(data)))
        if got is not None:
            self.row[st.R_CROP_HITS] += 1
        return got

    def keep_crop(self, index: int, d, data, arr) -> None:
        if self.crops is not None and self.broken is None:
            self.crops.put(index, crop_tag(d, _content(data)), arr)

    def hit_time(self, ns: int) -> None:
        self.row[st.R_HIT_NS] += ns


def _content(data) -> int:
    """The content key of an encoded sample (0 for a decoded one: an array or an image, kept by index alone)."""
    return st.content_key(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
