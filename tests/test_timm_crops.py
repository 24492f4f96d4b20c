"""timm's keep-ratio crops (train_crop_mode 'rkrr' / 'rkrc', the eval crop_mode 'border') and its
TrimBorder (crop_border_pixels) as crop.mode keep_ratio / crop.trim: the exact mode equals timm's own
transform given the same draws (replayed into timm's `random`), the fast mode stays within its bound,
the loader, the decoded-image cache and the accelerator's refusal."""

import dataclasses
import io
import math

import numpy as np
import pytest
import torchvision.transforms.v2.functional as F
from PIL import Image

import fusionflow
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import draw, keep_ratio
from fusionflow.tools.synthetic import make_jpegs

timm = pytest.importorskip("timm")
timm_tf = pytest.importorskip("timm.data.transforms")
from test_cache import Indexed, epochs  # noqa: E402
from test_timm import Replay  # noqa: E402
from timm.data import create_transform  # noqa: E402

JPEGS = make_jpegs(10, 120, 420, seed=23)


def psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * math.log10(255.0**2 / mse)


def queue_keep_ratio(replay, policy, d, height, width):
    """timm's calls for one sample, answered with this draw's decisions: ResizeKeepRatio's coins and
    factors, its filter, then RandomCropOrPad's two offsets."""
    kr, u = policy.keep_ratio, d.crop_u
    replay.q["random"].append(u[0])
    if u[0] < kr.scale_p:
        replay.q["uniform"].append(kr.scale[0] + (kr.scale[1] - kr.scale[0]) * u[1])
    replay.q["random"].append(u[2])
    if u[2] < kr.ratio_p:
        lo, hi = math.log(kr.ratio[0]), math.log(kr.ratio[1])
        replay.q["uniform"].append(lo + (hi - lo) * u[3])
    if d.crop_resample is not None:
        replay.q["choice"].append(F.InterpolationMode(d.crop_resample))
    if kr.place == "random":
        rh, rw = keep_ratio.resized_size(kr, height, width, u)
        for resized, out, v in ((rh, policy.size[0], u[4]), (rw, policy.size[1], u[5])):
            replay.q["randint"].append(min(int(v * (abs(resized - out) + 1)), abs(resized - out)))


@pytest.mark.parametrize("mode", ["rkrr", "rkrc"])
def test_keep_ratio_crops_equal_timm_given_the_same_draws(mode, monkeypatch):
    transform = create_transform(224, is_training=True, train_crop_mode=mode, interpolation="random", hflip=0.0)
    transform.transforms = [t for t in transform.transforms if type(t).__name__ != "ColorJitter"]
    policy = fusionflow.policy_from_transform(transform, decode="exact")
    assert policy.keep_ratio.place == {"rkrr": "random", "rkrc": "center"}[mode] and policy.keep_ratio.pad is None
    exact, fast = CpuPipeline(policy), CpuPipeline(dataclasses.replace(policy, fast_downscale=True))
    padded = cropped = 0
    for index, data in enumerate(JPEGS * 3):
        d = draw(policy, 5, 0, index)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        replay = Replay()
        queue_keep_ratio(replay, policy, d, img.height, img.width)
        monkeypatch.setattr(timm_tf, "random", replay)
        want = transform(img).numpy()
        replay.done()
        got = exact(data, index, seed=5, epoch=0)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"sample {index}")
        pads = keep_ratio.layout(policy.keep_ratio, policy.size, d.crop_u, img.height, img.width)[2]
        padded, cropped = padded + any(pads), cropped + (not any(pads))
        levels = lambda x: (x * np.array([0.229, 0.224, 0.225])[:, None, None] + 0.485) * 255  # noqa: E731
        assert psnr(levels(fast(data, index, seed=5, epoch=0)), levels(got)) > 30.0, index
    assert padded >= 2 and cropped >= 10  # both of timm's branches ran (a pad needs a narrowing aspect draw)


@pytest.mark.parametrize("kw", [dict(crop_mode="border"), dict(crop_mode="border", crop_border_pixels=5, crop_pct=1.0)])
def test_eval_border_crop_equals_timm(kw):
    transform = create_transform(224, is_training=False, interpolation="bicubic", **kw)
    policy = fusionflow.policy_from_transform(transform, decode="exact")
    assert policy.keep_ratio.pad == (124, 116, 104) and policy.trim == kw.get("crop_border_pixels", 0)
    exact, fast = CpuPipeline(policy), CpuPipeline(dataclasses.replace(policy, fast_downscale=True))
    for index, data in enumerate(JPEGS):
        want = transform(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
        np.testing.assert_allclose(exact(data, index), want, atol=2e-6, err_msg=f"sample {index}")
        assert np.median(np.abs(fast(data, index) - want)) < 0.02, index  # the fractional box's bound


def test_trimmed_centre_crop_is_timm_s_within_the_eval_bound():
    transform = create_transform(224, is_training=False, crop_border_pixels=7)
    policy = fusionflow.policy_from_transform(transform, decode="exact")
    assert policy.trim == 7 and policy.center_resize == 256
    untrimmed = CpuPipeline(fusionflow.policy_from_transform(create_transform(224, is_training=False)))
    pipe = CpuPipeline(policy)
    for index, data in enumerate(JPEGS):
        want = transform(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
        got = pipe(data, index)
        assert np.median(np.abs(got - want)) < 0.02, index
        assert np.median(np.abs(untrimmed(data, index) - want)) > np.median(np.abs(got - want)), index


def test_bad_keep_ratio_keys_are_refused_naming_the_key():
    base = {"output": {"size": 64}, "augment": {"type": "none"}}
    for crop, match in (
        ({"mode": "keep_ratio", "place": "left"}, r"crop\.place"),
        ({"mode": "keep_ratio", "pad": [1, 2]}, r"crop\.pad"),
        ({"mode": "keep_ratio", "longest": 2}, r"crop\.longest"),
        ({"place": "random"}, r"crop\.place: applies to crop\.mode keep_ratio"),
        ({"mode": "center", "resize": 72, "pad": "reflect"}, r"crop\.pad: applies to crop\.mode keep_ratio"),
        ({"mode": "keep_ratio", "trim": -1}, r"crop\.trim"),
    ):
        with pytest.raises(ValueError, match=match):
            fusionflow.load_policy(dict(base, crop=crop))


RKRR = {
    "output": {"size": 48},
    "augment": {"type": "none"},
    "flip": 0.5,
    "crop": {"mode": "keep_ratio", "scale": [0.8, 1.0], "scale_p": 0.5, "ratio": [0.9, 1.11], "ratio_p": 0.5},
}


def test_loader_runs_keep_ratio_crops_exactly_once_with_the_cache_and_the_accelerator_declines():
    data = Indexed(24, make_jpegs(24, 40, 160, seed=3))
    kw = dict(batch_size=6, shuffle=True, policy=RKRR, num_workers=2, seed=1)
    with fusionflow.FusionFlowLoader(data, **kw) as plain:
        want = epochs(plain, 2)  # each sample exactly once per epoch (test_cache's check)
    eager = fusionflow.DecodedCache("64MB", max_side=56, fill_share=None)  # every sample filled in epoch 1
    with fusionflow.FusionFlowLoader(data, cache=eager, **kw) as cached:
        got = epochs(cached, 2)
        assert cached.stats.cache["fills"] == 24 and cached.stats.cache["hits"] >= 24
    values = [psnr(got[e][i], want[e][i]) for e in range(2) for i in range(24)]
    assert np.median(values) > 35 and min(values) > 20, sorted(values)[:3]  # the cache's resampling bound
    from fusionflow.accel.declines import dali_declines

    assert "keep_ratio" in dali_declines(fusionflow.load_policy(RKRR))
