"""ColorJitter and RandomGrayscale (the policy's `jitter:` and `grayscale:` stages): torchvision's
semantics, drawn per (seed, epoch, index); read from torchvision and timm pipelines; through the loader."""

import dataclasses
import io
import itertools
import math

import numpy as np
import pytest
import torch
import torchvision.transforms as T1
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from PIL import Image
from test_loader import Bytes, collect, no_leaks  # noqa: F401  (the fixture checks /dev/shm after each test)
from tv_reference import psnr, tv_color_jitter, tv_recipe

import fusionflow
from fusionflow import FusionFlowLoader, load_policy, policy_from_transform
from fusionflow.accel.declines import dali_declines
from fusionflow.ops import fast
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import draw
from fusionflow.policy.schema import parse_policy
from fusionflow.tools.synthetic import make_jpegs

JPEGS = make_jpegs(8, 200, 600, seed=5)
FULL = {"brightness": 0.4, "contrast": [0.5, 1.8], "saturation": 0.6, "hue": 0.2}


def _policy(jitter, mode="exact", **top):
    raw = {"output": {"size": 64}, "flip": 0.5, "decode": {"mode": mode}, "augment": {"type": "none"}, "jitter": jitter}
    return parse_policy({**raw, **top})


@pytest.mark.parametrize(
    "jitter",
    [FULL, {"hue": [-0.5, 0.5]}, {"contrast": 0.9, "p": 0.5}, {"brightness": [0.0, 3.0], "saturation": [0.0, 0.2]}],
)
def test_exact_mode_equals_torchvision_color_jitter_on_our_draws(jitter):
    """torchvision's ColorJitter object (its order and None handling), fed each sample's drawn order
    and factors, on torchvision's crop and flip: the same pixels to the bit."""
    policy = _policy(jitter)
    pipe, applied = CpuPipeline(policy), 0
    for i, data in enumerate(JPEGS):
        d = draw(policy, 3, 1, i)
        applied += bool(d.jitter)
        np.testing.assert_array_equal(pipe(data, i, seed=3, epoch=1), tv_recipe(policy, data, d))
    assert applied == len(JPEGS) if policy.jitter.p == 1 else 0 < applied < len(JPEGS)


def test_jitter_before_the_augment_ops_and_normalised_output():
    policy = dataclasses.replace(
        load_policy("randaugment", jitter=(0.4, 0.4, 0.4, 0.1), normalize=((0.5,) * 3, (0.25,) * 3)),
        fast_downscale=False,
    )
    for i, data in enumerate(JPEGS[:4]):
        d = draw(policy, 0, 0, i)
        assert d.jitter and d.ops
        np.testing.assert_allclose(CpuPipeline(policy)(data, i), tv_recipe(policy, data, d), rtol=0, atol=1e-5)


def test_draw_distribution_and_other_draws_untouched():
    policy, plain = _policy({**FULL, "p": 0.8}), _policy(None)
    orders, factors, applied = [], {k: [] for k in ("Brightness", "Contrast", "Color", "Hue")}, 0
    n = 4800
    for i in range(n):
        d, d0 = draw(policy, 9, 2, i), draw(plain, 9, 2, i)
        assert (d.crop_u, d.flip, d.ops, d.erase) == (d0.crop_u, d0.flip, d0.ops, d0.erase)
        if d.jitter:
            applied += 1
            orders.append(tuple(op.name for op in d.jitter))
            for op in d.jitter:
                factors[op.name].append(op.value if op.name == "Hue" else 1.0 + op.value)
    assert abs(applied / n - 0.8) < 4 * math.sqrt(0.16 / n)
    counts = np.array([orders.count(p) for p in itertools.permutations(factors)])
    expected = applied / 24
    assert ((counts - expected) ** 2 / expected).sum() < 49.7  # 23 degrees of freedom, p = 0.001
    for name, (lo, hi) in zip(factors, [(0.6, 1.4), (0.5, 1.8), (0.4, 1.6), (-0.2, 0.2)]):
        f = np.array(factors[name])
        assert lo <= f.min() and f.max() <= hi and len(f) == applied
        # uniform: the mean within 4 standard errors, a quarter of the draws in each quarter of the range
        assert abs(f.mean() - (lo + hi) / 2) < 4 * (hi - lo) / math.sqrt(12 * len(f))
        quarters = np.histogram(f, bins=4, range=(lo, hi))[0] / len(f)
        assert np.abs(quarters - 0.25).max() < 0.03


def test_fast_mode_close_to_exact():
    """The fast mode's jitter kernels against the exact ones on the same decoded crop (the fast
    decode's own difference is measured elsewhere): each within its stated tolerance chained."""
    policy = _policy(FULL, mode="fast")
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS):
        d = draw(policy, 4, 0, i)
        base = pipe.array(data, dataclasses.replace(d, jitter=()))
        want = base
        for op in d.jitter:
            want = fast.EXACT[op.name](want, op.value, op.params(*policy.size), pipe.style)
        got = pipe(data, i, seed=4).transpose(1, 2, 0)
        assert psnr(got, want) > 35.0 and np.abs(got.astype(int) - want).max() <= 16, (i, psnr(got, want))


@pytest.mark.parametrize(
    "jitter,match",
    [
        ({"brightnes": 0.4}, r"jitter\.brightnes: unknown key; did you mean 'brightness'"),
        ({}, r"jitter: name at least one of brightness, contrast, saturation, hue"),
        ({"brightness": -0.1}, r"jitter\.brightness"),
        ({"hue": 0.7}, r"jitter\.hue"),
        ({"hue": [-0.6, 0.1]}, r"jitter\.hue\[0\]"),
        ({"contrast": [1.5, 0.5]}, r"jitter\.contrast: lower bound 1.5 is greater than upper bound 0.5"),
        ({"saturation": "lots"}, r"jitter\.saturation"),
        ({"brightness": 0.4, "p": 1.5}, r"jitter\.p"),
    ],
)
def test_bad_jitter_is_named(jitter, match):
    with pytest.raises(ValueError, match=match):
        _policy(jitter)


def test_a_jitter_that_adjusts_nothing_is_none():
    assert _policy({"brightness": 0, "hue": 0}).jitter is None
    assert _policy({"brightness": [1, 1], "p": 1}).jitter is None
    assert _policy({"brightness": 0.4, "p": 0}).jitter is None
    assert _policy({"brightness": [0.2, 0.2]}).jitter.brightness == (0.2, 0.2)  # a fixed factor is an adjustment


def test_overrides():
    assert load_policy("randaugment", jitter=0.4).jitter == fusionflow.policy.Jitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4))
    j = load_policy("default", jitter={"hue": 0.1, "p": 0.8}).jitter
    assert (j.brightness, j.hue, j.p) == (None, (-0.1, 0.1), 0.8)
    assert load_policy("default", jitter=(0.1, 0.2, 0.3, 0.05)).jitter.hue == (-0.05, 0.05)
    assert load_policy(load_policy("default", jitter=0.4), jitter=None).jitter is None
    with pytest.raises(ValueError, match=r"jitter: a tuple is \(brightness, contrast, saturation\[, hue\]\)"):
        load_policy("default", jitter=(0.1, 0.2))
    with pytest.raises(ValueError, match=r"jitter\.hue"):
        load_policy("default", jitter={"hue": 0.9})


def test_read_from_torchvision_and_timm():
    crop, flip = T.RandomResizedCrop(32), T.RandomHorizontalFlip(0.3)
    p = policy_from_transform([crop, flip, T.ColorJitter(0.4, 0.3, 0.2, 0.1)])
    assert (p.flip, p.jitter) == (0.3, fusionflow.policy.Jitter((0.6, 1.4), (0.7, 1.3), (0.8, 1.2), (-0.1, 0.1)))
    # v1, wrapped in RandomApply (SimCLR's), before the flip (they commute): the same policy but for p
    v1 = T1.Compose(
        [
            T1.RandomResizedCrop(32),
            T1.RandomApply([T1.ColorJitter(0.4, 0.3, 0.2, 0.1)], p=0.8),
            T1.RandomHorizontalFlip(0.3),
        ]
    )
    assert policy_from_transform(v1) == dataclasses.replace(
        p, jitter=dataclasses.replace(p.jitter, p=0.8), source=policy_from_transform(v1).source
    )
    assert policy_from_transform([crop, T.ColorJitter()]).jitter is None  # adjusts nothing
    timm_data = pytest.importorskip("timm.data")
    t = policy_from_transform(timm_data.create_transform(48, is_training=True))  # timm's default: color_jitter=0.4
    assert t.jitter == fusionflow.policy.Jitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4)) and t.flip == 0.5
    t = fusionflow.from_timm(48, is_training=True, color_jitter=(0.4, 0.4, 0.4, 0.1), color_jitter_prob=0.5)
    assert t.jitter.hue == (-0.1, 0.1) and t.jitter.p == 0.5


def test_the_dali_accelerator_declines_jitter_and_hue():
    assert "jitter" in dali_declines(_policy(FULL))
    hue = parse_policy(
        {
            "output": {"size": 32},
            "augment": {
                "type": "rand",
                "num_ops": 1,
                "magnitude": 3,
                "num_bins": 5,
                "ops": {"Hue": {"range": [0, 0.5], "signed": True}},
            },
        }
    )
    assert "Hue" in dali_declines(hue) and dali_declines(_policy(None)) is None


def test_loader_with_jitter_delivers_the_pipelines_samples_once(tmp_path):
    policy = _policy(FULL, mode="fast")
    ds = Bytes(24)
    with FusionFlowLoader(ds, batch_size=8, num_workers=2, policy=policy, seed=6, stage_times=True) as loader:
        images, labels = collect(loader)
        stages = set(loader.stats.stage_shares())
    x, y = torch.cat(images), torch.cat(labels)
    assert sorted(y.tolist()) == list(range(24))
    pipe = CpuPipeline(policy)
    for img, i in zip(x, y.tolist()):
        np.testing.assert_array_equal(img.numpy(), pipe(ds.data[i], i, seed=6, epoch=0))
    assert {"Brightness", "Contrast", "Color", "Hue"} <= stages


def test_reference_helper_is_torchvision_color_jitter():
    """tv_color_jitter's injection reproduces torchvision's own ColorJitter draw (seeded torch RNG)."""
    img = Image.open(io.BytesIO(JPEGS[0])).convert("RGB").resize((48, 40))
    cj = T.ColorJitter(0.4, 0.3, 0.2, 0.1)
    torch.manual_seed(0)
    params = cj.make_params([img])
    order = [("Brightness", "Contrast", "Color", "Hue")[k] for k in params["fn_idx"].tolist()]
    keys = {"Brightness": "brightness_factor", "Contrast": "contrast_factor", "Color": "saturation_factor"}
    ops = tuple(
        fusionflow.policy.OpDraw(n, params["hue_factor"] if n == "Hue" else params[keys[n]] - 1.0, (0.0, 0.0))
        for n in order
    )
    d = dataclasses.replace(draw(_policy(FULL), 0, 0, 0), jitter=ops)
    torch.manual_seed(0)
    want = np.asarray(cj(img))
    got = np.asarray(tv_color_jitter(fusionflow.policy.Jitter((0.6, 1.4), (0.7, 1.3), (0.8, 1.2), (-0.1, 0.1)), img, d))
    assert np.abs(got.astype(int) - want).max() <= 1  # factors re-derived as 1 + (f - 1): an ulp apart at most


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_grayscale_equals_torchvision_after_the_jitter(mode):
    """RandomGrayscale after ColorJitter (SimCLR's order): torchvision's rgb_to_grayscale on the jittered
    crop, in both modes (Pillow's luma either way, so the fast mode's grayscale step is exact too)."""
    policy = _policy(FULL, mode=mode, grayscale=0.5)
    pipe, grey = CpuPipeline(policy), 0
    for i, data in enumerate(JPEGS):
        d = draw(policy, 2, 0, i)
        grey += d.grayscale
        out = pipe(data, i, seed=2)
        if mode == "exact":
            want = tv_recipe(policy, data, d)
        else:  # torchvision's grayscale on the fast mode's own jittered crop
            base = Image.fromarray(pipe.array(data, dataclasses.replace(d, grayscale=False)))
            want = np.asarray(TF.rgb_to_grayscale(base, num_output_channels=3) if d.grayscale else base)
            want = want.transpose(2, 0, 1)
        np.testing.assert_array_equal(out, want)
        assert d.grayscale == ((out[0] == out[1]).all() and (out[1] == out[2]).all())
    assert 0 < grey < len(JPEGS)


def test_grayscale_draw_rate_and_other_draws_untouched():
    policy, plain = _policy(FULL, grayscale=0.2), _policy(FULL)
    n, grey = 4000, 0
    for i in range(n):
        d, d0 = draw(policy, 1, 0, i), draw(plain, 1, 0, i)
        assert (d.crop_u, d.flip, d.jitter) == (d0.crop_u, d0.flip, d0.jitter) and not d0.grayscale
        grey += d.grayscale
    assert abs(grey / n - 0.2) < 4 * math.sqrt(0.16 / n)


def test_grayscale_read_checked_and_declined():
    simclr = T1.Compose(
        [
            T1.RandomResizedCrop(32),
            T1.RandomHorizontalFlip(),
            T1.RandomApply([T1.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            T1.RandomGrayscale(p=0.2),
            T1.ToTensor(),
        ]
    )
    p = policy_from_transform(simclr)
    assert (p.grayscale, p.jitter.p, p.flip) == (0.2, 0.8, 0.5)
    assert policy_from_transform([T.RandomResizedCrop(32), T.Grayscale(3)]).grayscale == 1.0
    with pytest.raises(ValueError, match=r"transform 1 \(Grayscale.*only Grayscale\(num_output_channels=3\)"):
        policy_from_transform([T.RandomResizedCrop(32), T.Grayscale(1)])
    with pytest.raises(ValueError, match=r"transform 2 \(ColorJitter.*cannot be expressed here"):
        policy_from_transform([T.RandomResizedCrop(32), T.RandomGrayscale(0.2), T.ColorJitter(0.4)])
    with pytest.raises(ValueError, match=r"grayscale"):
        _policy(None, grayscale=1.5)
    assert load_policy("default", grayscale=0.1).grayscale == 0.1
    assert load_policy(load_policy("default", grayscale=0.1), grayscale=None).grayscale == 0.0
    assert "grayscale" in dali_declines(_policy(None, grayscale=0.1))
    timm_data = pytest.importorskip("timm.data")
    assert policy_from_transform(timm_data.create_transform(48, is_training=True, grayscale_prob=0.2)).grayscale == 0.2
