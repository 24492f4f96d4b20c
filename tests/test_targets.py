"""Targets of any type arrive exactly as torch's DataLoader delivers them (runtime/targets.py): ints on
the shared-memory fast path, everything else collated with default_collate in the training process."""

import secrets

import numpy as np
import pytest
import torch
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.runtime import messages as m
from fusionflow.runtime.targets import gather, in_ring, store, store_works
from fusionflow.scheduling.queue import Work

TARGETS = {
    "int": lambda i: i,
    "float": lambda i: i + 0.5,  # sample 0's target is 0.5: int(0.5) would be 0
    "mixed": lambda i: i if i % 2 else i / 4,  # default_collate decides by the first element: kept
    "np_int64": lambda i: np.int64(i),
    "np_float32": lambda i: np.float32(i) / 3,
    "bool": lambda i: bool(i % 3),
    "big_int": lambda i: 2**62 + i,
    "one_hot": lambda i: torch.nn.functional.one_hot(torch.tensor(i % 5), 5).float(),
    "soft": lambda i: torch.tensor([i / 64, 1 - i / 64], dtype=torch.float64),
    "scalar_tensor": lambda i: torch.tensor(i),
    "str": lambda i: f"class_{i}",
    "dict": lambda i: {"label": i, "box": torch.tensor([i, i + 0.25]), "name": f"n{i}"},
    "tuple": lambda i: (i, i / 8),
    "np_array": lambda i: np.array([i, -i], dtype=np.int16),
}
# default_collate cannot batch these (a torchvision detection target: boxes of varying count; None): a collate_fn does
COLLATE_FN_ONLY = {
    "boxes": lambda i: {"boxes": torch.arange((1 + i % 3) * 4.0).reshape(-1, 4), "labels": torch.full((1 + i % 3,), i)},
    "none_or_int": lambda i: None if i % 2 else i,
}


class Targets(Bytes):
    """(jpeg bytes, target of kind `kind` computed from the index)."""

    def __init__(self, kind, n=23, bad=()):
        super().__init__(n, bad=bad)
        self.kind = kind  # (a name, not the function: the dataset pickles, for lent workers)

    def __getitem__(self, i):
        sample, _ = super().__getitem__(i)
        return sample, {**TARGETS, **COLLATE_FN_ONLY}[self.kind](i)


def same(a, b, where="targets"):
    """Equal values, types, dtypes and shapes, recursively."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def dataloader_targets(ds, batches):
    """What torch's DataLoader delivers as targets for these batches of indices."""
    return [t for _, t in DataLoader(ds, batch_sampler=batches)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_every_target_kind_arrives_as_dataloader_delivers_it(kind, num_workers):
    ds = Targets(kind)
    loader = FusionFlowLoader(ds, batch_size=7, num_workers=num_workers, policy=SMALL, tiny_batch_size=3, seed=1)
    images, got = collect(loader)
    batches = list(BatchSampler(SequentialSampler(ds), 7, False))
    expected = dataloader_targets(ds, batches)
    assert len(got) == len(expected) == 4
    for k, (a, b) in enumerate(zip(got, expected)):
        same(a, b, f"batch {k}")
    pipe = CpuPipeline(SMALL)  # pixels are unaffected by the target's type
    assert np.array_equal(images[1][2].numpy(), pipe(ds.data[9], 9, seed=1, epoch=0))


def test_store_works_puts_each_target_in_its_works_slot_in_order():
    ring = np.zeros((2, 4), np.int64)
    works = [Work(0, 1, 1, 0, (2, 0), (7, 5)), Work(0, 1, 0, 0, (3,), (9,))]
    done = store_works(ring, works, [11, "cat", 13])
    assert ring.tolist() == [[0, 0, 0, 13], [0, 0, 11, 0]]
    assert [(w is works[i], side) for i, (w, side) in enumerate(done)] == [(True, {0: "cat"}), (True, {})]


def test_store_works_all_ints_in_one_assignment_agrees_with_one_by_one():
    """The all-int path stores exactly what the per-sample path stores; an int beyond int64 or a bool
    among them sends the run the per-sample way (the odd one on the side)."""
    works = [Work(0, 1, 1, 0, (2, 0), (7, 5)), Work(0, 1, 0, 0, (3, 1), (9, 4))]
    for second, ring_value, side in ((12, 12, {}), (2**63, 0, {0: 2**63}), (True, 0, {0: True})):
        ring = np.zeros((2, 4), np.int64)
        done = store_works(ring, works, [11, second, 13, 14])
        assert ring.tolist() == [[0, 14, 0, 13], [ring_value, 0, 11, 0]]  # slot 1: positions 2, 0; slot 0: 3, 1
        assert [(w is works[i], s) for i, (w, s) in enumerate(done)] == [(True, side), (True, {})]
        assert all(type(v) is type(second) for v in side.values())


def test_float_label_keeps_its_fraction():
    loader = FusionFlowLoader(Targets("float", n=4), batch_size=4, policy=SMALL)
    _, (y,) = collect(loader)
    assert y.dtype == torch.float64 and y.tolist() == [0.5, 1.5, 2.5, 3.5]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["int", "float", "dict", "str", "one_hot"])
def test_skipped_samples_are_dropped_from_the_targets_too(kind, num_workers):
    bad = {3, 9, 10}
    ds = Targets(kind, bad=bad)
    loader = FusionFlowLoader(
        ds, batch_size=7, num_workers=num_workers, policy=SMALL, tiny_batch_size=2, on_error="skip"
    )
    with pytest.warns(UserWarning, match="on_error='skip'"):
        _, got = collect(loader)
    kept = [[i for i in b if i not in bad] for b in BatchSampler(SequentialSampler(ds), 7, False)]
    expected = dataloader_targets(ds, kept)
    for k, (a, b) in enumerate(zip(got, expected)):
        same(a, b, f"batch {k}")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["dict", "boxes", "none_or_int"])
def test_collate_fn_gets_targets_as_the_dataset_returned_them(num_workers, kind):
    """Targets reach a collate_fn untouched: default_collate never runs on them first (it failed on detection
    targets, where DataLoader with `collate_fn=lambda b: tuple(zip(*b))` works)."""
    ds = Targets(kind)

    def collate(batch):
        return [t for _, t in batch]

    loader = FusionFlowLoader(ds, batch_size=5, num_workers=num_workers, policy=SMALL, collate_fn=collate)
    got = list(loader)
    expected = list(DataLoader(ds, batch_size=5, collate_fn=collate))
    same(got, expected)


def test_accelerator_samples_carry_any_target():
    pytest.importorskip("nvidia.dali")
    ds = Targets("soft", n=30)
    loader = FusionFlowLoader(ds, batch_size=10, num_workers=1, policy=SMALL, tiny_batch_size=2, accelerator="dali-cpu")
    _, got = collect(loader)
    assert loader.stats.accelerator_tiny_batches > 0
    expected = dataloader_targets(ds, list(BatchSampler(SequentialSampler(ds), 10, False)))
    for k, (a, b) in enumerate(zip(got, expected)):
        same(a, b, f"batch {k}")


def test_lent_workers_deliver_any_target():
    """A worker lent by another loader (worker lending, runtime/gm/manager.py) sends the borrower's
    targets along with its completions, as the borrower's own workers do."""
    name = "test-" + secrets.token_hex(6)
    slow, fast = Targets("dict", n=40), Bytes(40)
    slow.sleep = 0.04
    args = dict(
        batch_size=8, num_workers=1, policy=SMALL, persistent_workers=True, pin_workers=False, global_manager=name
    )
    a, b = FusionFlowLoader(slow, seed=11, **args), FusionFlowLoader(fast, seed=3, **args)
    try:
        collect(b)  # b's worker is idle from now on: the GM lends it to a
        _, got = collect(a)
        expected = dataloader_targets(slow, list(BatchSampler(SequentialSampler(slow), 8, False)))
        for k, (x, y) in enumerate(zip(got, expected)):
            same(x, y, f"batch {k}")
    finally:
        a.close()
        b.close()
    assert a.stats.borrowed_tiny_batches > 0


def test_only_python_ints_take_the_ring():
    assert in_ring(0) and in_ring(2**63 - 1) and in_ring(-(2**63))
    assert not any(in_ring(t) for t in (2**63, True, np.int64(1), 0.0, torch.tensor(1), "1"))
    row, side = np.zeros(4, np.int64), {}
    for pos, t in enumerate([5, 0.5, "x", 7]):
        store(row, pos, t, side)
    assert row.tolist()[::3] == [5, 7] and side == {1: 0.5, 2: "x"}
    assert gather(row, [0, 2, 3], side) == [5, "x", 7] and type(gather(row, [0], side)[0]) is int


def test_done_message_carries_targets_only_when_needed():
    failure = m.SampleFailure(1, 4, "sample 4", "ValueError", "bad", "tb")
    assert m.unpack_done(m.pack_done(3, 2, [])) == (3, 2, [], {})
    assert len(m.pack_done(3, 2, [], targets={})) == len(m.pack_done(3, 2, []))  # int targets: fixed-size message
    assert m.unpack_done(m.pack_done(3, 2, [failure], targets={0: "a"})) == (3, 2, [failure], {0: "a"})
    assert m.unpack_done(m.pack_done(3, 2, [], targets={2: {"y": 1.5}})) == (3, 2, [], {2: {"y": 1.5}})


def test_collated_targets_move_to_the_device_structure_kept():
    """With device='cuda' (or pin_memory) every tensor of a collated target goes there; the structure --
    dicts, namedtuples, tuples, lists, strings -- is kept. (Checked here with a marking function.)"""
    from collections import namedtuple

    from fusionflow.runtime.targets import map_tensors as _map_tensors

    Pair = namedtuple("Pair", "a b")
    collated = {"y": torch.tensor([1.0]), "p": Pair(torch.tensor([2]), ("s", "t")), "l": [torch.tensor([3])]}
    moved = _map_tensors(collated, lambda t: t + 10)
    same(moved, {"y": torch.tensor([11.0]), "p": Pair(torch.tensor([12]), ("s", "t")), "l": [torch.tensor([13])]})


def test_namedtuple_targets_travel_to_a_process_that_cannot_import_their_class():
    """A namedtuple class of the training script's __main__ cannot be imported by a Ray actor or gateway, nor by a
    SharedLoader client: pickled by reference it ended the Ray gateway. It travels by its name and fields; where the
    class cannot be imported a namedtuple of that name and fields stands in, where it can the class itself comes."""
    import collections
    import pickle

    from fusionflow.runtime import targets as ff_targets

    here = collections.namedtuple("Here", "image label key")
    here.__module__, here.__qualname__ = "__main__", "Nowhere"  # not importable in this process either
    back = pickle.loads(pickle.dumps(ff_targets.Fields(here, (2, "x"))))
    assert back.kind is not here and back.kind._fields == here._fields and back.kind.__qualname__ == "Nowhere"
    assert back.kind(1, *back.values) == (1, 2, "x") and back.kind(1, *back.values).key == "x"
    assert pickle.loads(pickle.dumps(back)).kind is back.kind  # one stand-in class: its batches are one class
    kept = pickle.loads(pickle.dumps(ff_targets.Fields(Triple, (3, 4))))
    assert kept.kind is Triple and kept == ff_targets.Fields(Triple, (3, 4))


Triple = __import__("collections").namedtuple("Triple", "image a b")
