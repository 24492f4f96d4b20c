"""Bicubic and nearest, for the crop resize, the eval Resize and the policy ops, on the CPU path:
exact mode equal to torchvision's PIL path to the bit (the eval centre crop within its documented
levels), fast mode the same pixels (Pillow's filters in both modes), and the DALI accelerator
declining such a policy while the loader still delivers every sample."""

import dataclasses
import io
import logging

import numpy as np
import pytest
import torchvision.transforms.v2 as T
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from tv_reference import psnr, tv_sample

from fusionflow import load_policy, policy_from_transform
from fusionflow.loader import FusionFlowLoader
from fusionflow.ops import exact, fast
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import crop_window, draw
from fusionflow.policy.op_specs import OPS
from fusionflow.tools.synthetic import make_image, make_jpegs

JPEGS = make_jpegs(10, 120, 700, seed=9)
MODES = {"bicubic": InterpolationMode.BICUBIC, "nearest": InterpolationMode.NEAREST}


def _policy(crop: str, ops: str, fast: bool):
    p = policy_from_transform(
        T.Compose(
            [
                T.RandomResizedCrop(160, interpolation=MODES[crop]),
                T.RandomHorizontalFlip(),
                T.RandAugment(num_ops=3, magnitude=12, interpolation=MODES[ops], fill=[10, 20, 30]),
            ]
        )
    )
    return dataclasses.replace(p, fast_downscale=fast)


# Fast mode's bicubic crop: the crop itself within FAST_CROP_DB of Pillow's (resample.resize_window_cubic:
# 49-52 dB; a DCT-scaled window's Pillow resample from the reduced decode: 43.6 dB at worst here);
# after magnitude-12 RandAugment ops, which magnify a level (Equalize, Posterize), within
# FAST_BICUBIC_DB of torchvision's -- the floor the default fast bilinear crop meets on these draws
# too (its worst 30.5 dB, the bicubic's 29.7, both on Equalize + Posterize + ShearX).
FAST_CROP_DB = 40.0
FAST_BICUBIC_DB = 29.0


@pytest.mark.parametrize("crop,ops", [("bicubic", "bicubic"), ("nearest", "nearest"), ("bicubic", "nearest")])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_crop_and_ops_equal_torchvision_to_the_bit(crop, ops, fast):
    policy = _policy(crop, ops, fast)
    assert (policy.crop_interpolation, policy.augment.interpolation) == (crop, ops)
    pipe, compared = CpuPipeline(policy), 0
    for i, data in enumerate(JPEGS):
        for epoch in range(3):
            d = draw(policy, 1, epoch, i)
            W, H = Image.open(io.BytesIO(data)).size
            ref = tv_sample(policy, data, d, crop_window(policy, d, H, W))
            ours = pipe(data, i, seed=1, epoch=epoch)
            if fast and any(op.name in ("Brightness", "Color", "Contrast", "Sharpness") for op in d.ops):
                continue  # the fast blends round where Pillow truncates (test_ops_fast bounds them)
            warped = ops == "bicubic" and any(op.name in ("Rotate", "ShearX", "ShearY") for op in d.ops)
            compared += 1
            if fast and (crop == "bicubic" or warped):  # OpenCV's / torch's / DCT-scaled crop, OpenCV's cubic warp
                assert psnr(ours, ref) >= FAST_BICUBIC_DB, (i, epoch, psnr(ours, ref))
                if crop == "bicubic":
                    top, left, h, w = crop_window(policy, d, H, W)
                    want = Image.open(io.BytesIO(data)).convert("RGB").crop((left, top, left + w, top + h))
                    want = np.asarray(want.resize(policy.size[::-1], Image.Resampling.BICUBIC, reducing_gap=None))
                    got = pipe._cropped(data, d, None)
                    assert psnr(got.transpose(2, 0, 1), want.transpose(2, 0, 1)) >= FAST_CROP_DB, (i, epoch)
                continue
            assert np.array_equal(ours, ref), (i, epoch, [op.name for op in d.ops])
    assert compared >= 10


@pytest.mark.parametrize("name", ["ShearX", "ShearY", "Rotate", "TranslateX", "TranslateY"])
def test_bicubic_warps_fast_within_their_bound_of_exact(name):
    """The exact kernels are Pillow's bicubic to the bit; the fast ones OpenCV's cubic warp (a = -0.75
    where Pillow's is -0.5): >= 35 dB from Pillow's on these images, 38.8 the worst seen, on the small
    high-contrast one (the translations stay whole-pixel
    copies, equal)."""
    style = exact.Style("bicubic", (128, 30, 200))
    for arr in (make_image(224, 224, 1), make_image(97, 61, 3), np.asarray(Image.open(io.BytesIO(JPEGS[0])))):
        for value in (-30.0, -0.3, 0.2, 17.0, 90.0):
            params = OPS[name].resolve(value, (0.3, 0.7), *arr.shape[:2])
            want = np.asarray(exact.apply(name, Image.fromarray(arr), value, params, style))
            np.testing.assert_array_equal(fast.EXACT[name](arr, value, params, style), want)
            got = fast.FAST[name](arr, value, params, style)
            if name.startswith("Translate"):
                np.testing.assert_array_equal(got, want)
            else:
                assert psnr(got, want) >= 35.0, (name, value, arr.shape, psnr(got, want))


@pytest.mark.parametrize("mode", ["bicubic", "nearest"])
def test_eval_resize_follows_its_interpolation(mode):
    tv = T.Compose([T.Resize(140, MODES[mode]), T.CenterCrop(128)])
    policy = policy_from_transform(tv)
    assert (policy.crop_interpolation, policy.center_resize) == (mode, 140)
    for downscale in (False, True):
        pipe = CpuPipeline(dataclasses.replace(policy, fast_downscale=downscale))
        for i, data in enumerate(JPEGS):
            ref = np.asarray(tv(Image.open(io.BytesIO(data)).convert("RGB"))).transpose(2, 0, 1)
            ours = pipe(data, i)
            diff = np.abs(ours.astype(int) - ref)
            # the fractional centre box (decode_filtered.decode_box_resize) computes Pillow's coefficients from the
            # box, not from the whole resized image: a few levels at most, bicubic's overshoot included
            assert diff.max() <= (6 if mode == "bicubic" else 0) and diff.mean() < 0.5, (mode, fast, i, diff.max())


def test_policy_files_and_overrides_take_the_new_filters():
    p = load_policy(
        {
            "output": {"size": 64},
            "crop": {"interpolation": "bicubic"},
            "augment": {"type": "trivial", "num_bins": 31, "ops": {"Rotate": {"range": [0, 135]}}},
        }
    )
    assert p.crop_interpolation == "bicubic" and p.augment.interpolation == "nearest"
    assert load_policy("randaugment", interpolation="bicubic").augment.interpolation == "bicubic"
    with pytest.raises(ValueError, match=r"crop.interpolation: .*'lanczos'.*bilinear, bicubic, nearest"):
        load_policy({"output": {"size": 64}, "crop": {"interpolation": "lanczos"}, "augment": {"type": "none"}})


class Bytes:
    def __init__(self, n):
        self.data = make_jpegs(n, 60, 200, seed=3)
        self.sizes = [len(d) for d in self.data]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


@pytest.mark.parametrize("crop,ops", [("bicubic", "nearest"), ("bilinear", "bicubic")])
def test_the_accelerator_declines_and_the_cpu_workers_deliver_every_sample(crop, ops, caplog):
    pytest.importorskip("nvidia.dali")
    policy = dataclasses.replace(
        _policy("bicubic" if crop == "bicubic" else "nearest", ops, True),
        crop_interpolation=crop,
    )
    with caplog.at_level(logging.WARNING, logger="fusionflow.loader"):
        loader = FusionFlowLoader(Bytes(24), batch_size=6, num_workers=1, policy=policy, accelerator="dali-cpu")
    said = [r.getMessage() for r in caplog.records if "declines policy" in r.getMessage()]
    assert len(said) == 1 and ("bicubic" in said[0]) and loader.config.accelerator is None
    with loader:
        seen = sorted(int(v) for _, y in loader for v in y)
    assert seen == list(range(24)) and loader.stats.accelerator_tiny_batches == 0


def test_an_rgb_fill_for_geometric_ops_is_declined_when_built_not_at_the_first_epoch(caplog):
    """DALI's geometric ops fill with one gray level: the loader declines the accelerator with its log line, as for
    the filters; a DaliPolicyPipeline built directly refuses it."""
    pytest.importorskip("nvidia.dali")
    plain = load_policy("randaugment", size=32)
    policy = dataclasses.replace(plain, augment=dataclasses.replace(plain.augment, fill=(10, 20, 30)))
    with caplog.at_level(logging.WARNING, logger="fusionflow.loader"):
        loader = FusionFlowLoader(Bytes(12), batch_size=6, num_workers=1, policy=policy, accelerator="dali-cpu")
    said = [r.getMessage() for r in caplog.records if "declines policy" in r.getMessage()]
    assert len(said) == 1 and "augment.fill [10, 20, 30]" in said[0] and loader.config.accelerator is None
    with loader:
        assert sorted(int(v) for _, y in loader for v in y) == list(range(12))
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    with pytest.raises(ValueError, match=r"cannot run augment.fill \[10, 20, 30\]"):
        DaliPolicyPipeline(policy, 4)
