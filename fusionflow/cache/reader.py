"""One process's use of the decoded-image cache: `CacheReader`, the `cache=` a CpuPipeline is given.

Encoded samples only: a dataset that returns arrays or PIL images has nothing to decode. A sample the
cache does not hold and will not take (full, or not admitted) takes the uncached path (`source` gives
None), so a full cache costs the lookup only. The image work (the reduced decode, the crop from the
cached image) is fusionflow/ops/cached.py's.
"""

from __future__ import annotations

import time

import numpy as np

from fusionflow.cache import store as st
from fusionflow.ops.cached import decode_reduced
from fusionflow.ops.decode import check_pixels


class CacheReader:
    """One process's use of the cache: lookups, fills, and its counter row (only it writes there)."""

    def __init__(self, store: st.CacheStore, row: int | None, fill_share: float | None = None):
        """`row`: this process's counter row (None: not counted); `fill_share`: DecodedCache's pacing."""
        self.store, self.max_side, self.fill_share = store, store.max_side, fill_share
        self.row = store.rows[row] if row is not None else np.zeros(st.ROW_FIELDS, np.int64)
        self._fill_ns, self._started = 0, None

    def source(self, data, index: int, what=None, max_pixels: int | None = None):
        """(image at the cache's resolution, (source h, w), hit) for encoded `data`, from the cache or
        decoded and filled now; None: take the uncached path (not encoded, or the cache will not take it)."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or not 0 <= index < self.store.entries_count:
            return None
        row = self.row
        got = self.store.get(index, len(data))
        if got is not None:
            img, source, decode_ns = got
            check_pixels(source[1], source[0], max_pixels, what)
            row[st.R_HITS] += 1
            row[st.R_SAVED_NS] += decode_ns
            return img, source, True
        row[st.R_MISSES] += 1
        if not self.store.wants(index) or not self._may_fill():
            return None
        t0 = time.perf_counter_ns()
        img, source = decode_reduced(data, self.max_side, what, max_pixels)
        spent = time.perf_counter_ns() - t0
        try:
            view = self.store.claim(index, img.shape, source, len(data), spent)
            if view is not None:
                view[...] = img
                self.store.publish(index)
                row[st.R_FILLS] += 1
                row[st.R_FILL_BYTES] += img.nbytes
        except TimeoutError:
            pass  # the lock's holder is stopped: this sample stays uncached (a later epoch may fill it)
        row[st.R_FILL_NS] += spent
        self._fill_ns += time.perf_counter_ns() - t0  # pacing counts the claim and the copy too
        return img, source, False

    def _may_fill(self) -> bool:
        """Paced filling (`fill_share`): whether this process's whole-image decodes so far leave room for
        one more within that share of its time since its first lookup."""
        if self.fill_share is None:
            return True
        now = time.perf_counter_ns()
        if self._started is None:
            self._started = now
        return self._fill_ns <= self.fill_share * (now - self._started)

    def hit_time(self, ns: int) -> None:
        self.row[st.R_HIT_NS] += ns
