"""Repeated augmentation: every copy of an index a sampler yields in one epoch is augmented
differently, reproducibly, wherever its tiny-batch runs."""

import math

import numpy as np
import pytest
import torch
from dali_numpy import run_numpy
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401
from torch.utils.data import Sampler

from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import draw, load_policy, uniforms
from fusionflow.runtime import messages as m
from fusionflow.scheduling.tiny_batches import Copies, split_sorted


class RepeatSampler(Sampler):
    """Repeated augmentation as timm's/torchvision's RASampler deals it (written from its description):
    a shuffled order with each index repeated `repeats` times in a row, split round-robin over ranks."""

    def __init__(self, n, repeats=3, rank=0, num_replicas=1, seed=0):
        self.n, self.repeats, self.rank, self.num_replicas, self.seed, self.epoch = (
            n,
            repeats,
            rank,
            num_replicas,
            seed,
            0,
        )

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = [i for i in torch.randperm(self.n, generator=g).tolist() for _ in range(self.repeats)]
        total = math.ceil(len(order) / self.num_replicas) * self.num_replicas
        order += order[: total - len(order)]
        return iter(order[self.rank : total : self.num_replicas])

    def __len__(self):
        return math.ceil(self.n * self.repeats / self.num_replicas)


def test_copies_count_occurrences_per_rank():
    c = Copies()
    assert c([5, 5, 7]) == [0, 1, 0] and c([7, 5, 100]) == [1, 2, 0]
    r = Copies(rank=2, world_size=3)
    assert r([5, 5]) == [2, 5]
    with pytest.raises(ValueError, match=r"rank=3 must be in 0\.\.world_size-1=2"):
        Copies(3, 3)
    # RASampler over 3 ranks: each rank sees each index once, yet the three copies get three numbers
    numbers = {}
    for rank in range(3):
        counter = Copies(rank, 3)
        for i, c in zip(RepeatSampler(10, 3, rank, 3), counter(list(RepeatSampler(10, 3, rank, 3)))):
            numbers.setdefault(i, []).append(c)
    assert all(sorted(v) == [0, 1, 2] for v in numbers.values())


def test_copy_zero_is_the_default_and_copies_differ():
    policy = load_policy("randaugment")
    for i in range(10):
        assert draw(policy, 3, 1, i).crop_u == tuple(uniforms(3, 1, i, 0, n=40).tolist())
        assert draw(policy, 3, 1, i) == draw(policy, 3, 1, i, 0)
        draws = [draw(policy, 3, 1, i, c) for c in range(4)]
        assert len({d.crop_u for d in draws}) == 4
    with pytest.raises(ValueError, match=r"copy=-1 must be a non-negative integer"):
        draw(policy, 0, 0, 0, -1)


def test_copies_travel_with_tiny_batches_and_tasks():
    tiny = split_sorted([4, 4, 9, 1], None, 2, [0, 1, 0, 0])
    assert [(t.indices, t.copies) for t in tiny] == [((4, 4), (0, 1)), ((9, 1), ())]
    for copies in ((), (0, 7, 3)):
        task = m.Task(1, 2, 3, 4, (0, 1, 2), (10, 11, 12), copies)
        assert m.unpack_task(m.pack_task(task)) == task


def _images_by_copy(loader, epoch):
    loader.set_epoch(epoch)
    images, labels = collect(loader)
    seen = {}
    for x, y in zip(images, labels):
        for img, i in zip(x.numpy(), y.tolist()):
            seen.setdefault(i, []).append(img)
    return seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_copy_is_distinct_and_equals_the_pipeline_with_its_copy_number(num_workers):
    ds = Bytes(12)
    ld = FusionFlowLoader(
        ds, batch_size=6, sampler=RepeatSampler(12, 3), num_workers=num_workers, policy=SMALL, tiny_batch_size=2, seed=4
    )
    pipe = CpuPipeline(SMALL)
    try:
        seen = _images_by_copy(ld, 1)
    finally:
        ld.close()
    assert sorted(seen) == list(range(12))
    for i, imgs in seen.items():
        assert len(imgs) == 3
        assert len({img.tobytes() for img in imgs}) == 3, f"sample {i}: copies are not distinct"
        for c, img in enumerate(imgs):  # the sampler yields copies in order: occurrence c is copy c
            assert np.array_equal(img, pipe(ds.data[i], i, seed=4, epoch=1, copy=c)), (i, c)


def test_same_images_with_zero_and_two_workers_and_across_ranks():
    ds = Bytes(12)
    runs = []
    for workers in (0, 2):
        ld = FusionFlowLoader(
            ds, batch_size=6, sampler=RepeatSampler(12, 3), num_workers=workers, policy=SMALL, tiny_batch_size=2, seed=4
        )
        try:
            runs.append(_images_by_copy(ld, 0))
        finally:
            ld.close()
    assert all(np.array_equal(a, b) for i in runs[0] for a, b in zip(runs[0][i], runs[1][i]))
    # three ranks (the sampler's rank/num_replicas): each gets one copy of every index; all differ
    per_rank = [
        _images_by_copy(FusionFlowLoader(ds, batch_size=4, sampler=RepeatSampler(12, 3, r, 3), policy=SMALL, seed=4), 0)
        for r in range(3)
    ]
    for i in range(12):
        imgs = [img for run in per_rank for img in run[i]]
        assert len(imgs) == 3 and len({img.tobytes() for img in imgs}) == 3, i
        assert any(np.array_equal(img, runs[0][i][0]) for img in imgs)  # rank 0's is the single-process copy 0


def test_dali_accelerator_uses_the_copy_number():
    pytest.importorskip("nvidia.dali")
    from tv_reference import psnr

    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    ds = Bytes(4)
    dp = DaliPolicyPipeline(SMALL, batch_size=6)
    idx, copies = [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]
    out = run_numpy(dp, [ds.data[i] for i in idx], idx, seed=4, epoch=2, copies=copies)
    cpu = CpuPipeline(load_policy({**SMALL, "decode": {"mode": "exact"}}))
    for k, (i, c) in enumerate(zip(idx, copies)):
        # DALI and the CPU differ by decode/resize rounding (amplified by Posterize at 24 px), far less
        # than two copies' augmentations differ: DALI's copy c is nearest the CPU's copy c
        scores = [psnr(out[k], cpu(ds.data[i], i, seed=4, epoch=2, copy=o)) for o in range(3)]
        assert int(np.argmax(scores)) == c, (i, c, scores)
    # and through the loader: CPU workers and the accelerator share mini-batches
    ld = FusionFlowLoader(
        ds,
        batch_size=6,
        sampler=RepeatSampler(4, 3),
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        accelerator="dali-cpu",
        seed=4,
    )
    try:
        seen = _images_by_copy(ld, 2)
        assert ld.stats.accelerator_tiny_batches > 0
    finally:
        ld.close()
    for i, imgs in seen.items():
        for c, img in enumerate(imgs):
            ref = CpuPipeline(SMALL)(ds.data[i], i, seed=4, epoch=2, copy=c)  # the loader's (fast) CPU path
            single = run_numpy(dp, [ds.data[i]], [i], seed=4, epoch=2, copies=[c])[0]
            assert np.array_equal(img, ref) or np.array_equal(img, single), (i, c)


@pytest.mark.parametrize("workers", [(2, 0), (0, 2)])
def test_resume_mid_epoch_keeps_the_copy_numbers_of_repeated_indices(workers):
    """A resumed epoch skips the batches already yielded; their occurrences must still count, or the
    copies after the resume point would repeat the pixels of earlier copies."""

    def make(num_workers):
        return FusionFlowLoader(
            Bytes(12),
            batch_size=4,
            sampler=RepeatSampler(12, 3, seed=4),
            policy=SMALL,
            tiny_batch_size=2,
            num_workers=num_workers,
            seed=5,
        )

    first = make(workers[0])
    it = iter(first)
    next(it), next(it)  # 2 of 9 batches: some indices' first copies are behind the resume point
    state = first.state_dict()
    rest = [(x.clone(), y.tolist()) for x, y in it]
    first.close()
    second = make(workers[1])
    second.load_state_dict(state)
    got = [(x.clone(), y.tolist()) for x, y in second]
    second.close()
    assert [y for _, y in got] == [y for _, y in rest] and len(rest) == 7
    for (x, _), (ex, _) in zip(got, rest):
        assert torch.equal(x, ex)
