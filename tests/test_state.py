"""Mid-epoch checkpoint and resume (fusionflow/loader/checkpoint.py): a fresh loader given `state_dict()` yields
exactly the batches -- indices and pixels -- the original yields after it, and the same epochs after."""

import io
import itertools
import pickle
import warnings

import numpy as np
import pytest
import torch
from test_loader import SMALL, Bytes, no_leaks  # noqa: F401
from torch.utils.data import DistributedSampler, Sampler

from fusionflow.loader import FusionFlowLoader

DS = Bytes(29)  # labels are the indices: a batch says which samples it holds


class Shuffled(Sampler):
    """A custom sampler with its own RNG and state_dict/load_state_dict (numpy's bit generator)."""

    def __init__(self, n, seed):
        self.n, self.rng = n, np.random.default_rng(seed)

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


CASES = {  # name: loader arguments, built fresh each time (a fresh generator / sampler)
    "sequential": lambda: dict(batch_size=4),
    "drop_last": lambda: dict(batch_size=4, drop_last=True, shuffle=True, generator=torch.Generator().manual_seed(2)),
    "shuffle_generator": lambda: dict(batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7)),
    "distributed": lambda: dict(
        batch_size=3, sampler=DistributedSampler(DS, num_replicas=2, rank=1, shuffle=True, seed=9)
    ),
    "custom_state_dict": lambda: dict(batch_size=4, sampler=Shuffled(len(DS), 5)),
}


def make(case, num_workers, **kw):
    args = dict(policy=SMALL, tiny_batch_size=2, num_workers=num_workers, **CASES[case]())
    args.update(kw)
    return FusionFlowLoader(DS, **args)


def batches(it):
    return [(x.clone(), y.tolist()) for x, y in it]


def same_batches(got, expected):
    assert [y for _, y in got] == [y for _, y in expected]  # the same indices, in the same batches
    for (x, y), (ex, _) in zip(got, expected):
        assert torch.equal(x, ex), f"pixels of batch {y} differ"


def through_torch_save(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain data and tensors only


def reference(loader, k, set_epoch):
    """Run epoch 0 up to k batches, take the state, finish the epoch and run the next one."""
    if set_epoch:
        loader.set_epoch(0)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state = loader.state_dict()
    rest = batches(it)
    if set_epoch:
        loader.set_epoch(1)
    following = batches(loader)
    loader.close()
    return head, state, rest, following


def resumed(loader, state, set_epoch):
    loader.load_state_dict(state)
    if set_epoch:  # a training loop that calls set_epoch(epoch) for the resumed epoch too
        loader.set_epoch(0)
    rest = batches(loader)
    if set_epoch:
        loader.set_epoch(1)
    following = batches(loader)
    loader.close()
    return rest, following


@pytest.mark.parametrize("workers", [(2, 0), (0, 2), (0, 0)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_mid_epoch_yields_the_remaining_batches_and_the_next_epoch(case, workers):
    set_epoch = case == "distributed"
    head, state, rest, following = reference(make(case, workers[0], seed=5), 3, set_epoch)
    assert len(pickle.dumps(state)) < 20_000  # small: no pixels
    got_rest, got_following = resumed(make(case, workers[1]), through_torch_save(state), set_epoch)
    same_batches(got_rest, rest)
    same_batches(got_following, following)
    delivered = [i for _, y in head for i in y.tolist()] + [i for _, y in got_rest for i in y]
    if case != "distributed":  # (DistributedSampler pads its shard by repeating indices)
        assert len(delivered) == len(set(delivered))  # nothing delivered twice, nothing dropped
        assert len(delivered) == len(DS) - (len(DS) % 4 if case == "drop_last" else 0)


@pytest.mark.parametrize("k", [0, 1, "all"])
@pytest.mark.parametrize("case", ["shuffle_generator", "distributed"])
def test_resume_at_the_edges_of_an_epoch(case, k):
    set_epoch = case == "distributed"
    n = len(make(case, 0))
    k = n if k == "all" else k
    _, state, rest, following = reference(make(case, 0, seed=5), k, set_epoch)
    got_rest, got_following = resumed(make(case, 0), state, set_epoch)
    assert len(got_rest) == n - k
    same_batches(got_rest, rest)
    same_batches(got_following, following)


def test_state_between_epochs_resumes_at_the_next_epoch():
    loader = make("shuffle_generator", 2, seed=5, persistent_workers=True)
    first = batches(loader)
    state = loader.state_dict()
    second, third = batches(loader), batches(loader)  # no set_epoch: epochs 1 and 2
    loader.close()
    fresh = make("shuffle_generator", 0)
    fresh.load_state_dict(state)
    same_batches(batches(fresh), second)
    same_batches(batches(fresh), third)
    assert [y for _, y in first] != [y for _, y in second]


def test_shuffle_without_generator_resumes_the_epoch_and_follows_torchs_rng():
    """RandomSampler without a generator draws each epoch's order from torch's global RNG, as
    DataLoader does: the state holds the resumed epoch's draw; the epochs after it are the same when
    torch's RNG state is restored with the checkpoint (as a training script restores it)."""
    torch.manual_seed(123)
    loader = make("sequential", 2, shuffle=True, seed=5)
    it = iter(loader)
    next(it)
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = batches(it)
    following = batches(loader)
    loader.close()
    torch.manual_seed(999)  # a new process: another RNG state
    fresh = make("sequential", 2, shuffle=True)  # (a loader starting workers draws their base seed from
    fresh.load_state_dict(state)  # torch's RNG too: the same worker count draws the same)
    same_batches(batches(fresh), rest)
    torch.set_rng_state(rng)
    same_batches(batches(fresh), following)


def test_order_of_shuffle_without_generator_is_still_dataloaders():
    """Capturing the epoch's draw does not change the order a seeded DataLoader gives."""
    torch.manual_seed(31)
    expected = [b.tolist() for b in torch.utils.data.DataLoader(range(len(DS)), 6, shuffle=True)]
    torch.manual_seed(31)
    got = [y for _, y in batches(make("sequential", 0, shuffle=True, batch_size=6))]
    assert got == expected


def test_resumed_loader_takes_the_states_seed():
    loader = make("sequential", 0, seed=77)
    state = loader.state_dict()
    fresh = make("sequential", 0)  # seed=None: derived, then replaced by the state's
    fresh.load_state_dict(state)
    assert fresh.seed == 77
    given = make("sequential", 0, seed=1)
    with pytest.warns(UserWarning, match="seed=77"):
        given.load_state_dict(state)
    assert given.seed == 77


def test_a_state_saved_before_any_epoch_leaves_the_seed_to_be_drawn_even_after_another_state():
    """seed=None: a state taken before the first epoch has no seed (none was drawn); loaded -- also into a loader
    that drew one, or took another state's -- the next epoch draws anew, as the saved loader would have."""
    unsaved = make("sequential", 0)
    early = unsaved.state_dict()
    assert early["seed"] is None
    torch.manual_seed(5)
    expected = batches(unsaved)
    other = make("sequential", 0, seed=77).state_dict()
    for before in (None, other):
        loader = make("sequential", 0)
        batches(loader)  # draws a seed
        if before is not None:
            loader.load_state_dict(before)
        loader.load_state_dict(early)
        assert loader.seed is None
        torch.manual_seed(5)
        same_batches(batches(loader), expected)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(batch_size=5), "batch_size=4"),
        (dict(drop_last=True), "drop_last=False"),
        (dict(shuffle=True, generator=torch.Generator()), "'none'"),
    ],
)
def test_a_state_from_another_loader_is_refused_naming_the_difference(change, match):
    state = make("sequential", 0).state_dict()
    with pytest.raises(ValueError, match=match):
        make("sequential", 0, **change).load_state_dict(state)


def test_a_state_from_another_dataset_or_rank_is_refused():
    state = make("sequential", 0).state_dict()
    other = FusionFlowLoader(Bytes(30), batch_size=4, policy=SMALL)
    with pytest.raises(ValueError, match="dataset_len=29"):
        other.load_state_dict(state)
    dist = make("distributed", 0).state_dict()
    rank0 = make("distributed", 0, sampler=DistributedSampler(DS, num_replicas=2, rank=0, shuffle=True, seed=9))
    with pytest.raises(ValueError, match="rank=1"):
        rank0.load_state_dict(dist)
    with pytest.raises(ValueError, match="state_dict"):
        make("sequential", 0).load_state_dict({"epoch": 3})


def test_sampler_on_torchs_global_rng_warns_that_it_cannot_resume_exactly():
    from torch.utils.data import SubsetRandomSampler

    loader = FusionFlowLoader(DS, batch_size=4, policy=SMALL, sampler=SubsetRandomSampler(range(10)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # iterating alone does not warn: only taking a state does
        batches(loader)
    with pytest.warns(UserWarning, match="generator"):
        loader.state_dict()


def test_sequential_sampler_state_is_tiny():
    loader = make("sequential", 0, seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (
        state["batches_yielded"] == 1
        and state["epoch"] == 0
        and state["sampler"] == {"kind": "none", "owner": "SequentialSampler"}
    )
    assert len(pickle.dumps(state)) < 400


def test_set_epoch_to_another_epoch_after_a_mid_epoch_state_warns_and_starts_that_epoch():
    loader = make("distributed", 0, seed=5)
    loader.set_epoch(3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    fresh = make("distributed", 0)
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="set_epoch\\(3\\)"):
        fresh.set_epoch(4)
    loader.set_epoch(4)
    same_batches(batches(fresh), batches(loader))


@pytest.mark.parametrize("workers, save_before_the_epoch", [(0, False), (2, False), (0, True), (0, "after iter()")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_set_epoch_after_a_mid_epoch_state_gives_the_order_the_saved_run_gives_next(
    case, workers, save_before_the_epoch
):
    """A run that leaves epoch 2 early (a step limit), saves, and goes on with set_epoch(3); resumed from that save
    with set_epoch(3), epoch 3 came in epoch 2's order for a generator's or a sampler's own state: the saved state
    (before epoch 2's draw) was restored, and the draw epoch 2 had made was not made again. Also through a save
    taken after set_epoch(3), before the epoch's first batch. With workers the saved run had drawn batches ahead."""
    loader = make(case, workers, seed=5)
    loader.set_epoch(2)
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    state = loader.state_dict()
    del it
    loader.set_epoch(3)
    expected = batches(loader)
    loader.close()
    assert [y for _, y in head] != [y for _, y in expected[:2]] or case == "sequential"
    fresh = make(case, 0)
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="set_epoch\\(3\\)"):
        fresh.set_epoch(3)
    if save_before_the_epoch:  # a preemption before epoch 3's first batch, and a resume from there
        if save_before_the_epoch == "after iter()":
            iter(fresh)
        again = fresh.state_dict()
        fresh.close()
        fresh = make(case, 0)
        fresh.load_state_dict(again)
        fresh.set_epoch(3)
    same_batches(batches(fresh), expected)
    fresh.close()


def test_a_state_saved_before_batches_drawn_was_recorded_still_resumes_into_the_next_epoch():
    """States of session 40 and before lack `batches_drawn`: the batches yielded are taken as drawn (a loop that
    leaves an epoch early, the case set_epoch(next) meets), never the whole sampler (which may be endless)."""
    loader = make("shuffle_generator", 0, seed=5)
    loader.set_epoch(2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it, state["batches_drawn"]
    loader.set_epoch(3)
    expected = batches(loader)
    loader.close()
    fresh = make("shuffle_generator", 0)
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="set_epoch\\(3\\)"):
        fresh.set_epoch(3)
    same_batches(batches(fresh), expected)
    fresh.close()


def test_set_epoch_after_a_mid_epoch_state_of_a_sampler_on_torchs_rng_draws_as_the_saved_run():
    """A sampler drawing from torch's global RNG (no generator): nothing of it is in the state, so the left epoch's
    draw is not made again (it would take a permutation from the global RNG a restored script had put back)."""
    from torch.utils.data import SubsetRandomSampler

    def build(**kw):
        sampler = SubsetRandomSampler(range(len(DS)))
        return FusionFlowLoader(DS, policy=SMALL, tiny_batch_size=2, num_workers=0, batch_size=4, sampler=sampler, **kw)

    with pytest.warns(UserWarning, match="a resumed epoch will not repeat it"):
        loader = build(seed=5)
        loader.set_epoch(2)
        it = iter(loader)
        next(it)
        state, rng = loader.state_dict(), torch.get_rng_state()
    del it
    loader.set_epoch(3)
    expected = batches(loader)
    loader.close()
    fresh = build()
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)  # the script restores torch's RNG with the loader's state
    with pytest.warns(UserWarning, match="set_epoch\\(3\\)"):
        fresh.set_epoch(3)
    same_batches(batches(fresh), expected)
    fresh.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_only_the_newest_iteration_counts_into_the_state(num_workers):
    loader = make("sequential", num_workers, seed=5)
    old = iter(loader)
    next(old)
    new = iter(loader)  # supersedes the first (with workers, the old one then raises if continued)
    next(new), next(new)
    if num_workers == 0:
        next(old)  # an old iterator still running does not move the new epoch's position
    state = loader.state_dict()
    assert state["batches_yielded"] == 2 and state["epoch"] == 1
    del old, new
    loader.close()


@pytest.mark.parametrize("restore_rng", ["before", "after"])
def test_shuffle_without_generator_repeats_later_epochs_whenever_torchs_rng_is_restored(restore_rng):
    """A script restores torch's RNG state with the loader's before the resumed epoch (as it loads its checkpoint):
    the resumed epoch reuses the base seed its original drew, so the global RNG is where the saved run had it."""
    torch.manual_seed(123)
    loader = make("sequential", 2, shuffle=True, seed=5)
    it = iter(loader)
    next(it)
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest, following, third = batches(it), batches(loader), batches(loader)
    loader.close()
    torch.manual_seed(999)
    fresh = make("sequential", 2, shuffle=True)
    fresh.load_state_dict(through_torch_save(state))
    if restore_rng == "before":
        torch.set_rng_state(rng)
    same_batches(batches(fresh), rest)
    if restore_rng == "after":
        torch.set_rng_state(rng)
    same_batches(batches(fresh), following)
    same_batches(batches(fresh), third)
    fresh.close()


@pytest.mark.parametrize("how", ["loader", "sampler"])
def test_a_distributed_state_between_epochs_takes_the_epoch_the_script_sets(how):
    """Saved after epoch 0, loaded, then set_epoch(1) -- the loader's, or the sampler's own as torchvision's
    reference script calls it: epoch 1's order, not a replay of epoch 0's."""
    loader = make("distributed", 0, seed=5)
    loader.set_epoch(0)
    batches(loader)
    state = loader.state_dict()
    loader.set_epoch(1)
    expected = batches(loader)
    fresh = make("distributed", 0)
    fresh.load_state_dict(state)
    (fresh if how == "loader" else fresh.config.sampler).set_epoch(1)
    same_batches(batches(fresh), expected)


def test_a_state_taken_after_loading_and_set_epoch_keeps_the_position():
    """load_state_dict(mid-epoch state), set_epoch(that epoch) -- a training loop's first steps -- and a save
    before the first batch (a preemption there): the same position, not the epoch from its start."""
    loader = make("shuffle_generator", 0, seed=5)
    loader.set_epoch(2)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = batches(it)
    fresh = make("shuffle_generator", 0)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)
    again = fresh.state_dict()
    assert again["batches_yielded"] == 3 and again["epoch"] == 2
    last = make("shuffle_generator", 0)
    last.load_state_dict(again)
    last.set_epoch(2)
    got = batches(last)
    same_batches(got, rest)
    assert len(head) + len(got) == len(loader)


@pytest.mark.parametrize("case", ["shuffle_generator", "custom_state_dict", "distributed"])
def test_a_state_between_epochs_saved_again_after_loading_and_set_epoch_resumes_that_epoch(case):
    """A state from an epoch's end, loaded, set_epoch(next), saved again before its first batch (a preemption at
    the start of the resumed run): the run resumed from that gives the next epoch's order, not the first's."""
    loader = make(case, 0, seed=5)
    loader.set_epoch(0)
    first = batches(loader)
    state = loader.state_dict()
    loader.set_epoch(1)
    second = batches(loader)
    fresh = make(case, 0)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    again = fresh.state_dict()
    last = make(case, 0)
    last.load_state_dict(again)
    last.set_epoch(1)
    same_batches(batches(last), second)
    assert [y for _, y in first] != [y for _, y in second]


class PositionKeeping(DistributedSampler):
    """torchdata's StatefulDistributedSampler's documented behaviour: its state_dict() is its position in the epoch
    (reset by iter()), and a loaded position makes the next iter() skip that many indices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded, self.next_yielded = 0, None

    def __iter__(self):
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        for index in itertools.islice(super().__iter__(), self.yielded, None):
            self.yielded += 1
            yield index

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.next_yielded = state["yielded"]


def test_a_distributed_sampler_whose_state_is_more_than_its_position_is_resumed_by_that_state():
    """Only a position (torchdata's `yielded`) is left to the epoch: a subclass whose state_dict holds its order's
    state keeps it as the order's state."""
    from fusionflow.loader.sampler_order import order_owner

    class OwnOrder(PositionKeeping):
        def state_dict(self):
            return {"yielded": self.yielded, "permutation_seed": 7}

    keeping, own = (cls(DS, num_replicas=2, rank=0) for cls in (PositionKeeping, OwnOrder))
    assert order_owner(None, keeping)[1] == "epoch" and order_owner(None, own)[1] == "state_dict"


@pytest.mark.parametrize("k", [0, 3, None])
def test_a_distributed_sampler_keeping_its_position_resumes_as_its_epoch_gives(k):
    """Such a sampler's order is (seed, epoch)'s: resumed by its epoch, not by its state_dict (taken before iter(),
    it held the previous epoch's count: the resumed epoch was empty; and the loader skips what was yielded itself)."""

    def make_it():
        sampler = PositionKeeping(DS, num_replicas=2, rank=0, shuffle=True, seed=3)
        return FusionFlowLoader(DS, batch_size=3, sampler=sampler, policy=SMALL, seed=5)

    loader = make_it()
    loader.set_epoch(0)
    batches(loader)
    loader.set_epoch(1)
    if k is None:  # between epochs 0 and 1
        state, rest = loader.state_dict(), batches(loader)
    else:
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state, rest = loader.state_dict(), batches(it)
        assert len(head) == k
    fresh = make_it()
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    same_batches(batches(fresh), rest)
    assert rest


@pytest.mark.parametrize("started", [False, True])
def test_a_seedless_loader_saved_before_its_first_batch_resumes_with_the_pixels_its_generator_gives(started):
    """seed=None with generator=: the augmentation seed is the first epoch's draw from that generator. A state taken
    before it is drawn (after construction, or after iter()) records it, so a loader resumed from the state with a
    generator seeded otherwise (a new process's) renders the saved run's pixels, not its own generator's."""
    loader = make("shuffle_generator", 0, seed=None, generator=torch.Generator().manual_seed(11))
    it = iter(loader) if started else None
    state = loader.state_dict()
    want = batches(it if started else loader)
    fresh = make("shuffle_generator", 0, seed=None, generator=torch.Generator().manual_seed(22))
    fresh.load_state_dict(state)
    got = batches(fresh)
    same_batches(got, want)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want)) and fresh.seed == loader.seed == state["seed"]


class NoLength:
    """A batch sampler without __len__ (DataLoader iterates it; len(loader) raises as DataLoader's does)."""

    def __iter__(self):
        return iter([list(range(k, min(k + 4, len(DS)))) for k in range(0, len(DS), 4)])


def test_a_batch_sampler_without_len_can_be_checkpointed():
    loader = FusionFlowLoader(DS, batch_sampler=NoLength(), policy=SMALL)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["num_batches"] is None and state["batches_yielded"] == 1
    rest = batches(it)
    fresh = FusionFlowLoader(DS, batch_sampler=NoLength(), policy=SMALL)
    fresh.load_state_dict(state)
    same_batches(batches(fresh), rest)


@pytest.mark.parametrize("key,value", [("shuffle", False), ("seed", 10), ("drop_last", True)])
def test_a_distributed_state_into_a_sampler_built_otherwise_is_refused(key, value):
    """The order follows the sampler's shuffle, seed and drop_last: another one would lose and repeat samples."""
    state = make("distributed", 0).state_dict()
    kw = {**dict(num_replicas=2, rank=1, shuffle=True, seed=9), key: value}
    other = make("distributed", 0, sampler=DistributedSampler(DS, **kw))
    with pytest.raises(ValueError, match=f"DistributedSampler with {key}="):
        other.load_state_dict(state)


def test_a_distributed_state_saved_after_set_epoch_resumes_that_epochs_order():
    """set_epoch(2), a save before iterating, a fresh loader iterated without set_epoch: epoch 2's order. And a
    state taken right after iter() in the resumed loader records the sampler's epoch it will draw."""
    loader = make("distributed", 0, seed=5)
    loader.set_epoch(2)
    state = loader.state_dict()
    expected = batches(loader)
    fresh = make("distributed", 0)
    fresh.load_state_dict(state)
    same_batches(batches(fresh), expected)
    again = make("distributed", 0)
    again.load_state_dict(state)
    again.set_epoch(3)
    it = iter(again)
    mid = again.state_dict()
    assert mid["sampler"]["epoch"] == 3
    loader.set_epoch(3)
    same_batches(batches(it), batches(loader))


def test_a_batch_sampler_over_a_sampler_without_len_can_be_checkpointed():
    from torch.utils.data import BatchSampler

    class Unsized(Sampler):
        def __iter__(self):
            return iter(range(len(DS)))

    loader = FusionFlowLoader(DS, batch_sampler=BatchSampler(Unsized(), 4, False), policy=SMALL)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["num_batches"] is None
    rest = batches(it)
    fresh = FusionFlowLoader(DS, batch_sampler=BatchSampler(Unsized(), 4, False), policy=SMALL)
    fresh.load_state_dict(state)
    same_batches(batches(fresh), rest)


@pytest.mark.parametrize("taken", ["break", "len_batches"])
def test_a_state_taken_after_a_left_epoch_and_set_epoch_starts_that_epoch(taken):
    """A loop of a fixed number of steps leaves each epoch early (`break`, or exactly len() batches taken with next(),
    never seeing StopIteration), then calls set_epoch(e) and saves: the state mixed the left epoch's remaining batches
    with epoch e's number (with len() batches taken, the resumed epoch was empty and its samples lost)."""
    steps = 2 if taken == "break" else len(make("shuffle_generator", 0))
    loader = make("shuffle_generator", 0, seed=5)
    expected, state = [], None
    for epoch in range(3):
        loader.set_epoch(epoch)
        if epoch == 1:
            state = through_torch_save(loader.state_dict())
        it = iter(loader)
        got = batches(itertools.islice(it, steps))
        if epoch >= 1:
            expected += got
    loader.close()
    assert state["batches_yielded"] is None and state["epoch"] == 1
    again = make("shuffle_generator", 0)
    again.load_state_dict(state)
    got = []
    for epoch in (1, 2):
        again.set_epoch(epoch)
        got += batches(itertools.islice(iter(again), steps))
    again.close()
    same_batches(got, expected)


@pytest.mark.parametrize("taken", ["break", "len_batches"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_after_a_left_epoch_without_set_epoch_resumes_into_the_next_epoch(taken, num_workers):
    """The same fixed-steps loop without set_epoch: saved after the `break` (or after len() batches taken with next()),
    the state resumed the left epoch's remaining batches (or an empty epoch), where the original loader's next iter()
    starts the next epoch."""
    steps = 2 if taken == "break" else len(make("shuffle_generator", 0))
    loader = make("shuffle_generator", num_workers, seed=5)
    for _ in itertools.islice(loader, steps):  # (the islice's iterator is dropped here: the epoch is left)
        pass
    state = through_torch_save(loader.state_dict())
    expected = [batches(iter(loader)) for _ in range(2)]  # epochs 1 and 2, whole
    loader.close()
    assert state["batches_yielded"] is None and state["epoch"] == 0
    again = make("shuffle_generator", num_workers)
    again.load_state_dict(state)
    got = [batches(iter(again)) for _ in range(2)]
    again.close()
    for g, e in zip(got, expected, strict=True):
        same_batches(g, e)


@pytest.mark.parametrize("case", ["shuffle_generator", "distributed"])
def test_a_state_taken_at_an_epochs_last_batch_inside_the_loop_resumes_that_epoch_s_empty_rest(case):
    """A step-based save landing on an epoch's last batch, the script resuming with set_epoch(saved epoch): the
    workers had drawn every batch by then, and the state was read as between epochs (a left one's rule), so the
    resumed run replayed that epoch whole."""
    loader, expected, state = make(case, 2), [], None
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, (_, y) in enumerate(loader):
            if state is not None:
                expected.append(y.tolist())
            if epoch == 0 and i == len(loader) - 1:
                state = through_torch_save(loader.state_dict())
    loader.close()
    assert state["batches_yielded"] == len(loader)
    again = make(case, 2)
    again.load_state_dict(state)
    got = []
    for epoch in range(2):
        again.set_epoch(epoch)
        got += [y.tolist() for _, y in again]
    again.close()
    assert got == expected


@pytest.mark.parametrize("case", ["drop_last", "batches_divide_the_set"])
def test_a_state_at_the_last_batch_resumed_with_the_next_set_epoch_draws_the_original_s_next_order(case):
    """In this process (num_workers=0) the batch sampler had not seen its end when the state was taken at the last
    batch; the loop's end then ran it out, and torch's RandomSampler draws once more there (its remainder's
    randperm). The resumed loader's set_epoch(e + 1) replayed only the batches drawn, so every later order differed
    (with workers the prefetch had run it out already)."""

    def fresh(**more):
        if case == "drop_last":
            return make(case, 0, **more)
        return FusionFlowLoader(Bytes(30), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7),
                                policy=SMALL, tiny_batch_size=2, **more)  # fmt: skip

    loader = fresh(seed=5)
    loader.set_epoch(0)
    n = len(loader)
    for i, _ in enumerate(loader):
        if i == n - 1:
            state = through_torch_save(loader.state_dict())
    loader.set_epoch(1)
    expected = batches(loader)
    loader.close()
    again = fresh()
    again.load_state_dict(state)
    with pytest.warns(UserWarning, match="starts from its first batch"):
        again.set_epoch(1)
    same_batches(batches(again), expected)
    again.close()


def test_set_epoch_of_the_epoch_being_iterated_keeps_its_position():
    """A script calling set_epoch(e) inside its loop over epoch e (a per-step hook): the state still holds the
    batches yielded (a first cut of the left-epoch rule above dropped them: the resumed run replayed the epoch)."""
    loader = make("shuffle_generator", 0, seed=5)
    loader.set_epoch(0)
    it = iter(loader)
    head = batches(itertools.islice(it, 2))
    loader.set_epoch(0)
    head += batches(itertools.islice(it, 1))
    state = loader.state_dict()
    rest = batches(it)
    loader.close()
    assert state["batches_yielded"] == 3
    again = make("shuffle_generator", 0)
    again.load_state_dict(state)
    same_batches(batches(again), rest)
    again.close()


class Buckets(Sampler):
    """A batch sampler that shuffles its own batches (bucketing by size) from a generator of its own, or from
    torch's global RNG with generator=None; it has no `sampler` attribute."""

    def __init__(self, n, size, generator):
        self.n, self.size, self.generator = n, size, generator

    def __iter__(self):
        batches = [list(range(i, min(i + self.size, self.n))) for i in range(0, self.n, self.size)]
        return iter([batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()])

    def __len__(self):
        return -(-self.n // self.size)


def test_a_batch_samplers_own_generator_is_captured_and_a_global_one_warns():
    """A custom batch sampler's `generator` was not captured (the state said "none", no warning): the resumed epoch
    drew another order, duplicating and losing samples."""
    loader = FusionFlowLoader(DS, batch_sampler=Buckets(len(DS), 4, torch.Generator().manual_seed(3)), policy=SMALL)
    batches(loader)
    it = iter(loader)
    head = batches(itertools.islice(it, 2))
    state = through_torch_save(loader.state_dict())
    rest = batches(it)
    loader.close()
    again = FusionFlowLoader(DS, batch_sampler=Buckets(len(DS), 4, torch.Generator().manual_seed(99)), policy=SMALL)
    again.load_state_dict(state)
    got = batches(again)
    again.close()
    same_batches(got, rest)
    assert sorted(i for _, y in head + got for i in y) == list(range(len(DS)))
    on_global = FusionFlowLoader(DS, batch_sampler=Buckets(len(DS), 4, None), policy=SMALL)
    with pytest.warns(UserWarning, match="Buckets draws its order from torch's global RNG"):
        on_global.state_dict()
    older = {**state, "sampler": {"kind": "none"}}  # as saved before such a generator was captured: loads, warns
    legacy = FusionFlowLoader(DS, batch_sampler=Buckets(len(DS), 4, torch.Generator().manual_seed(3)), policy=SMALL)
    with pytest.warns(UserWarning, match="saved before FusionFlow captured a batch sampler's own generator"):
        legacy.load_state_dict(older)
    assert len(batches(legacy)) == len(rest)  # the rest of the epoch, in the order it draws now
    legacy.close()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("seed", "drop", "no 'seed'"),
        ("seed", -1, r"state\['seed'\]=-1"),
        ("seed", "x", r"state\['seed'\]='x'"),
        ("epoch", -3, r"state\['epoch'\]=-3"),
        ("epoch", 2**64, r"state\['epoch'\]=18446744073709551616.*below 2\*\*63"),
        ("epoch", np.int64(3), r"state\['epoch'\]=np.int64\(3\)"),  # a later save would not load (weights_only)
        ("iterations", 1.5, r"state\['iterations'\]"),
        ("batches_yielded", True, r"state\['batches_yielded'\]=True"),
        ("batches_drawn", ["a", "b"], r"state\['batches_drawn'\]"),
        ("sampler", {"kind": "generator"}, "no state of a cpu torch.Generator"),
        ("sampler", {"kind": "generator", "state": torch.zeros(3, dtype=torch.uint8)}, "torch.Generator"),
    ],
)
def test_a_bad_state_is_refused_naming_the_field_and_changes_nothing(field, value, match):
    """Bad values were half-applied (a missing seed raised KeyError after the resume was set) or accepted to fail
    later: a negative seed with on_error='skip' silently delivered an empty epoch."""
    loader = make("shuffle_generator", 0, seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    if value == "drop":
        del state[field]
    else:
        state[field] = value
    fresh, untouched = make("shuffle_generator", 0, seed=5), make("shuffle_generator", 0, seed=5)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    same_batches(batches(fresh), batches(untouched))  # as if nothing had been loaded
    fresh.close()
    untouched.close()


@pytest.mark.parametrize(
    "sampler,match",
    [
        (lambda g: torch.utils.data.WeightedRandomSampler([1.0] * len(DS), len(DS), generator=g), "WeightedRandom"),
        (lambda g: torch.utils.data.RandomSampler(DS, replacement=True, generator=g), "replacement=True"),
    ],
)
def test_a_state_of_another_sampler_class_or_replacement_is_refused(sampler, match):
    """A shuffle=True state loaded into a loader over a WeightedRandomSampler (both capture a generator) was accepted
    and replayed another order."""
    state = make("shuffle_generator", 0, seed=5).state_dict()
    other = FusionFlowLoader(DS, batch_size=5, sampler=sampler(torch.Generator().manual_seed(7)), policy=SMALL)
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(state)


def test_a_state_between_iter_and_next_of_a_shuffle_on_torchs_rng_resumes_that_epoch_without_the_rng():
    """shuffle=True without a generator, the state taken after iter() but before the first next(): the epoch's order,
    not yet drawn, was left to the resumed run's RNG (a state after one batch resumed exactly)."""
    torch.manual_seed(0)
    loader = FusionFlowLoader(DS, batch_size=4, shuffle=True, policy=SMALL, seed=5)
    batches(loader)
    it = iter(loader)
    state, rng = loader.state_dict(), torch.get_rng_state()
    expected = batches(it)
    following = batches(loader)
    loader.close()
    torch.manual_seed(1)  # the resumed process's RNG, not restored
    again = FusionFlowLoader(DS, batch_size=4, shuffle=True, policy=SMALL, seed=5)
    again.load_state_dict(state)
    same_batches(batches(again), expected)
    again.close()
    torch.set_rng_state(rng)  # restored with the checkpoint: the resumed epoch draws from it as the saved run did,
    again = FusionFlowLoader(DS, batch_size=4, shuffle=True, policy=SMALL, seed=5)
    again.load_state_dict(state)
    same_batches(batches(again), expected)
    same_batches(batches(again), following)  # so the next epoch repeats too
    again.close()


class _EpochBuckets:
    """A batch sampler of one's own whose order is a function of (its seed, epoch), with set_epoch (a bucketing or
    distributed batch sampler), over no sampler."""

    def __init__(self, n, seed=3):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        return iter([order[k : k + 4].tolist() for k in range(0, self.n, 4)])

    def __len__(self):
        return (self.n + 3) // 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_ordered_by_its_own_epoch_is_resumed_in_that_epoch(num_workers):
    """Its epoch was not recorded (the state said kind 'none'): a loader resumed without set_epoch replayed epoch 0's
    order from the saved position, delivering 6 samples twice and losing 6. It is recorded and set again now."""
    kw = dict(policy=SMALL, tiny_batch_size=2, num_workers=num_workers, seed=5)
    ref = FusionFlowLoader(DS, batch_sampler=_EpochBuckets(len(DS)), **kw)
    batches(ref)
    ref.set_epoch(1)
    it = iter(ref)
    head = [next(it) for _ in range(3)]
    state = through_torch_save(ref.state_dict())
    rest = batches(it)
    ref.close()
    resumed = FusionFlowLoader(DS, batch_sampler=_EpochBuckets(len(DS)), **kw)
    resumed.load_state_dict(state)
    got = batches(resumed)
    resumed.close()
    same_batches(got, rest)
    delivered = [i for _, y in head for i in y.tolist()] + [i for _, y in got for i in y]
    assert sorted(delivered) == list(range(len(DS)))


@pytest.mark.parametrize("set_epoch", [False, True])
def test_an_iterator_dropped_before_its_first_batch_leaves_a_loaded_state_pending(set_epoch):
    """load_state_dict, an iter() never advanced (a wrapper that calls it eagerly), then the loop: the resumed order
    came with the next epoch's augmentation (the dropped iterator had counted as the epoch). Now the loop gets the
    saved epoch's remaining batches and pixels, and the epoch after."""
    head, state, rest, following = reference(make("shuffle_generator", 0, seed=5), 3, set_epoch)
    loader = make("shuffle_generator", 0)
    loader.load_state_dict(through_torch_save(state))
    if set_epoch:
        loader.set_epoch(0)
    iter(loader)  # made and dropped at once
    got_rest = batches(loader)
    if set_epoch:
        loader.set_epoch(1)
    got_following = batches(loader)
    loader.close()
    same_batches(got_rest, rest)
    same_batches(got_following, following)


def test_a_state_loaded_into_a_loader_with_another_policy_warns_and_resumes_its_order():
    """A state fits a loader of the same dataset length, batch_size, drop_last and sampler; another policy was taken
    without a word, every resumed pixel differing from the saved run's. It warns now (a progressive resize changes
    the policy on purpose): the order is the saved run's. The same policy read from elsewhere does not warn."""
    head, state, rest, _ = reference(make("shuffle_generator", 0, seed=5), 3, False)
    other = {**SMALL, "flip": 0.0}
    loader = make("shuffle_generator", 0, policy=other)
    with pytest.warns(UserWarning, match="saved by a loader with another policy"):
        loader.load_state_dict(through_torch_save(state))
    assert [y for _, y in batches(loader)] == [y for _, y in rest]
    loader.close()
    same = make("shuffle_generator", 0, policy=dict(SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)
    same_batches(batches(same), rest)
    same.close()
