"""ShareFeed (fusionflow/accel/share_feed.py): what reaches the split rule from the accelerator's runs."""

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
