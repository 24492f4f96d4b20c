"""load_policy(name, **overrides): a training script's flags (crop size, RandAugment magnitude and
num_ops, interpolation, normalisation, flip) applied to a policy, checked against torchvision."""

import dataclasses
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from PIL import Image
from tv_reference import tv_sample

import fusionflow
from fusionflow import load_policy
from fusionflow.ops.decode import dct_reduction
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import OVERRIDES, crop_window, draw
from fusionflow.policy.sampling import center_box
from fusionflow.tools.synthetic import make_jpegs

JPEGS = make_jpegs(6, 200, 400, seed=3)
TV = {"randaugment": T.RandAugment, "trivialaugment": T.TrivialAugmentWide, "autoaugment": T.AutoAugment}


def _tv_table(tv_cls, name, num_bins, height, width):
    mags = tv_cls._AUGMENTATION_SPACE[name][0](num_bins, height, width)
    if mags is None or mags.ndim == 0:
        return None
    return [255.0 * float(m) if name == "Solarize" else float(m) for m in mags]  # Solarize: fraction of 255


@pytest.mark.parametrize("size", [176, (160, 200), 288])
@pytest.mark.parametrize("config", sorted(TV))
def test_size_override_rescales_pixel_ranges_as_torchvision(config, size):
    """--train-crop-size 176: RandAugment/AutoAugment translate by 150/331 of the image, TrivialAugmentWide
    by 32 px at any size; every op's magnitude table must equal torchvision's at the new size."""
    policy = load_policy(config, size=size)
    height, width = (size, size) if isinstance(size, int) else size
    assert policy.size == (height, width) and policy.out_shape == (3, height, width)
    aug = policy.augment
    for choice in aug.ops:
        ref = _tv_table(TV[config], choice.name, aug.num_bins, height, width)
        if ref is None:
            assert choice.range is None, choice.name
            continue
        ours = [choice.value(b, aug.num_bins) for b in range(aug.num_bins)]
        assert ours == pytest.approx(ref, abs=1e-4), (choice.name, size)


def test_size_override_rescales_cutout_by_the_shorter_side_and_leaves_the_file_unchanged():
    base = load_policy("randaugment-paper")
    small = load_policy("randaugment-paper", size=(112, 160))
    scale = 112 / 224
    assert small.augment.op("Cutout").range == pytest.approx(tuple(v * scale for v in base.augment.op("Cutout").range))
    assert small.augment.op("TranslateX").range == pytest.approx(
        tuple(v * 160 / 224 for v in base.augment.op("TranslateX").range)
    )
    assert small.augment.op("Rotate") == base.augment.op("Rotate")
    assert load_policy("randaugment-paper") == base  # overrides make a new Policy


def test_magnitude_and_num_ops_follow_torchvision_randaugment():
    policy = load_policy("randaugment", magnitude=7, num_ops=3)
    ref = T.RandAugment(num_ops=3, magnitude=7)
    aug = policy.augment
    assert (aug.num_ops, aug.magnitude, aug.num_bins) == (ref.num_ops, ref.magnitude, ref.num_magnitude_bins)
    d = draw(policy, 0, 0, 5)
    assert len(d.ops) == 3
    for op in d.ops:
        ref_table = _tv_table(T.RandAugment, op.name, aug.num_bins, 224, 224)
        if ref_table is not None:
            assert abs(op.value) == pytest.approx(abs(ref_table[7]), abs=1e-4), op.name


@pytest.mark.parametrize(
    "overrides",
    [{"interpolation": "bilinear"}, {"interpolation": "bilinear", "size": 96, "magnitude": 15, "flip": 1.0}],
)
def test_overridden_policy_pixels_equal_torchvision(overrides):
    policy = dataclasses.replace(load_policy("randaugment", **overrides), fast_downscale=False)
    assert policy.augment.interpolation == "bilinear"
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS):
        d = draw(policy, 2, 0, i)
        width, height = Image.open(io.BytesIO(data)).size
        ref = tv_sample(policy, data, d, crop_window(policy, d, height, width))
        assert np.array_equal(pipe(data, i, seed=2, epoch=0), ref), i


def test_normalize_override_equals_torchvision_normalize():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    plain = dataclasses.replace(load_policy("randaugment"), fast_downscale=False)
    policy = dataclasses.replace(load_policy("randaugment", normalize=(mean, std)), fast_downscale=False)
    assert policy.out_dtype == "float32" and policy.normalize == (mean, std)
    assert load_policy("randaugment", normalize={"mean": list(mean), "std": list(std)}).normalize == (mean, std)
    assert load_policy(policy, normalize=None).out_dtype == "uint8"
    ours = CpuPipeline(policy)(JPEGS[0], 0, seed=1, epoch=0)
    d = draw(plain, 1, 0, 0)
    width, height = Image.open(io.BytesIO(JPEGS[0])).size
    ref = torch.from_numpy(tv_sample(plain, JPEGS[0], d, crop_window(plain, d, height, width)).copy())
    ref = T.Normalize(list(mean), list(std))(T.ToDtype(torch.float32, scale=True)(ref))
    torch.testing.assert_close(torch.from_numpy(ours), ref, rtol=0, atol=1e-5)


def test_flip_override():
    never, always = load_policy("randaugment", flip=0.0), load_policy("randaugment", flip=1)
    assert not any(draw(never, 0, 0, i).flip for i in range(50))
    assert all(draw(always, 0, 0, i).flip for i in range(50))


def test_loader_takes_an_overridden_policy():
    from fusionflow.loader import FusionFlowLoader

    ds = [(data, 0) for data in JPEGS]
    x, _ = next(iter(FusionFlowLoader(ds, batch_size=3, seed=0, policy=load_policy("randaugment", size=(64, 48)))))
    assert x.shape == (3, 3, 64, 48) and x.dtype == torch.uint8


@pytest.mark.parametrize(
    "name,overrides,match",
    [
        (
            "randaugment",
            {"magnitud": 5},
            r"unknown override 'magnitud'; did you mean 'magnitude'\? valid overrides: " + ", ".join(OVERRIDES),
        ),
        ("randaugment", {"colour": 5}, r"unknown override 'colour'; valid overrides: size, resize, magnitude"),
        ("randaugment", {"magnitude": 31}, r"magnitude: 31 is out of range \[0, 30\]"),
        ("randaugment", {"magnitude": 2.5}, r"magnitude: expected an integer"),
        ("randaugment", {"num_ops": 0}, r"num_ops: 0 is out of range \[1, 16\]"),
        (
            "trivialaugment",
            {"magnitude": 5},
            r"magnitude: applies to augment.type 'rand'.*'trivialaugment' is 'trivial'",
        ),
        ("autoaugment", {"num_ops": 2}, r"num_ops: applies to augment.type 'rand'"),
        (
            "randaugment",
            {"interpolation": "lanczos"},
            r"interpolation: .*lanczos.*nearest, bilinear, bicubic",
        ),
        (
            "randaugment",
            {"interpolation": "bilinaer"},
            r"interpolation: 'bilinaer' is not valid; did you mean 'bilinear'",
        ),
        ("default", {"interpolation": "nearest"}, r"interpolation: policy 'default' has no ops to resample"),
        ("randaugment", {"size": 4}, r"size: 4 is out of range \[8, 8192\]"),
        ("randaugment", {"size": "224"}, r"size: expected an int or \(height, width\)"),
        ("trivialaugment", {"size": 24}, r"size: TranslateX's fixed range \[0.0, 32.0\] px does not fit a 24x24"),
        ("randaugment", {"normalize": ([0.5] * 3,)}, r"normalize: expected \(mean, std\)"),
        ("randaugment", {"normalize": ([0.5] * 3, [0.0] * 3)}, r"normalize.std\[0\]: 0.0 is out of range"),
        ("randaugment", {"normalize": {"mean": [0.5] * 3}}, r"normalize.std: missing required key"),
        ("randaugment", {"flip": 1.5}, r"flip: 1.5 is out of range \[0.0, 1.0\]"),
        ("randaugment", {"flip": True}, r"flip: expected a number"),
    ],
)
def test_invalid_overrides_name_the_override_and_the_choices(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        load_policy(name, **overrides)


def test_default_policy_accepts_bilinear_which_is_what_its_crop_does():
    assert load_policy("default", interpolation="bilinear") == load_policy("default")


def test_scale_with_size_only_for_pixel_valued_ops():
    base = {"output": {"size": 224}, "augment": {"type": "trivial", "num_bins": 31, "ops": {}}}
    base["augment"]["ops"] = {"TranslateX": {"range": [0, 32], "scale_with_size": False}}
    assert load_policy(base, size=112).augment.op("TranslateX").range == (0.0, 32.0)
    base["augment"]["ops"] = {"Rotate": {"range": [0, 30], "scale_with_size": False}}
    with pytest.raises(ValueError, match=r"augment.ops.Rotate.scale_with_size: unknown key"):
        load_policy(base)


def test_overrides_keep_the_policy_layer_free_of_torch():
    code = (
        "import sys, fusionflow.policy as p; p.load_policy('randaugment', size=176, magnitude=5, "
        "interpolation='bilinear', normalize=([0.5]*3, [0.2]*3), flip=0.0);"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'nvidia', 'torchvision')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- eval: Resize + CenterCrop
EVAL_JPEGS = make_jpegs(24, 200, 1000, seed=4)


def _checkerboard(height: int, width: int, period: int) -> bytes:
    """Squares of `period` pixels in three colours: the worst case for a crop that moves by a fraction
    of a pixel."""
    y, x = np.mgrid[:height, :width]
    base = (((y // period) + (x // period)) % 2 * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(np.stack([base, 255 - base, base // 2], -1)).save(out, "JPEG", quality=95)
    return out.getvalue()


CHECKERBOARDS = [_checkerboard(h, w, p) for h, w, p in ((375, 500, 1), (500, 375, 2), (480, 640, 3), (333, 517, 1))]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("overrides", [{}, {"size": 176, "resize": 232}, {"size": (160, 200), "resize": 240}])
def test_eval_policy_matches_torchvision_resize_center_crop(overrides, fast):
    """torchvision's validation transform, Resize(resize) + CenterCrop(size), on photo-like images and on 1-3 px
    checkerboards (where a crop moved by half a pixel fell to 12-30 dB): exact mode its pixels to the bit (it
    resizes the whole image); fast mode resamples the unrounded centre crop at the resize's own scale, every pixel
    within 2 levels, >= 50 dB (measured >= 55; Pillow's coefficients, computed from the box, can round
    differently), except boxes of 2x the output or more: DCT-scaled."""
    from tv_reference import psnr

    policy = dataclasses.replace(load_policy("eval", **overrides), fast_downscale=fast)
    assert policy.flip == 0 and policy.augment.type == "none"
    pipe = CpuPipeline(policy)
    ref = T.Compose([T.Resize(policy.center_resize, antialias=True), T.CenterCrop(list(policy.size))])
    photos, boards, diffs = [], [], []
    for i, data in enumerate(EVAL_JPEGS + CHECKERBOARDS):
        img = Image.open(io.BytesIO(data))
        x0, y0, x1, y1 = center_box(policy.center_resize, policy.size, img.height, img.width)
        if fast and dct_reduction(int(y1 - y0), int(x1 - x0), *policy.size) > 1:
            continue  # a box of 2x the output or more is DCT-scaled in fast mode (training crops' fidelity)
        expected = np.asarray(ref(img.convert("RGB"))).transpose(2, 0, 1)
        ours = pipe(data, i, seed=i, epoch=3 * i)  # no randomness: seed and epoch must not matter
        assert ours.shape == expected.shape
        assert np.array_equal(ours, pipe(data, i, seed=0, epoch=0))
        diffs.append(int(np.abs(ours.astype(int) - expected).max()))
        (photos if i < len(EVAL_JPEGS) else boards).append(psnr(ours, expected))
    assert len(photos) >= 8 and boards  # enough of both decoded at full scale
    assert max(diffs) <= (2 if fast else 0) and min(photos + boards) >= 50.0, (diffs, photos, boards)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic"])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("size, resize", [(8, 9), (24, 40), ((20, 12), (31, 17))])
def test_exact_center_crop_is_torchvisions_to_the_bit_with_every_filter(interpolation, fmt, size, resize):
    """Exact mode with nearest or bicubic resampled the fractional box: a source pixel off (up to 234 levels) and
    up to 21 levels from torchvision's Resize + CenterCrop on small images."""
    from tv_reference import _MODES as INTERPOLATION

    policy = load_policy(
        {
            "name": "eval-x",
            "output": {"size": list(size) if isinstance(size, tuple) else size},
            "decode": {"mode": "exact"},
            "crop": {
                "mode": "center",
                "resize": list(resize) if isinstance(resize, tuple) else resize,
                "interpolation": interpolation,
            },
            "augment": {"type": "none"},
        }
    )
    ref = T.Compose(
        [
            T.Resize(list(resize) if isinstance(resize, tuple) else resize, INTERPOLATION[interpolation]),
            T.CenterCrop(list(policy.size)),
        ]
    )
    pipe, rng = CpuPipeline(policy), np.random.default_rng(3)
    for i, (h, w) in enumerate(((60, 60), (45, 70), (97, 33))):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, fmt)
        expected = np.asarray(ref(Image.open(io.BytesIO(out.getvalue())).convert("RGB"))).transpose(2, 0, 1)
        np.testing.assert_array_equal(pipe(out.getvalue(), i, seed=0), expected)


@pytest.mark.parametrize("height,width", [(375, 500), (500, 375), (256, 256), (224, 900), (1000, 257)])
def test_center_window_is_torchvisions_center_crop_in_source_pixels(height, width):
    from fusionflow.policy.sampling import center_window

    top, left, h, w = center_window(256, (224, 224), height, width)
    assert 0 <= top and 0 <= left and top + h <= height and left + w <= width
    # torchvision's geometry: the resized image's centre crop, scaled back
    resized = T.Resize(256)(torch.zeros(1, height, width)).shape[1:]
    sy, sx = height / resized[0], width / resized[1]
    assert abs(top - round((resized[0] - 224) / 2) * sy) <= 0.5 and abs(h - 224 * sy) <= 1
    assert abs(left - round((resized[1] - 224) / 2) * sx) <= 0.5 and abs(w - 224 * sx) <= 1


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"mode": "center"}, r"crop.resize: missing required key for crop.mode center"),
        ({"mode": "center", "resize": 200}, r"crop.resize: 200 is smaller than the 224x224 center crop"),
        ({"mode": "center", "resize": 256, "scale": [0.5, 1]}, r"crop.scale: applies to the random resized crop"),
        ({"resize": 256}, r"crop.resize: applies to crop.mode center"),
        ({"mode": "centre", "resize": 256}, r"crop.mode: 'centre' is not valid; did you mean 'center'"),
    ],
)
def test_center_crop_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        load_policy({"output": {"size": 224}, "crop": cfg, "augment": {"type": "none"}})


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"resize": 100}, r"resize: 100 is smaller than the 224x224 center crop: use resize >= 224"),
        ({"size": 300}, r"resize: 256 is smaller than the 300x300 center crop"),
    ],
)
def test_eval_override_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_policy("eval", **overrides)
    with pytest.raises(ValueError, match=r"resize: applies to crop.mode center policies"):
        load_policy("randaugment", resize=256)


def test_eval_policy_through_the_loader():
    from fusionflow.loader import FusionFlowLoader

    ds = [(data, i) for i, data in enumerate(EVAL_JPEGS[:6])]
    policy = load_policy("eval", size=96, resize=110)
    ((x, y),) = list(FusionFlowLoader(ds, batch_size=6, num_workers=1, policy=policy, seed=0))
    pipe = CpuPipeline(policy)
    assert x.shape == (6, 3, 96, 96)
    assert all(np.array_equal(x[i].numpy(), pipe(ds[i][0], i)) for i in range(6))


def test_a_size_override_moves_a_keep_ratio_crops_default_resize_with_it():
    """crop.resize left out means the output size: `size=` overriding it must give what editing output.size gives
    (it kept the file's, so 91% of a 16 -> 64 output was padding); a resize the file names stays."""
    cfg = {
        "name": "kr",
        "output": {"size": 16},
        "crop": {"mode": "keep_ratio", "place": "center", "pad": [0, 0, 0]},
        "augment": {"type": "none"},
    }
    edited = load_policy({**cfg, "output": {"size": 64}})
    assert load_policy(cfg, size=64) == dataclasses.replace(edited, source=load_policy(cfg, size=64).source)
    assert load_policy(cfg, size=(64, 32)).keep_ratio.resize == (64, 32)
    named = {**cfg, "crop": {**cfg["crop"], "resize": 20}}
    assert load_policy(named, size=64).keep_ratio.resize == (20, 20)
    data = io.BytesIO()
    Image.new("RGB", (80, 60), (200, 100, 50)).save(data, "PNG")
    out = CpuPipeline(load_policy(cfg, size=64))(data.getvalue(), 0, seed=0)
    assert (out.reshape(3, -1).max(0) > 0).all()  # the image covers the output: no padding


@pytest.mark.parametrize("size, kernel", [(8, 23), (11, 23), ([40, 9], [19, 3])])
def test_a_blur_kernel_larger_than_the_output_allows_is_refused_at_load(size, kernel):
    """torchvision's GaussianBlur pads by half its kernel, reflecting, which needs less than the side: exact mode
    failed every sample in the worker, fast mode ran; both now refuse it at load, also through `size=`."""
    cfg = {"name": "b", "output": {"size": size}, "augment": {"type": "none"}, "blur": {"kernel_size": kernel}}
    with pytest.raises(ValueError, match=r"blur\.kernel_size: .* does not fit the"):
        load_policy(cfg)
    fits = load_policy({**cfg, "output": {"size": 64}})
    with pytest.raises(ValueError, match=r"size: .* does not fit the"):
        load_policy(fits, size=size)
    load_policy({**cfg, "output": {"size": 12}, "blur": {"kernel_size": 23}})  # 11 < 12: torchvision's limit


@pytest.mark.parametrize(
    "augment, good, bad",
    [
        ({"type": "timm-rand", "num_ops": 2, "magnitude": 9, "ops": ["Rotate", "ShearX"]}, "random", "nearest"),
        ("augmix", "nearest", "bicubic"),
        ("deepaa", "bilinear", "bicubic"),
        ("randaugment", "bicubic", "random"),
    ],
)
def test_the_interpolation_override_accepts_what_the_policy_file_accepts(augment, good, bad):
    """The override checked the generic list: timm's types took 'nearest' (their files refuse it) and refused
    'random' (their files take it); DeepAA took 'bicubic'."""
    if isinstance(augment, str):  # a shipped policy's augment section
        import yaml

        with open(os.path.join(os.path.dirname(fusionflow.__file__), "configs", f"{augment}.yaml")) as f:
            augment = yaml.safe_load(f)["augment"]
        augment.pop("interpolation", None)
    cfg = {"name": "i", "output": {"size": 224}, "augment": augment}
    assert load_policy(cfg, interpolation=good).augment.interpolation == good
    assert load_policy({**cfg, "augment": {**augment, "interpolation": good}}).augment.interpolation == good
    with pytest.raises(ValueError, match=f"interpolation: '{bad}'"):
        load_policy(cfg, interpolation=bad)
    with pytest.raises(ValueError, match="augment.interpolation"):
        load_policy({**cfg, "augment": {**augment, "interpolation": bad}})
