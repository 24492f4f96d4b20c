"""Per-sample draws: deterministic in (seed, epoch, index), distributed as the policy says."""

import dataclasses
import itertools
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from scipy import stats

from fusionflow import load_policy
from fusionflow.policy import crop_window, draw, philox, uniforms
from fusionflow.policy.sampling import run_uniforms

N = 6000
P_MIN = 1e-4  # chi-square p-value below which a distribution is rejected (fixed seeds: no flakes)


def test_draw_is_a_pure_function_of_seed_epoch_index():
    p = load_policy("randaugment")
    assert draw(p, 3, 1, 17) == draw(p, 3, 1, 17)
    others = [draw(p, 4, 1, 17), draw(p, 3, 2, 17), draw(p, 3, 1, 18)]
    assert all(o != draw(p, 3, 1, 17) for o in others)
    with pytest.raises(ValueError, match="index=-1 must be a non-negative integer"):
        draw(p, 0, 0, -1)


def test_uniforms_are_a_counter_based_stream_per_sample():
    # the stream's prefix does not depend on its length, and the same key recomputes it in another thread
    u = uniforms(5, 2, 9, 1, n=300)
    assert np.array_equal(uniforms(5, 2, 9, 1, n=40), u[:40])
    with ThreadPoolExecutor(4) as pool:
        assert all(np.array_equal(v, u) for v in pool.map(lambda _: uniforms(5, 2, 9, 1, n=300), range(8)))
    # every key component moves the stream; 128-bit seeds use both key words, wider ones fold in
    keys = [(5, 2, 9, 1), (6, 2, 9, 1), (5, 3, 9, 1), (5, 2, 10, 1), (5, 2, 9, 0), (5 + (1 << 64), 2, 9, 1)]
    keys += [(5 + (1 << 128), 2, 9, 1), (2**64 - 1, 2**64 - 1, 2**64 - 1, 2**64 - 1)]
    firsts = {tuple(uniforms(*k, n=8)) for k in keys}
    assert len(firsts) == len(keys)
    for name, bad in (("epoch", 2**64), ("index", -1), ("copy", 1.0), ("seed", True)):
        args = dict(seed=0, epoch=0, index=0, copy=0) | {name: bad}
        with pytest.raises(ValueError, match=f"{name}="):
            uniforms(**args)
    # uniform on [0, 1), and neighbouring samples' streams uncorrelated
    flat = np.concatenate([uniforms(0, 0, i, n=64) for i in range(2000)])
    assert 0.0 <= flat.min() and flat.max() < 1.0
    assert stats.kstest(flat, "uniform").pvalue > P_MIN
    firsts = np.array([uniforms(0, 0, i, n=1)[0] for i in range(4000)])
    assert abs(stats.pearsonr(firsts[:-1], firsts[1:]).statistic) < 0.07


def test_the_native_kernel_computes_numpys_philox_streams():
    # the kernel against numpy's own Philox positioned per sample: keys, counters at the top of their words,
    # positions past the first block and lengths that end inside a block
    assert philox.native()  # a compiler is part of the test machine: this must not silently test numpy twice
    rng = np.random.default_rng(0)
    top = 2**64 - 1
    for key in [(0, 0), (5, 0), (top, top), tuple(int(k) for k in rng.integers(0, 2**63, 2))]:
        for epoch in (0, 3, top):
            indices = np.array([0, 1, 17, top, 2**63], np.uint64)
            copies = np.array([0, 2, 0, top, 1], np.uint64)
            for first, count in ((0, 96), (96, 96), (4, 41), (0, 1)):
                got = philox.uniforms_many(key, epoch, indices, copies, first, count)
                for i, c, row in zip(indices.tolist(), copies.tolist(), got):
                    want = philox.numpy_generator(key, epoch, i, c, first).random(count)
                    assert np.array_equal(row, want), (key, epoch, i, c, first, count)
    assert philox.uniforms_many((1, 2), 0, [], [], 0, 96).shape == (0, 96)
    for first, count in ((2, 8), (-4, 8), (0, -1)):
        with pytest.raises(ValueError, match="first="):
            philox.uniforms_many((1, 2), 0, [0], [0], first, count)
    with pytest.raises(ValueError, match="one length"):  # the kernel would read past the copies
        philox.uniforms_many((1, 2), 0, [0, 1], [0], 0, 8)


@pytest.mark.parametrize("native", [True, False])
def test_a_runs_uniforms_and_draws_are_each_samples_own(monkeypatch, native):
    # run_uniforms' rows are uniforms(); a draw given its row is the draw made alone, for each draw kind
    if not native:
        monkeypatch.setattr(philox, "_lib", False)  # the numpy fallback where no compiler builds the kernel
    indices, copies = np.array([3, 0, 3, 2**40, 7]), np.array([0, 0, 1, 0, 5])
    rows = run_uniforms(11, 4, indices, copies)
    for i, c, row in zip(indices.tolist(), copies.tolist(), rows):
        assert np.array_equal(row, uniforms(11, 4, i, c))
    assert np.array_equal(run_uniforms(11, 4, [3, 0]), rows[:2])  # copies default to 0
    policies = [load_policy("randaugment"), load_policy("autoaugment"), load_policy("randaugment", num_ops=12)]
    policies += [load_policy("trivialaugment", erase={"p": 0.5}), load_policy("augmix")]
    policies += [dataclasses.replace(policies[0], views=3), dataclasses.replace(policies[0], crop_epochs=3)]
    for p in policies:
        for i, c, row in zip(indices.tolist(), copies.tolist(), rows):
            assert draw(p, 11, 4, i, c, row) == draw(p, 11, 4, i, c)
    with pytest.raises(ValueError, match="non-negative"):
        run_uniforms(0, 0, [1, -1])
    with pytest.raises(ValueError, match="epoch="):
        run_uniforms(0, -1, [1])


def test_a_policy_with_many_ops_reads_past_the_first_block():
    # 12 RandAugment ops use 40 + 1 + 12 * 4 = 89 uniforms, 25 more erasing ones go past the 96 taken at once
    p = load_policy("randaugment", num_ops=12, erase={"p": 1.0})
    d = draw(p, 1, 0, 3)
    u = uniforms(1, 0, 3, n=200)
    assert d.crop_u == tuple(u[:40].tolist()) and d.flip == (u[40] < p.flip)
    assert [o.aux for o in d.ops] == [tuple(u[41 + 4 * k + 2 : 41 + 4 * k + 4].tolist()) for k in range(12)]
    assert d == draw(p, 1, 0, 3)


def test_randaugment_op_choice_sign_and_magnitude():
    p = load_policy("randaugment")
    aug = p.augment
    names = [o.name for o in aug.ops]
    counts, signs = Counter(), Counter()
    for i in range(N):
        d = draw(p, 0, 0, i)
        assert len(d.ops) == 2
        for op in d.ops:
            counts[op.name] += 1
            choice = aug.op(op.name)
            expect = choice.value(9, 31)
            assert abs(op.value) == pytest.approx(abs(expect))
            if choice.signed and expect != 0:
                signs[op.value < 0] += 1
    assert stats.chisquare([counts[n] for n in names]).pvalue > P_MIN
    assert stats.binomtest(signs[True], signs[True] + signs[False], 0.5).pvalue > P_MIN


def test_trivialaugment_op_and_bin_uniform():
    p = load_policy("trivialaugment")
    aug = p.augment
    ops, bins = Counter(), Counter()
    for i in range(N):
        (op,) = draw(p, 1, 0, i).ops
        ops[op.name] += 1
        choice = aug.op(op.name)
        if choice.name == "Rotate":  # unique values per bin, so the bin is recoverable
            bins[round(abs(op.value) / 4.5)] += 1
    assert stats.chisquare([ops[o.name] for o in aug.ops]).pvalue > P_MIN
    assert sorted(bins) == list(range(31))
    assert stats.chisquare([bins[b] for b in range(31)]).pvalue > P_MIN


def test_autoaugment_applied_sequences_match_exact_probabilities():
    p = load_policy("autoaugment")
    subs = p.augment.subpolicies
    expected = Counter()
    for sp in subs:
        for mask in itertools.product([0, 1], repeat=len(sp)):
            prob = math.prod(s.prob if m else 1 - s.prob for s, m in zip(sp, mask)) / len(subs)
            expected[tuple(s.op for s, m in zip(sp, mask) if m)] += prob
    seen = Counter(tuple(o.name for o in draw(p, 2, 0, i).ops) for i in range(N))
    assert set(seen) <= set(expected)
    cats = sorted(k for k in expected if expected[k] * N >= 5)
    rare = [k for k in expected if k not in cats and expected[k] > 0]
    assert all(seen[k] == 0 for k in expected if expected[k] == 0)
    obs = [seen[k] for k in cats] + ([sum(seen[k] for k in rare)] if rare else [])
    exp = [expected[k] * N for k in cats] + ([sum(expected[k] for k in rare) * N] if rare else [])
    exp = np.array(exp) * sum(obs) / sum(exp)
    assert stats.chisquare(obs, exp).pvalue > P_MIN


def test_flip_probability():
    p = load_policy("default")
    flips = sum(draw(p, 0, 0, i).flip for i in range(N))
    assert stats.binomtest(flips, N, 0.5).pvalue > P_MIN


@pytest.mark.parametrize("hw", [(480, 640), (1000, 200), (224, 224)])
def test_crop_window_distribution_matches_torchvision(hw):
    H, W = hw
    p = load_policy("default")
    ours = [crop_window(p, draw(p, 0, 0, i), H, W) for i in range(3000)]
    torch.manual_seed(0)
    img = torch.empty(3, H, W)
    ref = [T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(3000)]
    for top, left, h, w in ours:
        assert 0 <= top and top + h <= H and 0 <= left and left + w <= W and h > 0 and w > 0
    area = lambda cs: [h * w / (H * W) for _, _, h, w in cs]
    aspect = lambda cs: [math.log(w / h) for _, _, h, w in cs]
    centre = lambda cs: [(left + w / 2) / W for _, left, _, w in cs]
    for f in (area, aspect, centre):
        assert stats.ks_2samp(f(ours), f(ref)).pvalue > P_MIN, f


def test_crop_window_fallback_equals_torchvision():
    # a 1000:1 image: no random try can fit a 3/4..4/3 box, both fall back to the same centre crop
    p = load_policy("default")
    img = torch.empty(3, 10, 10000)
    ref = T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
    assert crop_window(p, draw(p, 0, 0, 0), 10, 10000) == tuple(ref)


@pytest.mark.parametrize("ratio, hw", [((0.25, 0.4), (1, 50)), ((200, 300), (48, 64)), ((0.004, 0.005), (48, 64))])
def test_the_fallback_window_is_never_empty(ratio, hw):
    """torchvision's fallback rounds a side to 0 here (its resize then fails); ours keeps one pixel, and the sample
    is made in both modes (a 50x1 image with a tall output's ratio: OpenCV refused the empty crop in fast mode)."""
    import dataclasses
    import io

    from PIL import Image

    from fusionflow.ops.pipeline import CpuPipeline

    p = load_policy(
        {"name": "tall", "output": {"size": [64, 16]}, "crop": {"ratio": list(ratio)}, "augment": {"type": "none"}}
    )
    top, left, h, w = crop_window(p, draw(p, 0, 0, 0), *hw)
    assert h >= 1 and w >= 1 and 0 <= top <= hw[0] - h and 0 <= left <= hw[1] - w
    data = io.BytesIO()
    Image.new("RGB", hw[::-1], (200, 10, 30)).save(data, "JPEG")
    for fast in (True, False):
        out = CpuPipeline(dataclasses.replace(p, fast_downscale=fast))(data.getvalue(), 0, seed=0)
        assert out.shape == (3, 64, 16)
