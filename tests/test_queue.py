"""TinyBatchQueue (fusionflow/scheduling/queue.py): the two-ended tiny-batch queue, without a
manager, processes or shared memory."""

import itertools

import pytest

from fusionflow.scheduling.queue import BatchState, TinyBatchQueue, Work
from fusionflow.scheduling.tiny_batches import split_sorted


def queue_with(*batches, reserved=0, tiny_batch_size=1):
    """A queue holding one mini-batch per `batches` entry (a list of encoded sizes, one per sample;
    dataset index = position + 100 * its number), generation 1."""
    q = TinyBatchQueue()
    q.reserved = reserved
    for seq, sizes in enumerate(batches):
        indices = [100 * seq + p for p in range(len(sizes))]
        all_sizes = {i: s for i, s in zip(indices, sizes)}
        size_of = [all_sizes.get(i, 0) for i in range(max(indices) + 1)]
        q.add(
            1,
            seq,
            slot=seq,
            epoch=0,
            tiny=split_sorted(indices, size_of, tiny_batch_size),
            size=len(sizes),
            submitted_at=10.0 + seq,
        )
    return q


def accel(q, **kw):
    """The accelerator's single take (max_images 0: one tiny-batch per DALI run); None when none."""
    group = q.take_accel(**kw)
    assert len(group) <= 1
    return group[0] if group else None


def test_cpu_takes_the_oldest_mini_batch_smallest_first():
    q = queue_with([30, 10, 20], [5, 1])
    assert [q.take_cpu().indices for _ in range(5)] == [(1,), (2,), (0,), (101,), (100,)]
    assert q.take_cpu() is None


def test_accelerator_takes_the_oldest_mini_batch_largest_first():
    q = queue_with([30, 10, 20], [5, 1])
    assert [accel(q).indices for _ in range(5)] == [(0,), (2,), (1,), (100,), (101,)]
    assert accel(q) is None


def test_fifo_ablation_takes_the_smallest_on_the_accelerator():
    q = queue_with([30, 10, 20])
    assert accel(q, largest_first=False).indices == (1,)


def test_reserved_largest_are_left_to_the_accelerator():
    q = queue_with([30, 10, 20, 40], [7, 8], reserved=2)
    assert [q.take_cpu().indices for _ in range(2)] == [(1,), (2,)]  # 30 and 40 are the accelerator's
    assert q.take_cpu() is None  # mini-batch 1 is not reached: its 2 are reserved too
    assert accel(q).indices == (3,)
    assert q.take_cpu() is None  # one left of mini-batch 0, inside the reservation


def test_given_back_work_is_cpu_only_and_skips_the_reservation():
    q = queue_with([30, 10, 20], reserved=3)
    work = accel(q)
    work.cpu_only = True
    q.requeue([work])
    assert accel(q).indices == (2,)  # the accelerator does not get it again
    assert q.take_cpu().indices == (0,)  # CPU workers do, although 3 are reserved


def test_accelerator_group_is_the_reserved_largest_of_one_mini_batch_within_max_images():
    q = queue_with([30, 10, 20, 40, 50], [7, 8], reserved=3)
    assert [w.indices for w in q.take_accel(max_images=100)] == [(4,), (3,), (0,)]  # K=3 largest, one run
    assert q.take_cpu().indices == (1,)  # the rest of mini-batch 0 is the CPU workers'
    assert [w.indices for w in q.take_accel(max_images=100)] == [(101,), (100,)]  # runs ahead: mini-batch 1's share
    assert [w.indices for w in q.take_accel(max_images=100)] == [(2,)]  # no split rule: the oldest's largest
    q = queue_with([30, 10, 20, 40, 50, 60], reserved=4, tiny_batch_size=2)  # tiny-batches of 2 samples
    assert [len(w.positions) for w in q.take_accel(max_images=5)] == [2, 2]  # a third would make 6
    assert q.take_cpu() is None  # the share's last tiny-batch is still the accelerator's: above the cap,
    assert [len(w.positions) for w in q.take_accel(max_images=5)] == [2]  # it takes another run
    q = queue_with([30, 10, 20, 40], reserved=0)
    assert len(q.take_accel(max_images=100)) == 1  # K=0: one at a time, as before the grouping
    q = queue_with([30, 10, 20, 40], reserved=3)
    assert [w.indices for w in q.take_accel(largest_first=False, max_images=100)] == [(1,), (2,), (0,)]


def test_a_share_once_taken_stays_taken_when_the_split_rule_raises_the_reservation():
    """G rising by one after the accelerator took a mini-batch's share gives no run of that one tiny-batch (a
    DALI run's fixed cost for a few samples): the rest of that mini-batch is the CPU workers', and the larger
    share applies to the mini-batches whose share is untaken. A share above the run cap still goes as runs; one
    partly taken that a smaller G completes stays complete. That is `final_shares` (a GPU, where a run's fixed
    cost is ~170 samples' work); without it (DALI's CPU backend: ~3) the grown share is topped up."""
    q = queue_with([30, 10, 20, 40, 50], [7, 8, 9, 6, 5], reserved=2)
    q.reserved, q.final_shares = 2, False
    assert [w.indices for w in q.take_accel(max_images=100, tail_fraction=0.5)] == [(4,), (3,)]
    q.reserved = 3
    assert [w.indices for w in q.take_accel(max_images=100, tail_fraction=0.5)] == [(0,)]  # the top-up, oldest first
    assert [w.indices for w in q.take_accel(max_images=100, tail_fraction=0.5)] == [(102,), (101,), (100,)]
    q = queue_with([30, 10, 20, 40, 50], [7, 8, 9, 6, 5], reserved=2)
    q.final_shares = True
    assert [w.indices for w in q.take_accel(max_images=100, tail_fraction=0.5)] == [(4,), (3,)]
    q.reserved = 3  # the split rule's next G
    assert [w.indices for w in q.take_accel(max_images=100, tail_fraction=0.5)] == [(102,), (101,), (100,)]
    assert q.take_accel(max_images=100, tail_fraction=0.5) == []  # no top-up of mini-batch 0
    assert [q.take_cpu().indices for _ in range(3)] == [(1,), (2,), (0,)]  # all the CPU workers'
    q = queue_with([30, 10, 20, 40, 50, 60], reserved=3)
    q.final_shares = True
    assert [w.indices for w in q.take_accel(max_images=2, tail_fraction=0.5)] == [(5,), (4,)]  # above the cap
    q.reserved = 4
    assert [w.indices for w in q.take_accel(max_images=2, tail_fraction=0.5)] == [(3,), (0,)]  # the share's rest
    q = queue_with([30, 10, 20, 40, 50, 60, 70], reserved=4)
    q.final_shares = True
    assert [w.indices for w in q.take_accel(max_images=2, tail_fraction=0.5)] == [(6,), (5,)]  # half, at the cap
    q.reserved = 2  # G shrinks to what was taken: the share is done...
    assert q.take_accel(max_images=2, tail_fraction=0.5) == []
    q.reserved = 3  # ...and stays done when G grows again
    assert q.take_accel(max_images=2, tail_fraction=0.5) == []


def test_a_run_merges_whole_shares_of_the_next_mini_batches_that_fit():
    q = queue_with([30, 10, 20, 40], [7, 8, 9], [1, 2, 3], reserved=2)
    run = q.take_accel(max_images=100, merge=2)
    assert [w.indices for w in run] == [(3,), (0,), (102,), (101,)]  # mini-batches 0 and 1: two shares
    assert [w.indices for w in q.take_accel(max_images=100, merge=2)] == [(202,), (201,)]
    q = queue_with([30, 10, 20, 40], [7, 8, 9], reserved=2)
    assert len(q.take_accel(max_images=3, merge=2)) == 2  # mini-batch 1's share would not fit whole
    assert [w.indices for w in q.take_accel(max_images=3, merge=2)] == [(102,), (101,)]
    q = queue_with([30, 10, 20, 40], [7, 8, 9], reserved=2)
    q.awaited = (1, 0)
    assert len(q.take_accel(max_images=100, merge=2)) == 2  # training waits for mini-batch 0: no merging
    q = queue_with([30, 10, 20, 40], reserved=2)
    q.add(1, 1, slot=1, epoch=1, tiny=split_sorted([5, 6], [0] * 5 + [4, 5], 1), size=2, submitted_at=0.0)
    assert len(q.take_accel(max_images=100, merge=2)) == 2  # the next epoch's mini-batch is not merged


def add_batch(q, seq, sizes, epoch=0):
    """Queue mini-batch `seq` of generation 1 (sample indices 100 * seq + position), one sample a tiny-batch."""
    indices = [100 * seq + p for p in range(len(sizes))]
    size_of = [0] * indices[0] + list(sizes)
    q.add(1, seq, slot=seq, epoch=epoch, tiny=split_sorted(indices, size_of, 1), size=len(sizes), submitted_at=0.0)


def test_a_lone_share_runs_ahead_with_the_next_ones_and_that_one_is_the_cpu_workers():
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    assert (
        len(q.take_accel(max_images=100, merge=2, borrow=True)) == 4
    )  # mini-batches 0 and 1: two queued shares merged
    # mini-batch 2 is the newest, two queued before it, none after: the next one's share is taken ahead
    assert [w.indices for w in q.take_accel(max_images=100, merge=2, borrow=True)] == [(205,), (204,), (203,), (202,)]
    add_batch(q, 3, [1, 2, 3, 4, 5, 6])
    assert (
        q.take_accel(max_images=100, merge=2, borrow=True, tail_fraction=0.5) == []
    )  # its share ran in mini-batch 2's run
    assert q.waiting((1, 3)) == 6  # all six are the CPU workers'
    add_batch(q, 4, [1, 2, 3, 4, 5, 6])
    assert len(q.take_accel(max_images=100, merge=2, borrow=True)) == 4  # mini-batch 4 has its share again, and 5's
    add_batch(q, 5, [1, 2, 3, 4, 5, 6])
    assert q.waiting((1, 5)) == 6 and q.take_accel(max_images=100, merge=2, borrow=True, tail_fraction=0.5) == []


def test_no_share_runs_ahead_where_it_would_be_late_or_cannot_fit():
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    q.take_accel(max_images=100, merge=2)
    assert len(q.take_accel(max_images=100, merge=2)) == 2 and q.credit is None  # not asked to (DALI's CPU backend)
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)  # both shares
    add_batch(q, 2, [1, 2, 3, 4, 5, 6])
    q.forget((1, 0))  # one queued before the newest: a run twice as long would be late
    assert len(q.take_accel(max_images=100, merge=2, borrow=True)) == 2
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)
    q.awaited = (1, 2)  # training waits for it
    assert len(q.take_accel(max_images=100, merge=2, borrow=True)) == 2
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)
    assert (
        len(q.take_accel(max_images=100, merge=2, borrow=True)) == 2
    )  # a share ahead would leave the CPU side nothing
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)
    assert len(q.take_accel(max_images=100, merge=2, borrow=True)) == 2 and q.credit is None  # the share took it all
    add_batch(q, 3, [1, 2, 3, 4, 5, 6])
    assert len(q.take_accel(max_images=100, merge=1)) == 2  # its share is still its own
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)
    assert (
        len(q.take_accel(max_images=3, merge=2, borrow=True)) == 2
    )  # the next share would not fit whole: not taken ahead
    add_batch(q, 3, [1, 2, 3, 4, 5, 6])
    assert (
        len(q.take_accel(max_images=4, merge=2, borrow=True)) == 4
    )  # nothing owed: mini-batch 3 has its share (and 4's)
    q = queue_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], reserved=2)
    q.take_accel(max_images=100, merge=2, borrow=True)
    assert len(q.take_accel(max_images=100, merge=2, borrow=True)) == 4
    add_batch(q, 3, [1, 2, 3, 4, 5, 6], epoch=1)  # the next epoch's first mini-batch owes nothing
    assert len(q.take_accel(max_images=100, merge=1)) == 2


def test_tail_run_only_for_the_awaited_mini_batch_sized_by_the_fraction():
    q = queue_with([30, 10, 20, 40, 50, 60], [7, 8], reserved=1)
    assert [w.indices for w in q.take_accel(tail_fraction=0.5)] == [(5,)]  # mini-batch 0's share
    assert not q.took_tail
    assert [w.indices for w in q.take_accel(tail_fraction=0.5)] == [(101,)]  # mini-batch 1's
    assert q.take_accel(tail_fraction=0.5) == []  # nobody waits: the CPU side is not late
    assert not q.took_tail
    q.awaited = (1, 0)
    assert [w.indices for w in q.take_accel(max_images=10, tail_fraction=0.5)] == [(4,), (3,), (0,)]  # half of 5
    assert q.took_tail  # told apart: its rate is not the share's (scheduling/split.py)
    assert [q.take_cpu().indices for _ in range(2)] == [(1,), (2,)]
    assert q.take_accel(tail_fraction=0.0) == []  # no share (the device left to training): no tail either
    q.awaited = (1, 7)  # no longer tracked
    assert q.take_accel(tail_fraction=0.5) == []


def test_idle_cpu_workers_steal_the_smallest_of_an_untaken_share_oldest_first():
    q = queue_with([30, 10, 20, 40], [7, 8, 9], reserved=2)
    assert [q.take_cpu().indices for _ in range(3)] == [(1,), (2,), (100,)]
    assert q.take_cpu() is None  # without steal the shares hold
    q.steal = True
    assert q.take_cpu().indices == (0,)  # mini-batch 0's share: its smaller one (30)
    assert [w.indices for w in q.take_accel(max_images=10)] == [(3,)]  # one left of its share for the accelerator
    assert [w.indices for w in q.take_accel(max_images=10)] == [(102,), (101,)]
    assert q.take_cpu() is None and q.take_accel(max_images=10) == []
    q = queue_with([30, 10], [7, 8], reserved=2)
    q.steal = True
    assert q.take_cpu(upto=(1, 0)).indices == (1,) and q.take_cpu(upto=(1, 0)).indices == (0,)
    assert q.take_cpu(upto=(1, 0)) is None  # never past `upto`


def test_accelerator_group_skips_given_back_work():
    q = queue_with([30, 10, 20, 40], reserved=4)
    work = accel(q)
    work.cpu_only = True
    q.requeue([work])
    assert [w.indices for w in q.take_accel(max_images=100)] == [(0,), (2,), (1,)]
    assert q.take_accel(max_images=100) == [] and q.take_cpu().indices == (3,)


def test_upto_stops_at_newer_mini_batches():
    q = queue_with([1], [2])
    assert q.take_cpu(upto=(1, 0)).indices == (0,)
    assert q.take_cpu(upto=(1, 0)) is None
    assert q.take_cpu(upto=(1, 1)).indices == (100,)


def test_requeue_puts_work_back_at_the_front_in_order_and_drops_forgotten_work():
    q = queue_with([3, 1, 2, 4])
    taken = [q.take_cpu() for _ in range(3)]
    q.requeue(taken)
    assert [q.take_cpu().indices for _ in range(4)] == [(1,), (2,), (0,), (3,)]
    q.forget((1, 0))
    q.requeue(taken)
    assert q.take_cpu() is None


def test_complete_counts_per_mini_batch():
    q = queue_with([3, 1, 2, 4], tiny_batch_size=2)
    a, b = q.take_cpu(), accel(q)
    (state,) = q.complete([(a, {0: "x"})], ["f"], on_accelerator=False, now=11.0)
    assert state.remaining == 2 and state.failures == ["f"] and state.targets == {0: "x"}
    assert state.cpu_done_at == 11.0 and state.accel_done_at == 0.0
    assert q.complete([(b, None)], [], on_accelerator=True, now=12.5) == [state]
    assert state.remaining == 0 and state.accel_done_at == 12.5
    assert sorted(state.accel_positions) == sorted(b.positions)
    assert q.current_key() is None  # done: it stays tracked until forgotten
    assert (1, 0) in q.batches
    q.forget((1, 0))
    assert q.complete([(a, None)], [], on_accelerator=False, now=13.0) == []
    assert not q.tracks(a)


def test_complete_takes_a_run_of_tiny_batches_over_mini_batches():
    """An accelerator run's tiny-batches, two mini-batches' shares and one no longer tracked: each state
    once, in order, every sample counted, positions and targets merged."""
    q = queue_with([5, 1, 4, 2], [8, 3, 7, 6], [9, 9], tiny_batch_size=1)
    works = [w for key in list(q.queues) for w in q.queues[key]]
    first, second, gone = [w for w in works if w.seq == 0], [w for w in works if w.seq == 1], works[-1]
    q.forget(gone.key)
    done = [(w, {w.positions[0]: "t"} if w is first[0] else None) for w in first[:3] + second + [gone]]
    with pytest.raises(ValueError, match="failures come with one tiny-batch"):
        q.complete(done, ["f"], on_accelerator=True, now=2.0)  # a CPU worker's failures are its tiny-batch's
    states = q.complete(done, [], on_accelerator=True, now=2.0)
    assert [(s.seq, s.remaining) for s in states] == [(0, 1), (1, 0)]
    assert states[0].failures == [] and states[1].failures == []
    assert sorted(states[0].accel_positions) == sorted(p for w in first[:3] for p in w.positions)
    assert sorted(states[1].accel_positions) == [0, 1, 2, 3]
    assert states[0].targets == {first[0].positions[0]: "t"} and states[1].targets == {}
    assert all(s.accel_done_at == 2.0 and s.cpu_done_at == 0.0 for s in states)
    # a mini-batch met again after another is still one state (its completion is accounted once)
    q = queue_with([1, 2], [3, 4], tiny_batch_size=1)
    (a1, a2), (b1, b2) = ([q.queues[k].popleft(), q.queues[k].popleft()] for k in list(q.queues))
    states = q.complete([(a1, None), (b1, None), (a2, None)], [], on_accelerator=True, now=3.0)
    assert [(s.seq, s.remaining) for s in states] == [(0, 0), (1, 1)]


def test_current_key_and_waiting():
    q = queue_with([1, 2, 3], [4, 5], reserved=1)
    assert q.current_key() == (1, 0) and q.waiting((1, 0)) == 2 and q.waiting(None) == 0
    for work in [q.take_cpu(), q.take_cpu(), accel(q)]:
        q.complete([(work, None)], [], False, 0.0)
    assert q.current_key() == (1, 1) and q.waiting((1, 0)) == 0


def test_forget_generation_keeps_other_iterators():
    q = queue_with([1, 2])
    q.add(2, 0, slot=1, epoch=0, tiny=split_sorted([5], [0] * 6, 1), size=1, submitted_at=0.0)
    q.forget_generation(1)
    assert list(q.batches) == [(2, 0)] and list(q.queues) == [(2, 0)]
    assert q.take_cpu().indices == (5,)


def test_add_returns_the_tracked_state():
    q = TinyBatchQueue()
    state = q.add(3, 7, slot=2, epoch=1, tiny=split_sorted([0, 1], [1, 2], 1, [0, 1]), size=2, submitted_at=4.0)
    assert state == BatchState(7, 2, 2, 2, submitted_at=4.0) and q.batches[(3, 7)] is state
    works = list(q.queues[(3, 7)])
    assert all(isinstance(w, Work) and w.key == (3, 7) and w.epoch == 1 for w in works)
    assert works[1].copies == (1,)


@pytest.mark.parametrize("n", range(1, 7))
def test_every_interleaving_takes_each_tiny_batch_once_and_respects_the_reservation(n):
    """All 2^n orders of CPU / accelerator requests, every reservation K: each tiny-batch is taken
    exactly once; the accelerator always gets the largest left; the CPU the smallest left, and
    never one of the largest the accelerator's share has yet to take (K less what it took)."""
    sizes = [10 * ((4 * p) % 7) + p for p in range(n)]  # distinct, not in position order
    for k in range(n + 1):
        for order in itertools.product("ca", repeat=n):
            q = queue_with(sizes, reserved=k)
            left, taken, share_left = sorted(sizes), [], k
            for who in order:
                work = q.take_cpu() if who == "c" else accel(q)
                if who == "c" and len(left) <= share_left:
                    assert work is None
                    continue
                assert work is not None
                if who == "a":
                    share_left = max(0, share_left - 1)
                size = sizes[work.positions[0]]
                assert size == (left[0] if who == "c" else left[-1])
                left.remove(size)
                taken.append(work.indices)
            while (work := accel(q)) is not None:
                taken.append(work.indices)
            assert sorted(taken) == [(p,) for p in range(n)]


@pytest.mark.parametrize("max_images", [1, 2, 3, 100])
def test_every_interleaving_with_grouped_accelerator_takes_each_tiny_batch_once(max_images):
    """As above with the accelerator taking groups (one DALI run each): every tiny-batch exactly
    once; a group is the largest left, the share's remainder (one without a share) within
    `max_images` samples, at least one."""
    n = 6
    sizes = [10 * ((4 * p) % 7) + p for p in range(n)]
    for k in range(n + 1):
        for order in itertools.product("ca", repeat=n):
            q = queue_with(sizes, reserved=k)
            left, taken, share_left = sorted(sizes), [], k
            for who in order:
                if who == "c":
                    work = q.take_cpu()
                    if work is None:
                        assert len(left) <= share_left
                        continue
                    assert sizes[work.positions[0]] == left.pop(0)
                    taken.append(work.indices)
                    continue
                group = q.take_accel(max_images=max_images)
                assert len(group) == min(len(left), max(1, min(share_left, max_images)))
                share_left = max(0, share_left - len(group)) if group else 0
                for work in group:
                    assert sizes[work.positions[0]] == left.pop()
                    taken.append(work.indices)
            while group := q.take_accel(max_images=max_images):
                taken.extend(w.indices for w in group)
            assert sorted(taken) == [(p,) for p in range(n)]
