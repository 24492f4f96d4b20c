"""Epoch-boundary speculation (fusionflow/loader/next_epoch.py): with persistent workers the next epoch's
first mini-batches start before its iter(). The reference for every test is the same loader with
speculation switched off: every batch -- indices, order, pixels -- must be identical, whatever the
caller does between epochs."""

import itertools

import pytest
import torch
from test_loader import SMALL, Bytes, no_leaks  # noqa: F401
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from fusionflow.loader import FusionFlowLoader
from fusionflow.loader.next_epoch import NextEpoch, peek_next


def make(speculate: bool, monkeypatch, **kw):
    if not speculate:
        monkeypatch.setattr(NextEpoch, "offer", lambda self, *a, **k: None)
    args = dict(batch_size=4, num_workers=2, persistent_workers=True, policy=SMALL, seed=7, prefetch_factor=3)
    return FusionFlowLoader(Bytes(kw.pop("n", 30)), **(args | kw))


def run(loader, between):
    """Epochs of (labels, images) batches; `between(k, loader)` runs before epoch k's iter()."""
    epochs = []
    for k in range(4):
        between(k, loader)
        epochs.append([(y.tolist(), x) for x, y in loader])
    return epochs


def same(a, b):
    assert [[lab for lab, _ in e] for e in a] == [[lab for lab, _ in e] for e in b]
    for ea, eb in zip(a, b):
        for (_, xa), (_, xb) in zip(ea, eb):
            assert torch.equal(xa, xb)


def compare(monkeypatch, between, kw=dict):
    """Run the plan with speculation off, then on, each from torch.manual_seed(0) and its own
    sampler and generator (`kw()` makes the loader's arguments)."""
    torch.manual_seed(0)
    ref_loader = make(False, monkeypatch, **kw())
    ref = run(ref_loader, between)
    ref_loader.close()
    monkeypatch.undo()
    torch.manual_seed(0)
    loader = make(True, monkeypatch, **kw())
    got = run(loader, between)
    stats = loader.stats
    loader.close()
    same(got, ref)
    for epoch in got:  # at most once per epoch (drop_last drops a different remainder each epoch)
        labels = [i for lab, _ in epoch for i in lab]
        assert len(set(labels)) == len(labels) == sum(len(lab) for lab, _ in ref[0])
    return stats


def set_epoch(k, loader):
    loader.set_epoch(k)


def nothing(k, loader):
    pass


@pytest.mark.parametrize("drop_last", [False, True])
def test_generator_sampler_with_set_epoch_is_adopted(monkeypatch, drop_last):
    kw = lambda: dict(shuffle=True, generator=torch.Generator().manual_seed(4), drop_last=drop_last)  # noqa: E731
    stats = compare(monkeypatch, set_epoch, kw)
    # 3 mini-batches (prefetch_factor) ahead at each of 3 boundaries; close() discards the 4th guess
    assert stats.next_epoch_adopted == 9 and stats.next_epoch_discarded == 3


def test_shuffle_from_torchs_global_rng_without_set_epoch_is_adopted(monkeypatch):
    stats = compare(monkeypatch, nothing, lambda: dict(shuffle=True))
    assert stats.next_epoch_adopted == 9 and stats.next_epoch_discarded == 3


def test_global_rng_used_between_epochs_discards_and_keeps_the_order(monkeypatch):
    # the caller draws from torch's RNG between epochs: the guessed order is not the real one
    stats = compare(monkeypatch, lambda k, ld: torch.rand(3), lambda: dict(shuffle=True))
    assert stats.next_epoch_adopted == 0 and stats.next_epoch_discarded == 12


def test_set_epoch_to_another_epoch_discards(monkeypatch):
    stats = compare(monkeypatch, lambda k, ld: ld.set_epoch([0, 1, 5, 6][k]), lambda: dict(shuffle=True))
    assert stats.next_epoch_adopted == 6 and stats.next_epoch_discarded == 6  # 1 -> 5 was not guessed


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("call", ["loader", "sampler", "never"])
def test_distributed_sampler(monkeypatch, drop_last, call):
    def between(k, loader):
        if call == "loader":
            loader.set_epoch(k)
        elif call == "sampler":
            loader.sampler.set_epoch(k)

    for rank in (0, 1):

        def kw(rank=rank):
            sampler = DistributedSampler(range(30), 2, rank, shuffle=True, seed=3, drop_last=drop_last)
            return dict(sampler=sampler, drop_last=drop_last)

        stats = compare(monkeypatch, between, kw)
        if call != "sampler":  # the sampler's own set_epoch is not the loader's: the guess may miss, never mislead
            assert stats.next_epoch_adopted > 0


def test_sequential_sampler_and_islice_without_stop_iteration(monkeypatch):
    # the caller takes exactly len(loader) batches and never sees StopIteration: still clean
    def epoch(loader):
        return [(y.tolist(), x) for x, y in itertools.islice(loader, len(loader))]

    results = []
    for speculate in (False, True):
        monkeypatch.undo()
        loader = make(speculate, monkeypatch)
        results.append([epoch(loader) for _ in range(3)])
        stats = loader.stats
        loader.close()
    same(results[1], results[0])
    assert stats.next_epoch_adopted == 6 and stats.next_epoch_discarded == 3


def test_load_state_dict_between_epochs_discards_and_resumes_exactly(monkeypatch):
    gen = lambda: torch.Generator().manual_seed(9)  # noqa: E731
    src = make(False, monkeypatch, shuffle=True, generator=gen())
    for _ in src:
        pass
    it = iter(src)
    for _ in range(3):
        next(it)
    state = src.state_dict()  # in epoch 1, after 3 batches
    rest = [(y.tolist(), x) for x, y in it]
    src.close()
    monkeypatch.undo()
    loader = make(True, monkeypatch, shuffle=True, generator=gen())
    for _ in loader:
        pass  # epoch 0 ends with epoch 1's first batches speculated
    assert loader.stats.next_epoch_speculated == 3
    loader.load_state_dict(state)
    assert loader.stats.next_epoch_discarded == 3
    same([[(y.tolist(), x) for x, y in loader]], [rest])
    loader.close()


def test_break_in_the_last_batches_discards(monkeypatch):
    loader = make(True, monkeypatch)
    for k, _ in enumerate(loader):
        if k == len(loader) - 2:
            break  # the epoch's last batch was never taken
    speculated = loader.stats.next_epoch_speculated
    assert speculated > 0
    _, labels = zip(*[(x, y) for x, y in loader])
    assert [i for y in labels for i in y.tolist()] == list(range(30))
    assert loader.stats.next_epoch_discarded == speculated and loader.stats.next_epoch_adopted == 0
    loader.close()


def test_an_older_iterator_still_open_is_not_taken_over(monkeypatch):
    loader = make(True, monkeypatch)
    old = iter(loader)
    for _ in range(len(loader)):
        next(old)  # all delivered, but `old` has not ended
    assert loader.stats.next_epoch_speculated > 0
    labels = [i for _, y in loader for i in y.tolist()]
    assert labels == list(range(30))
    assert loader.stats.next_epoch_adopted == 0
    del old  # closing it now must not disturb anything
    assert [i for _, y in loader for i in y.tolist()] == list(range(30))
    loader.close()


def test_without_persistent_workers_nothing_is_speculated(monkeypatch):
    loader = make(True, monkeypatch, persistent_workers=False)
    for _ in range(2):
        assert [i for _, y in loader for i in y.tolist()] == list(range(30))
    assert loader.stats.next_epoch_speculated == 0


class Custom(Sampler):
    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 10

    def __iter__(self):
        self.calls += 1
        return iter(torch.randperm(10).tolist())


def test_peek_leaves_every_state_as_it_was():
    torch.manual_seed(1)
    rng_before = torch.get_rng_state()
    gen = torch.Generator().manual_seed(2)
    g_before = gen.get_state()
    for sampler in (RandomSampler(range(10)), RandomSampler(range(10), generator=gen), SequentialSampler(range(10))):
        got = peek_next(BatchSampler(sampler, 3, False), sampler, 0, 1, 2)
        assert len(got) == 2 and all(len(b) == 3 for b in got)
    assert torch.equal(torch.get_rng_state(), rng_before) and torch.equal(gen.get_state(), g_before)
    # the guess is what the epoch then draws
    sampler = RandomSampler(range(10), generator=gen)
    assert peek_next(BatchSampler(sampler, 3, False), sampler, 0, 1, 4) == list(BatchSampler(sampler, 3, False))
    dist = DistributedSampler(range(10), num_replicas=2, rank=1, seed=5)
    dist.set_epoch(4)
    guess = peek_next(BatchSampler(dist, 2, False), dist, 4, 5, 3)
    assert dist.epoch == 4
    dist.set_epoch(5)
    assert guess == list(BatchSampler(dist, 2, False))
    # what could have side effects is not peeked at: a custom sampler, a custom batch sampler
    custom = Custom()
    assert peek_next(BatchSampler(custom, 3, False), custom, 0, 1, 2) is None and custom.calls == 0
    assert peek_next([[0, 1]], SequentialSampler(range(2)), 0, 1, 2) is None
    # samplers that draw from torch's global RNG with no generator to copy are not peeked at
    for sampler in (SubsetRandomSampler(range(10)), WeightedRandomSampler([1.0] * 10, 10)):
        assert peek_next(BatchSampler(sampler, 3, False), sampler, 0, 1, 2) is None
    sampler = SubsetRandomSampler(range(10), generator=gen)
    assert peek_next(BatchSampler(sampler, 3, False), sampler, 0, 1, 2) == list(BatchSampler(sampler, 3, False))[:2]
    assert torch.equal(torch.get_rng_state(), rng_before)


class Failing(Sampler):
    """Iterates once, then raises: the guess for the next epoch fails, the current one must not."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 30

    def __iter__(self):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the dataset changed")
        return iter(range(30))


def test_a_guess_that_fails_leaves_the_epoch_alone(monkeypatch):
    # made peekable for the test: a SequentialSampler-typed object whose second iteration raises
    sampler = Failing()
    monkeypatch.setattr("fusionflow.loader.next_epoch.SequentialSampler", Failing)
    monkeypatch.setattr("fusionflow.loader.next_epoch._PEEKABLE", (Failing,))
    loader = make(True, monkeypatch, sampler=sampler)
    assert [i for _, y in loader for i in y.tolist()] == list(range(30))  # the guess raised inside this epoch
    assert sampler.calls == 2 and loader.stats.next_epoch_speculated == 0  # it was tried, and dropped
    with pytest.raises(RuntimeError, match="the dataset changed"):
        next(iter(loader))  # the real next epoch raises it
    loader.close()


def test_set_epoch_to_an_epoch_not_guessed_discards_before_it_returns(monkeypatch):
    """The workers turn to real work at once, not at the next iter() (results would stay right either way:
    only the discard's timing is checked here)."""
    loader = make(True, monkeypatch, shuffle=True, generator=torch.Generator().manual_seed(4))
    for _ in loader:
        pass  # epoch 0 ends with epoch 1's first batches speculated
    speculated = loader.stats.next_epoch_speculated
    assert speculated > 0 and loader.stats.next_epoch_discarded == 0
    loader.set_epoch(5)
    assert loader.stats.next_epoch_discarded == speculated
    loader.set_epoch(6)  # nothing left to discard: counted once
    assert loader.stats.next_epoch_discarded == speculated
    loader.close()
