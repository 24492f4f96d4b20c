"""A loader's tiny-batch queue, pure: no threads, processes, clocks or I/O. Its caller (the board,
runtime/board.py, which the local manager is) holds the lock that guards it and passes the time in.

Per mini-batch, keyed (generation, seq) and oldest first, its tiny-batches sorted ascending by
encoded size (scheduling/tiny_batches.py). CPU workers take from the front -- the oldest
mini-batch's smallest tiny-batch -- unless only the `reserved` largest are left (TAAS,
scheduling/taas.py); the accelerator takes from the back, largest first. Work given back (its worker
died, the accelerator could not run it) goes to the front of its mini-batch. Completions are
counted per mini-batch in its `BatchState`; a mini-batch stays tracked until the training loop
takes it (`forget`), or its iterator is abandoned (`forget_generation`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fusionflow.scheduling.taas import cpu_may_take
from fusionflow.scheduling.tiny_batches import TinyBatch

Key = tuple[int, int]  # (generation, seq): generations order iterators, seqs mini-batches within one
RAN_AHEAD = math.inf  # share_taken of a mini-batch whose whole share is taken (or ran in an earlier one's run)
positions_of, _first = operator.attrgetter("positions"), operator.itemgetter(0)
key_of = operator.attrgetter("generation", "seq")  # Work.key, as one C-level call (map(key_of, works))


def accel_order(q, largest_first: bool) -> list:
    """`q`'s tiny-batches the accelerator may run (not marked CPU-only), largest first (smallest with
    `largest_first` False): where its take, merge and borrow choose from."""
    return [w for w in q if not w.cpu_only][:: -1 if largest_first else 1]


def images(works) -> int:
    """Samples in `works`, counted by C-level calls (the accelerator's paths take the same number of
    interpreter calls whatever a run's size: issue 41's feeder bar)."""
    return sum(map(len, map(positions_of, works)))


@dataclass(eq=False)
class Work:
    """One tiny-batch to run: which ring slot, which positions of the mini-batch, which samples. Compared
    by identity: each is one piece of work (a rerun's copies are told apart by it), and the queue's and the
    accelerator's list searches stay one pointer test per element."""

    seq: int
    generation: int
    slot: int
    epoch: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]
    deaths: int = 0
    cpu_only: bool = False  # the accelerator gave it back (e.g. it could not decode it): CPU workers only
    copies: tuple[int, ...] = ()  # per sample, for repeated augmentation; () when all are 0

    @property
    def key(self) -> Key:
        return (self.generation, self.seq)

    def singles(self) -> list[Work]:
        """This tiny-batch as one-sample tiny-batches (a retry that isolates the sample at fault),
        carrying its death count."""
        copies = self.copies or (0,) * len(self.positions)
        return [
            Work(self.seq, self.generation, self.slot, self.epoch, (p,), (i,), self.deaths, copies=(c,) if c else ())
            for p, i, c in zip(self.positions, self.indices, copies)
        ]


@dataclass
class BatchState:
    seq: int
    slot: int
    size: int
    remaining: int
    failures: list = field(default_factory=list)
    error: BaseException | None = None
    submitted_at: float = 0.0
    cpu_done_at: float = 0.0  # when its last CPU / accelerator tiny-batch completed (0: none ran there)
    accel_done_at: float = 0.0
    accel_positions: list = field(default_factory=list)  # positions the accelerator produced
    targets: dict = field(default_factory=dict)  # {position: target} not in the ring (runtime/targets.py)


class TinyBatchQueue:
    def __init__(self):
        self.queues: dict[Key, deque[Work]] = {}  # insertion order = age: oldest mini-batch first
        self.batches: dict[Key, BatchState] = {}
        self.reserved = 0  # TAAS's K: the largest tiny-batches of a mini-batch left to the accelerator
        self.share_taken: dict[Key, float] = {}  # per mini-batch, its share's tiny-batches taken (RAN_AHEAD: all)
        self.awaited: Key | None = None  # the mini-batch the training loop is waiting for, while it waits
        self.steal = False  # CPU workers with nothing else take from shares the accelerator has not taken
        self.final_shares = False  # a share once taken stays taken when G grows (no top-up runs: `_took`)
        self.took_tail = False  # the accelerator's last run taken was a tail run (not a share: not its rate)
        self.credit: tuple | None = None  # (generation, epoch, mini-batches) whose shares ran ahead in a run
        self.newest_epoch = 0  # the epoch of the newest mini-batch queued (persistent workers: one iterator, many)

    def add(
        self,
        generation: int,
        seq: int,
        slot: int,
        epoch: int,
        tiny: Iterable[TinyBatch],
        size: int,
        submitted_at: float,
    ) -> BatchState:
        """Queue mini-batch `seq` of `generation` (its `size` samples as `tiny`, sorted ascending)."""
        state = BatchState(seq, slot, size, size, submitted_at=submitted_at)
        self.batches[(generation, seq)] = state
        self.newest_epoch = epoch
        if self.credit is not None:  # its share ran ahead, in the previous mini-batch's run: all CPU work
            owed_by, owed = self.credit[:2], self.credit[2] - 1
            if owed_by == (generation, epoch):
                self.share_taken[(generation, seq)] = RAN_AHEAD
            self.credit = (*owed_by, owed) if owed and owed_by == (generation, epoch) else None
        self.queues[(generation, seq)] = deque(
            Work(seq, generation, slot, epoch, t.positions, t.indices, copies=t.copies) for t in tiny
        )
        return state

    def take_cpu(self, upto: Key | None = None) -> Work | None:
        """The oldest mini-batch's smallest tiny-batch that CPU workers may take (of mini-batches no
        newer than `upto`, if given); with `steal`, when there is none, the smallest of the oldest share
        the accelerator has not taken (one less for it to take)."""
        for key, q in self.queues.items():
            if upto is not None and key > upto:
                break
            if q and (q[0].cpu_only or cpu_may_take(len(q), self._share_left(key))):
                return q.popleft()
        if not self.steal:
            return None
        # Nothing else left: the smallest of a share the accelerator has not taken yet, oldest first --
        # the split is an estimate, and a CPU worker left idle is throughput lost either way.
        for key, q in self.queues.items():
            if upto is not None and key > upto:
                break
            if q and self._share_left(key):
                self._took(key, 1)
                return q.popleft()
        return None

    def take_accel(
        self,
        largest_first: bool = True,
        max_images: int = 0,
        tail_fraction: float | None = None,
        merge: int = 1,
        borrow: bool = False,
    ) -> list[Work]:
        """The accelerator's next run, [] when there is none.

        First its share of a mini-batch, in one run (more only above `max_images` samples), oldest
        mini-batch first, so it runs ahead of the one training waits for: the `reserved` largest
        tiny-batches (TAAS's K, from the split rule's G) of a mini-batch whose share it has not
        taken. Once taken, that mini-batch's other tiny-batches are the CPU workers'. With `merge`
        > 1, the whole shares of the next mini-batches (of the same iterator and epoch) join the run,
        up to `merge` shares and `max_images` samples -- a run's fixed cost paid once for them --
        unless training is waiting for the first one; with `borrow`, when none is queued yet, the
        next shares are taken ahead from this mini-batch (`_borrowed`).
        Then, with `tail_fraction`, a tail run when the CPU side is late: the largest unstarted
        tiny-batches of the mini-batch training is waiting for (`awaited`), that fraction of them
        (at least one; none when the fraction is 0: a run's fixed cost would hold up training).
        Without `tail_fraction` (the ablations: no split, or FIFO), the oldest mini-batch's largest
        tiny-batch (its smallest with `largest_first` False), as before shares."""
        self.took_tail = False
        for key, q in self.queues.items():
            left = self._share_left(key)
            if not left:  # a share partly taken (cut by the run cap, or stolen) that G has since shrunk to: done
                if self.final_shares and self.share_taken.get(key, RAN_AHEAD) < RAN_AHEAD:  # (once, not every take)
                    self._took(key, 0)
                continue
            group = self._largest(q, largest_first, left, max_images)
            self._took(key, len(group) or left)  # none left to take: done
            if group:
                if merge > 1 and key != self.awaited:
                    more = self._merged(key, group, largest_first, max_images, merge - 1)
                    if not more and borrow:
                        more = self._borrowed(key, q, group, largest_first, max_images, merge - 1)
                    group += more
                return group
        if tail_fraction is None:
            for q in self.queues.values():
                if group := self._largest(q, largest_first, 1, max_images):
                    return group
            return []
        q = self.queues.get(self.awaited) if self.awaited is not None else None
        if not q or tail_fraction <= 0:  # no share: the split rule left the device to training, tails too
            return []
        unstarted = len([w for w in q if not w.cpu_only])
        group = self._largest(q, largest_first, max(1, math.ceil(unstarted * tail_fraction)), max_images)
        self.took_tail = bool(group)
        return group

    def _merged(self, first: Key, group: list[Work], largest_first: bool, max_images: int, shares: int) -> list[Work]:
        """Up to `shares` whole shares of the mini-batches after `first` (its iterator and epoch) that fit
        in `max_images` beside `group`."""
        taken, more, epoch = images(group), [], group[0].epoch
        for key, q in self.queues.items():
            if key <= first or not q:
                continue
            left = self._share_left(key)
            if shares < 1 or key[0] != first[0] or q[0].epoch != epoch:
                break
            if not left:
                continue
            candidates = accel_order(q, largest_first)[:left]
            size = images(candidates)
            if len(candidates) < left or taken + size > max_images:
                break
            more += self._largest(q, largest_first, left, max_images)
            self._took(key, left)
            taken, shares = taken + size, shares - 1
        return more

    def _borrowed(self, key: Key, q: deque, group: list[Work], largest_first: bool, max_images: int, shares: int):
        """With no next share queued to merge, the next `shares` mini-batches' shares taken ahead from this
        one's largest (whole tiny-batches, one at least left to the CPU workers, within `max_images`), and
        owed: the next mini-batches added, of its iterator and epoch, are the CPU workers' alone
        (`credit`, in whole shares). A run's fixed cost is paid once for two shares and the work on each side stays the
        same. Only for the newest mini-batch with `shares` + 1 queued before it: its run, twice as long,
        is still done before training reaches it (beside the accelerator's other runs in flight)."""
        keys = list(self.queues)
        if keys[-1] != key or len(keys) <= shares + 1 or self.credit is not None:
            return []
        candidates = accel_order(q, largest_first)
        room = max_images - images(group)
        owed = max(0, min(len(candidates) - 1, shares * self.reserved)) // self.reserved if self.reserved else 0
        while owed and images(candidates[: owed * self.reserved]) > room:
            owed -= 1
        if not owed:
            return []
        more = self._largest(q, largest_first, owed * self.reserved, room)
        self._took(key, len(more))
        self.credit = (key[0], group[0].epoch, owed)
        return more

    @staticmethod
    def _largest(q: deque, largest_first: bool, count: int, max_images: int) -> list[Work]:
        """Remove and return up to `count` of `q`'s tiny-batches the accelerator may run, largest first
        (smallest with `largest_first` False), within `max_images` samples (at least one tiny-batch)."""
        candidates = accel_order(q, largest_first)[:count]
        # the longest prefix within max_images, at least one: found by C-level calls, not a loop of calls
        running = list(itertools.accumulate(map(len, map(positions_of, candidates))))
        group = candidates[: max(1, bisect.bisect_right(running, max_images))] if candidates else []
        if group:  # one pass, not a search per work taken (works hash by identity)
            taken = set(group)
            kept = [w for w in q if w not in taken]
            q.clear()
            q.extend(kept)
        return group

    def requeue(self, works: Iterable[Work]) -> None:
        """Put work back at the front of its mini-batch's queue, in the given order (it was
        interrupted); work of a mini-batch no longer tracked is dropped."""
        for work in reversed(list(works)):
            q = self.queues.get(work.key)
            if q is not None:
                q.appendleft(work)

    def complete(
        self, done: list[tuple[Work, dict | None]], failures, on_accelerator: bool, now: float
    ) -> list[BatchState]:
        """Count finished tiny-batches (`done`: (work, its {position: target} not in the ring, or None),
        `failures` the first one's); the states of their mini-batches still tracked, each once, in order
        (one is done when its `remaining` is 0). The loop's body makes no calls: an accelerator run's many
        tiny-batches cost the interpreter calls of one (issue 41's feeder bar)."""
        if failures and len(done) != 1:
            raise ValueError(f"failures come with one tiny-batch, not {len(done)}")
        states, batches = {}, self.batches  # by key: a mini-batch met again (A, B, A) is one state
        for (work, targets), count in zip(done, map(len, map(positions_of, map(_first, done)))):
            key = (work.generation, work.seq)
            state = batches[key] if key in batches else None
            if state is None:
                continue
            if failures:
                state.failures += failures
            if targets:
                state.targets |= targets
            state.remaining -= count
            if on_accelerator:
                state.accel_done_at = now
                state.accel_positions += work.positions
            else:
                state.cpu_done_at = now
            states[key] = state
        return list(states.values())

    def tracks(self, work: Work) -> bool:
        return work.key in self.batches

    def forget(self, key: Key) -> None:
        """The training loop took this mini-batch (or gave it up)."""
        self.batches.pop(key, None)
        self.queues.pop(key, None)
        self.share_taken.pop(key, None)

    def forget_generation(self, generation: int) -> None:
        """An iterator stopped early: forget its unfinished mini-batches."""
        if self.credit is not None and self.credit[0] == generation:
            self.credit = None
        for key in [k for k in self.batches if k[0] == generation]:
            self.forget(key)

    def current_key(self) -> Key | None:
        """The oldest mini-batch with samples still to produce (a finished one stays queued until
        the training loop takes it)."""
        return next((k for k in self.queues if (st := self.batches.get(k)) is not None and st.remaining > 0), None)

    def waiting(self, key: Key | None) -> int:
        """Tiny-batches of mini-batch `key` that no worker has started and CPU workers may take."""
        return max(0, len(self.queues[key]) - self._share_left(key)) if key is not None else 0

    def _took(self, key: Key, count: int) -> None:
        """`count` more tiny-batches of mini-batch `key`'s share taken (by the accelerator, or stolen by a CPU
        worker). With `final_shares` (a shared device: a GPU), once the whole share is, as reserved now, it stays
        taken whatever later reservations say (as a share partly taken that a smaller G completes: `take_accel`):
        the split rule raising G by one after the accelerator took a share gave it a run of that one tiny-batch,
        a run's fixed cost (~170 samples' work on a GPU) for 4 samples -- a third of the runs in the twin at 3
        runs in flight, 2026-11-28. On DALI's CPU backend such a run costs ~3 samples' work and moves work to its
        threads, so the rule is off there (with it, the CPU proof at batch 256 read X 0.94x, 6 runs a side)."""
        taken = self.share_taken.get(key, 0) + count
        self.share_taken[key] = RAN_AHEAD if taken >= self.reserved and self.final_shares else taken

    def _share_left(self, key: Key) -> int:
        """Tiny-batches of mini-batch `key`'s share that the accelerator has yet to take."""
        return max(0, self.reserved - self.share_taken.get(key, 0))
