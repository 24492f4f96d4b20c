"""The decoded-image cache's memory: one shared segment that every process using the cache maps.

Layout (int64 words unless said; all C-contiguous, in one mapping):

    header   [HEADER]              magic, version, entries, arena offset and size, bump, reserved, ...
    hist     [BINS]                bytes of the samples seen so far, per admission score bin
    kept     [BINS]                bytes admitted, per score bin
    rows     [ROWS, ROW_FIELDS]    per-worker counters (a row per CPU worker of each loader; see `Row`)
    entries  [n, ENTRY_FIELDS]     one per dataset index: state, offset, cached and source size, ...
    arena    [size]                the decoded images, uint8 HWC RGB, 64-byte aligned, bump-allocated

Concurrency: a claim (admission, allocation, marking the entry WRITING with the writer's pid) and a
publication (marking it READY) happen under a POSIX record lock on the segment's descriptor
(`fcntl.lockf`), which the kernel drops when its holder dies -- a worker SIGKILLed under the lock
blocks nobody. Pixels are written outside the lock, between the claim and the publication, so a
reader sees an entry only once it is complete: it reads the state word first, and a READY entry
never changes again (entries are never evicted). An entry left WRITING by a dead writer is claimed
again by the next process that decodes that sample; the bytes it had claimed stay unused.
(Ordering: the pixels are stored before the state word, and the publication's lock call is a full
barrier on the writer's side; a reader on x86 sees them in that order. On a weakly ordered CPU
(aarch64) the reader has no acquire barrier between the state word and the pixels: not observed,
not proven.)

Pages are reserved (posix_fallocate) in CHUNK steps as the bump pointer passes them, under the
lock: a node that runs out of memory makes the cache full (admission stops), never a SIGBUS.

Admission (`score` mode): a sample's score is its decode time per stored byte. Every sample seen for
the first time adds its bytes to the histogram of scores; from it and the dataset's length, the
bytes of the better-scoring samples still to come are estimated, and a sample is admitted only if
it fits beside that reserve -- so a budget below the dataset keeps what saves the most decode time
per byte, the marginal score bin first come. `first` mode admits whatever comes while room is left
(the baseline the bench compares with).
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
import zlib

import numpy as np

from fusionflow.cache import record_lock
from fusionflow.runtime.procs import pid_alive
from fusionflow.runtime.shm import allocate, disown_fd, own_fd

MAGIC = 0x46464443_41434845  # "FFDCACHE"
VERSION = 3  # 3: E_CONTENT holds `content_key` (2: the encoded length alone)
HEADER = 32
BINS = 64
ROWS = 256
ROW_FIELDS = 10
ENTRY_FIELDS = 8
ALIGN = 64
CHUNK = 64 << 20  # pages reserved per step as the arena fills
FULL_BELOW = 1 << 20  # the cache counts as full (no more fills tried) with less room than this

# header words
H_MAGIC, H_VERSION, H_ENTRIES, H_ARENA_OFF, H_ARENA_SIZE, H_BUMP, H_RESERVED = range(7)
H_READY, H_READY_BYTES, H_MAX_SIDE, H_ADMISSION, H_SEEN, H_SEEN_BYTES, H_FULL, H_REFUSED = range(7, 15)
# entry fields
E_STATE, E_OFFSET, E_SHAPE, E_SOURCE, E_CONTENT, E_DECODE_NS, E_PID, E_NBYTES = range(ENTRY_FIELDS)
EMPTY, WRITING, READY, PASSED = 0, 1, 2, 3  # PASSED: seen, not admitted (counted in the histogram once)
# row fields: a worker adds to its own row only (no lock): pid, then counters; R_PACE alone is written by
# the row's loader (1 while its training loop waits for it: fill_share="auto" paces, attach.FillPacer)
R_PID, R_HITS, R_MISSES, R_HIT_NS, R_SAVED_NS, R_FILLS, R_FILL_BYTES, R_FILL_NS, R_CROP_HITS, R_PACE = range(10)
ADMISSIONS = ("score", "first")
# score bins: log2(ns per byte) from 2**-8 to 2**8, four bins per octave
_BIN_LO, _BIN_STEP = -8.0, 0.25


KEY_SPAN = 4096  # bytes of each end of an encoded sample in its content key


def content_key(data) -> int:
    """What an entry is checked against: the encoded sample's length and a CRC-32 of its first and last KEY_SPAN
    bytes (all of it when shorter). A file replaced under the same index -- by another image of the same length
    too -- is not served the old pixels. An edit confined to the middle that keeps the length is not seen: bytes
    overwritten in place (bit rot, a partial write), in any format, or a re-saved uncompressed file (BMP, PPM);
    such a file is served its cached pixels and, if now corrupt, not reported. ~4 us a sample, not the ~60 of a
    whole 110 KB file's CRC."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    n = len(view)
    crc = zlib.crc32(view) if n <= 2 * KEY_SPAN else zlib.crc32(view[n - KEY_SPAN :], zlib.crc32(view[:KEY_SPAN]))
    return (n << 32) | crc


def segment_bytes(entries: int, size: int) -> int:
    return _arena_offset(entries) + size


def _arena_offset(entries: int) -> int:
    words = HEADER + 2 * BINS + ROWS * ROW_FIELDS + entries * ENTRY_FIELDS
    return -(-words * 8 // ALIGN) * ALIGN


def _bin(score: float) -> int:
    if score <= 0:
        return 0
    return int(min(BINS - 1, max(0, (math.log2(score) - _BIN_LO) / _BIN_STEP)))


class CacheStore:
    """A mapping of the cache segment from its descriptor `fd` (kept open: the record lock lives on it).

    `CacheStore.create(fd, entries, size, max_side, admission)` lays out a new, zero-filled segment;
    `CacheStore(fd)` maps an existing one."""

    def __init__(self, fd: int):
        self.fd = fd
        total = os.fstat(fd).st_size
        self._map, map_fds = map_shared(fd, total)
        # the mmap's own descriptor leaves the owned set when this store is closed or collected, before
        # its number can be reused (a forked worker closes every owned number)
        self._disown = weakref.finalize(self, disown_all, map_fds)
        if hasattr(mmap, "MADV_DONTFORK"):  # forked workers map their own loader's cache from its descriptor
            self._map.madvise(mmap.MADV_DONTFORK)
        words = np.frombuffer(self._map, np.int64, count=HEADER)
        if words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
            self._map.close()
            raise ValueError("not a FusionFlow decoded-image cache segment (or another version's)")
        n = int(words[H_ENTRIES])
        self.entries_count = n
        at = HEADER * 8
        self.header = words
        self.hist = np.frombuffer(self._map, np.int64, BINS, at)
        self.kept = np.frombuffer(self._map, np.int64, BINS, at + BINS * 8)
        at += 2 * BINS * 8
        self.rows = np.frombuffer(self._map, np.int64, ROWS * ROW_FIELDS, at).reshape(ROWS, ROW_FIELDS)
        at += ROWS * ROW_FIELDS * 8
        self.entries = np.frombuffer(self._map, np.int64, n * ENTRY_FIELDS, at).reshape(n, ENTRY_FIELDS)
        self.arena_offset = int(words[H_ARENA_OFF])
        self.size = int(words[H_ARENA_SIZE])
        self.max_side = int(words[H_MAX_SIDE])
        self.admission = ADMISSIONS[int(words[H_ADMISSION])]
        self._arena = np.frombuffer(self._map, np.uint8, self.size, self.arena_offset)
        self._unpublished: list[int] = []  # entries written whose publish met a stopped lock holder: `_publish_now`

    @classmethod
    def create(cls, fd: int, entries: int, size: int, max_side: int, admission: str = "score") -> CacheStore:
        """Size the segment behind `fd` (zero pages until touched) and write its header. The arena's
        pages are reserved as it fills (`claim`)."""
        off = _arena_offset(entries)
        os.ftruncate(fd, off + size)
        allocate(fd, 0, off)
        head = np.zeros(HEADER, np.int64)
        head[[H_MAGIC, H_VERSION, H_ENTRIES, H_ARENA_OFF, H_ARENA_SIZE]] = [MAGIC, VERSION, entries, off, size]
        head[H_MAX_SIDE], head[H_ADMISSION], head[H_RESERVED] = max_side, ADMISSIONS.index(admission), 0
        os.pwrite(fd, head.tobytes(), 0)
        return cls(fd)

    def close(self) -> None:
        with record_lock.threads():  # not while a thread of this process holds the record lock
            self._close()

    def _close(self) -> None:
        self.header = self.hist = self.kept = self.rows = self.entries = self._arena = None
        self._disown()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a cached image's view still referenced: the OS unmaps at exit
                pass
            self._map = None

    def _locked(self, bound: float | None = None):
        """The segment's record lock (cache/record_lock.py): TimeoutError past `bound` or once its holder is seen
        stopped, and the caller gives up that fill, publication or count."""
        return record_lock.locked(self.fd, bound)

    # ------------------------------------------------------------------ reading (no lock)
    def get(self, index: int, content: int):
        """(cached image view HWC uint8, (source height, source width), decode ns) of a READY entry
        whose `content_key` matches the sample's, else None (a file replaced under the same index)."""
        e = self.entries[index]
        if e[E_STATE] != READY or e[E_CONTENT] != content:
            return None
        shape, source = int(e[E_SHAPE]), int(e[E_SOURCE])
        h, w = shape >> 32, shape & 0xFFFFFFFF
        off = int(e[E_OFFSET])
        img = self._arena[off : off + h * w * 3].reshape(h, w, 3)
        return img, (source >> 32, source & 0xFFFFFFFF), int(e[E_DECODE_NS])

    def wants(self, index: int) -> bool:
        """Whether decoding sample `index` for the cache may pay (read without the lock; `claim` decides):
        not READY, not being written by a live process, the cache not full, and a sample passed over
        before only if its score would be admitted now."""
        e = self.entries[index]
        state = int(e[E_STATE])
        if state == READY or self.header[H_FULL] or self.being_written(index):
            return False
        nbytes = int(e[E_NBYTES])
        return state != PASSED or self._admits(int(e[E_DECODE_NS]) / max(1, nbytes), nbytes)

    def being_written(self, index: int) -> bool:
        """Whether a live process is writing sample `index`'s entry (read without the lock): it will hold the sample
        at the cache's resolution, as every later epoch reads it."""
        e = self.entries[index]
        return int(e[E_STATE]) == WRITING and pid_alive(int(e[E_PID]))

    # ------------------------------------------------------------------ filling (under the lock)
    def claim(self, index: int, shape, source, content: int, decode_ns: int):
        """Room for sample `index`'s decoded image of `shape` (h, w, 3): the arena view to write it into
        (then `publish(index)`), or None (another process has it or is writing it, not admitted, or the
        cache is full)."""
        h, w = int(shape[0]), int(shape[1])
        nbytes = h * w * 3
        score = decode_ns / max(1, nbytes)
        me = os.getpid()
        with self._locked(record_lock.FILL_LOCK_S):
            self._publish_now()
            e, head = self.entries[index], self.header
            state = int(e[E_STATE])
            if state == READY or (state == WRITING and pid_alive(int(e[E_PID]))):
                return None
            if state == EMPTY:  # first sight: into the histogram the threshold is read from
                head[H_SEEN] += 1
                head[H_SEEN_BYTES] += nbytes
                self.hist[_bin(score)] += nbytes
            elif state == WRITING:  # its writer died: what it had claimed is not kept
                self.kept[_bin(int(e[E_DECODE_NS]) / max(1, int(e[E_NBYTES])))] -= int(e[E_NBYTES])
            if head[H_FULL] or not self._admits(score, nbytes):
                return self._pass(e, decode_ns, nbytes)
            start = int(head[H_BUMP])
            end = start + nbytes
            if end > self.size or not self._reserved_to(end):
                if self.size - start < FULL_BELOW or end <= self.size:  # nearly no room, or no memory left
                    head[H_FULL] = 1
                return self._pass(e, decode_ns, nbytes)
            head[H_BUMP] = -(-end // ALIGN) * ALIGN
            self.kept[_bin(score)] += nbytes
            head[H_REFUSED] -= state == PASSED  # passed over before, admitted now
            e[[E_OFFSET, E_SHAPE, E_SOURCE, E_CONTENT, E_DECODE_NS, E_PID, E_NBYTES]] = [
                start,
                (h << 32) | w,
                (int(source[0]) << 32) | int(source[1]),
                content,
                decode_ns,
                me,
                nbytes,
            ]
            e[E_STATE] = WRITING
        return self._arena[start:end].reshape(h, w, 3)

    def _pass(self, e, decode_ns: int, nbytes: int) -> None:
        """(lock held) Not admitted: remember its score for a later epoch's `wants`; H_REFUSED counts samples
        passed over and not admitted since (not each time one is)."""
        self.header[H_REFUSED] += int(e[E_STATE]) != PASSED
        e[E_DECODE_NS], e[E_NBYTES], e[E_STATE] = decode_ns, nbytes, PASSED

    def publish(self, index: int) -> None:
        """The claimed entry's pixels are written: make it visible. A lock holder seen stopped ends the wait
        (TimeoutError): the entry is published under the next lock this process takes (`claim`, `claim_rows`,
        `release_rows`) -- left WRITING under a live pid, every process would pass it by for good."""
        self._unpublished.append(index)
        with self._locked():
            self._publish_now()

    def _publish_now(self) -> None:
        """(lock held) Publish what this process wrote (`publish`)."""
        me = os.getpid()
        for index in self._unpublished:
            e = self.entries[index]
            if e[E_STATE] == WRITING and e[E_PID] == me:
                e[E_STATE] = READY
                self.header[H_READY] += 1
                self.header[H_READY_BYTES] += e[E_NBYTES]
        self._unpublished.clear()

    def _admits(self, score: float, nbytes: int) -> bool:
        """Room for this sample once the room the better-scoring samples still to come will want
        (estimated over the whole dataset from those seen, less what of theirs is in) is set aside."""
        head = self.header
        if self.admission == "first":
            return int(head[H_BUMP]) + nbytes <= self.size
        seen, seen_bytes = int(head[H_SEEN]), int(head[H_SEEN_BYTES])
        scale = self.entries_count / max(1, seen)  # the dataset's bytes estimated from the samples seen
        if seen_bytes * scale <= self.size:
            return True
        b = _bin(score) + 1
        wanted = max(0.0, float(self.hist[b:].sum()) * scale - float(self.kept[b:].sum()))
        return int(head[H_BUMP]) + nbytes + wanted <= self.size

    def _reserved_to(self, end: int) -> bool:
        reserved = int(self.header[H_RESERVED])
        if end <= reserved:
            return True
        new = min(self.size, -(-end // CHUNK) * CHUNK)
        try:
            allocate(self.fd, self.arena_offset + reserved, new - reserved)
        except OSError:
            return False
        self.header[H_RESERVED] = new
        return True

    # ------------------------------------------------------------------ accounting
    def claim_rows(self, count: int, owner: int) -> list[int]:
        """`count` counter rows for one loader's workers (freed by `release_rows`, or found free again
        when `owner`'s process is gone); fewer when the table is full."""
        got = []
        with self._locked():
            self._publish_now()
            for r in range(ROWS):
                if len(got) == count:
                    break
                pid = int(self.rows[r, R_PID])
                if pid == 0 or not pid_alive(pid):
                    self.rows[r] = 0
                    self.rows[r, R_PID] = owner
                    got.append(r)
        return got

    def release_rows(self, rows) -> None:
        if not rows and not self._unpublished:  # none claimed (the claim timed out): nothing to take the lock for
            return
        with self._locked():
            self._publish_now()
            for r in rows:
                self.rows[r] = 0

    def counts(self, rows) -> dict:
        """This loader's counters (summed over its rows) and the cache's own size."""
        mine = self.rows[list(rows)].sum(axis=0) if rows else np.zeros(ROW_FIELDS, np.int64)
        head = self.header
        return {
            "hits": int(mine[R_HITS]),
            "misses": int(mine[R_MISSES]),
            "fills": int(mine[R_FILLS]),
            "fill_bytes": int(mine[R_FILL_BYTES]),
            "hit_seconds": int(mine[R_HIT_NS]) / 1e9,
            "seconds_saved": int(mine[R_SAVED_NS]) / 1e9,
            "crop_hits": int(mine[R_CROP_HITS]),
            "entries": int(head[H_READY]),
            "bytes": int(head[H_READY_BYTES]),
            "budget": self.size,
            "refused": int(head[H_REFUSED]),
            "full": bool(head[H_FULL]),
        }


def map_shared(fd: int, size: int):
    """(mmap of `fd`, the descriptor Python's mmap duplicated for itself). That duplicate is registered
    with the runtime's owned descriptors, so a worker forked later (of any loader) closes it and keeps
    no closed cache's memory alive. Found as the descriptor of the same file that the call added to
    /proc/self/fd."""
    before = _same_file(fd)
    m = mmap.mmap(fd, size)
    extra = tuple(_same_file(fd) - before)
    for x in extra:
        own_fd(x)
    return m, extra


def disown_all(fds) -> None:
    for fd in fds:
        disown_fd(fd)


def _same_file(fd: int) -> set[int]:
    """This process's descriptors of the file `fd` is open on (none where there is no /proc)."""
    me = os.fstat(fd)
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
        if (st.st_dev, st.st_ino) == (me.st_dev, me.st_ino):
            found.add(int(name))
    return found
