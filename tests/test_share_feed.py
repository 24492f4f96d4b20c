"""ShareFeed (fusionflow/accel/share_feed.py): what reaches the split rule from the accelerator's runs."""

import pytest

from fusionflow.accel.share_feed import ShareFeed
from fusionflow.scheduling.split import ShareController


class Board:
    def __init__(self):
        self.reserved = []

    def reserve(self, tiny_batches, steal=False, final=False):
        self.reserved.append(tiny_batches)
        self.final = final


def test_tail_runs_do_not_read_as_the_accelerators_rate():
    """Share runs of 180 samples at 0.2 ms each, then tail runs of 4 at 30 ms (a run's fixed cost over
    a few samples): the rate and the share stay those of the share runs."""
    split = ShareController(shares_device=True, step=4)
    feed = ShareFeed(split, Board(), tiny_batch_size=4, cpu_workers=4)
    for _ in range(3):
        split.cpu_tiny_batch(4 * 2.2e-3, 4)
        feed.run_done(180 * 2e-4, 180)
    rate, share = split.accel_s, split.share(256, 4)
    for _ in range(4):
        feed.run_done(0.030, 4, tail=True)
    assert split.accel_s == rate and split.share(256, 4) == share
    feed.run_done(0.030, 4)  # the same run as a share: it is observed
    assert split.accel_s == rate  # one slow run among the last few: the median holds
    for _ in range(3):
        feed.run_done(0.030, 4)
    assert split.accel_s == 0.030 / 4 and split.share(256, 4) < share


def test_no_tail_run_behind_two_runs_in_flight():
    """The tail runs' fraction is the share's with fewer than TAIL_BEHIND runs in DALI, 0 (none) with more
    (runs come out in order: a tail queued behind two would come late), None before any share is reserved."""
    from fusionflow.accel.share_feed import TAIL_BEHIND

    feed = ShareFeed(ShareController(shares_device=True, step=4), Board(), tiny_batch_size=4, cpu_workers=4)
    assert feed.tail(0) is None and feed.tail(TAIL_BEHIND) is None
    feed.reserve(256)
    assert feed.tail_fraction == 0.5  # half, until rates are measured
    assert feed.board.final  # shares taken on a shared device (the GPU) get no top-up runs
    assert [feed.tail(n) for n in range(TAIL_BEHIND + 2)] == [0.5] * TAIL_BEHIND + [0.0, 0.0]


class Recording:
    """A split rule that records what it is fed."""

    shares_device, accel_s = True, None

    def __init__(self):
        self.periods, self.batches = [], []

    def cpu_tiny_batch(self, seconds, samples):
        pass

    def iteration(self, seconds, batch, cpu_bound):
        self.periods.append(seconds)

    def share(self, batch, workers):
        self.batches.append(batch)
        return batch // 2


class Done:
    def __init__(self, size):
        self.size, self.cpu_done_at, self.accel_done_at = size, 0.0, 0.0


def test_mini_batches_completed_together_are_one_period_not_a_period_of_zero():
    """A run holding two mini-batches' shares completes both at once: the split rule gets one observation, the
    period between such completions over the mini-batches in it, and never a period of ~0 s (it read as a
    training step of 0 s, taken at once: G jumped on a GPU)."""
    split = Recording()
    feed = ShareFeed(split, Board(), tiny_batch_size=4, cpu_workers=2)
    t = 100.0
    feed.batch_done(Done(8), 0.0, False, t)  # the first: no period yet
    for k in range(3):  # pairs completed together every 20 ms
        feed.batch_done(Done(8), 0.0, False, t + 0.020 * (k + 1) - 1e-6)
        feed.batch_done(Done(8), 0.0, False, t + 0.020 * (k + 1))
    assert len(split.periods) == 3 and split.periods[0] == pytest.approx(0.020 - 1e-6)
    assert split.periods[1:] == pytest.approx([0.010, 0.010])


def test_a_short_last_mini_batch_does_not_size_the_next_share():
    """The epoch's last mini-batch holds 5 of 64: the share reserved after it is still the one for 64 (the next
    epoch's mini-batches, started already), not the one for 5."""
    split = Recording()
    feed = ShareFeed(split, Board(), tiny_batch_size=4, cpu_workers=2, batch_size=64)
    feed.batch_done(Done(64), 0.0, False, 1.0)
    feed.batch_done(Done(5), 0.0, False, 2.0)
    assert split.batches == [64, 64] and feed.board.reserved == [8, 8]


def test_a_run_taken_while_dali_was_idle_is_collected_after_its_latency():
    """`due`: a run taken after the last completion is expected at the end of its read plus the latency that runs
    taken so have shown (their intervals), not at DALI's pace alone: collected earlier, the thread would wait inside
    DALI's outputs(), taking no new share meanwhile. A run taken while another was in DALI is expected at the pace."""
    import time

    from fusionflow.accel.share_feed import COLLECT_AT

    class Work:
        generation, seq, positions = 0, 7, list(range(4))

    class Queue:
        awaited = None

    board = Board()
    board.generation, board.queue = 0, Queue()
    split = ShareController(shares_device=True, step=4)
    feed = ShareFeed(split, board, tiny_batch_size=4, cpu_workers=4)
    for _ in range(5):
        feed.run_done(100 * 2e-4, 100)  # queued runs: 0.2 ms a sample
        feed.run_done(100 * 1e-3, 100, queued=False)  # runs that found DALI idle: 1 ms a sample with the latency
    assert split.accel_s == 2e-4
    group, now = [Work()] * 25, time.monotonic()
    read_at = now + 0.5  # the run's read (the helpers') ended half a second after it was taken
    alone = feed.due([(group, now, False, (None, None, read_at))], last_done=now - 1.0, due=0.0)
    behind = feed.due([(group, now - 1.0, False, (None, None, now - 0.5))], last_done=now, due=0.0)
    assert alone == pytest.approx(read_at + COLLECT_AT * 1e-3 * 100)
    assert behind == pytest.approx(now + COLLECT_AT * 2e-4 * 100)
