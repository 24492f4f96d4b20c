"""policy_from_transform: torchvision v2 pipelines -> the equivalent Policy, checked against
torchvision's own magnitude tables and its pixels on identical draws."""

import dataclasses
import io

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as F
from PIL import Image
from torchvision.transforms.v2 import AutoAugmentPolicy, InterpolationMode
from tv_reference import psnr, tv_recipe, tv_sample

from fusionflow import load_policy, policy_from_transform
from fusionflow.ops import fast
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import crop_window, draw
from fusionflow.tools.synthetic import make_jpegs

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
JPEGS = make_jpegs(6, 200, 600, seed=4)
TAIL = [T.PILToTensor(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]

AUGMENTS = {
    "rand-default": T.RandAugment(),
    "rand-m7-bilinear": T.RandAugment(
        num_ops=3, magnitude=7, num_magnitude_bins=21, interpolation=InterpolationMode.BILINEAR, fill=[128, 128, 128]
    ),
    "auto-imagenet": T.AutoAugment(AutoAugmentPolicy.IMAGENET),
    "auto-cifar10": T.AutoAugment(AutoAugmentPolicy.CIFAR10, fill=7),
    "trivial": T.TrivialAugmentWide(),
    "trivial-bins": T.TrivialAugmentWide(num_magnitude_bins=11, interpolation=InterpolationMode.BILINEAR),
}


def tv_magnitude(name, value):
    """FusionFlow's value -> torchvision's magnitude (the inverse of the unit in fusionflow/policy/op_specs.py)."""
    return value / 255.0 if name == "Solarize" else value


@pytest.mark.parametrize("key", AUGMENTS)
@pytest.mark.parametrize("size", [224, 176, (160, 192)])
def test_magnitude_tables_equal_torchvisions(key, size):
    aug = AUGMENTS[key]
    policy = policy_from_transform(T.Compose([T.RandomResizedCrop(size), aug]))
    h, w = policy.size
    a = policy.augment
    space = aug._AUGMENTATION_SPACE
    num_bins = 10 if isinstance(aug, T.AutoAugment) else aug.num_magnitude_bins
    assert a.num_bins == num_bins
    assert a.interpolation == getattr(aug.interpolation, "value", aug.interpolation)
    assert a.fill == (tuple(aug.fill) if isinstance(aug.fill, list) else ((aug.fill or 0),) * 3)
    names = [o.name for o in a.ops]
    if isinstance(aug, T.AutoAugment):
        assert a.type == "subpolicy"
        assert [[(s.op, s.prob, s.bin) for s in sub] for sub in a.subpolicies] == [
            [(n, p, b) for n, p, b in sub] for sub in aug._policies
        ]
    assert names == list(space)  # the same ops (rand, trivial: each drawn with equal probability)
    if not isinstance(aug, T.AutoAugment):
        if isinstance(aug, T.RandAugment):
            assert (a.type, a.num_ops, a.magnitude) == ("rand", aug.num_ops, aug.magnitude)
        else:
            assert a.type == "trivial"
    for choice in a.ops:
        table, signed = space[choice.name]
        mags = table(num_bins, h, w)
        assert choice.signed == signed
        if mags is None:
            assert choice.range is None
            continue
        ours = [tv_magnitude(choice.name, choice.value(b, num_bins)) for b in range(num_bins)]
        np.testing.assert_allclose(ours, mags.double().numpy(), rtol=1e-6, atol=1e-6, err_msg=choice.name)


@pytest.mark.parametrize(
    "name, transform",
    [("randaugment", T.RandAugment()), ("autoaugment", T.AutoAugment()), ("trivialaugment", T.TrivialAugmentWide())],
)
def test_torchvisions_defaults_are_the_shipped_policies(name, transform):
    ours = policy_from_transform(T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), transform]))
    shipped = load_policy(name)
    assert (ours.size, ours.scale, ours.ratio, ours.flip) == (shipped.size, shipped.scale, shipped.ratio, shipped.flip)
    a, b = ours.augment, shipped.augment
    assert dataclasses.replace(a, ops=()) == dataclasses.replace(b, ops=())
    assert [(o.name, o.signed, o.scale_with_size) for o in a.ops] == [
        (o.name, o.signed, o.scale_with_size) for o in b.ops
    ]
    for x, y in zip(a.ops, b.ops):
        assert (x.range is None) == (y.range is None) and (x.range is None or np.allclose(x.range, y.range, rtol=1e-6))


@pytest.mark.parametrize("key", ["rand-default", "rand-m7-bilinear", "auto-imagenet", "trivial"])
def test_cpu_pipeline_equals_torchvision_on_identical_draws(key):
    aug = AUGMENTS[key]
    t = T.Compose(
        [
            T.RandomResizedCrop(176, antialias=True),
            T.RandomHorizontalFlip(0.5),
            aug,
            *TAIL,
            T.RandomErasing(0.5, value="random"),
        ]
    )
    policy = policy_from_transform(t, decode="exact")
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS):
        d = draw(policy, 3, 1, i)
        np.testing.assert_allclose(pipe(data, i, seed=3, epoch=1), tv_recipe(policy, data, d), rtol=0, atol=1e-5)


def test_eval_form_and_uint8_output():
    p = policy_from_transform(T.Compose([T.Resize(232), T.CenterCrop(224), T.PILToTensor()]))
    e = load_policy("eval", resize=232)
    assert (p.size, p.center_resize, p.flip, p.augment, p.normalize) == (e.size, e.center_resize, 0.0, e.augment, None)
    scaled = policy_from_transform(
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToImage(), T.ToDtype(torch.float32, scale=True)])
    )
    assert scaled.normalize == ((0.0,) * 3, (1.0,) * 3) and scaled.out_dtype == "float32"
    data = JPEGS[0]
    img = Image.open(io.BytesIO(data)).convert("RGB")
    ref = F.center_crop(F.resize(F.pil_to_tensor(img), [256], antialias=True), [224])
    ours = CpuPipeline(dataclasses.replace(scaled, fast_downscale=False))(data, 0)
    assert np.abs(ours * 255 - ref.numpy()).mean() < 2.0  # the eval policy's documented sub-pixel window rounding


def ours_and_torchvision(policy, seed=3, epoch=1):
    """(index, draw, our pixels, torchvision's pixels for the same draw) for each of JPEGS."""
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS):
        d = draw(policy, seed, epoch, i)
        W, H = Image.open(io.BytesIO(data)).size
        yield i, d, pipe(data, i, seed=seed, epoch=epoch), tv_sample(policy, data, d, crop_window(policy, d, H, W))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_vertical_flip_equals_torchvision_to_the_bit(fast):
    """RandomVerticalFlip (timm's vflip) after the horizontal flip, drawn last: with p=0 the other draws are
    a policy's without it. The pixels equal torchvision's for the same draws."""
    t = T.Compose([T.RandomResizedCrop(96), T.RandomHorizontalFlip(), T.RandomVerticalFlip(0.5), T.PILToTensor()])
    policy = dataclasses.replace(policy_from_transform(t, decode="exact"), fast_downscale=fast)
    assert policy.vflip == 0.5 and policy.flip == 0.5
    flipped = 0
    for i, d, got, ref in ours_and_torchvision(policy):
        flipped += d.vflip
        assert np.array_equal(got, ref) if not fast else psnr(got, ref) >= 30, i
    assert 0 < flipped < len(JPEGS)
    unflipped = dataclasses.replace(policy, vflip=0.0)
    assert dataclasses.replace(draw(policy, 3, 1, 0), vflip=False) == draw(unflipped, 3, 1, 0)


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_gaussian_blur_in_random_apply_equals_torchvision(v1):
    """timm's gaussian_blur_prob: RandomApply([GaussianBlur(23)], p) after the augmentation. The exact
    mode runs torchvision's kernel (the pixels to the bit, given the draw's sigma); the fast mode OpenCV's,
    within a level."""
    import torchvision.transforms as T1

    M = T1 if v1 else T
    blur = M.RandomApply([M.GaussianBlur(23, (0.1, 2.0))], p=0.5)
    t = M.Compose([M.RandomResizedCrop(96), M.RandomHorizontalFlip(), M.RandAugment(), blur])
    policy = policy_from_transform(t, decode="exact")
    assert (policy.blur.kernel_size, policy.blur.sigma, policy.blur.p) == ((23, 23), (0.1, 2.0), 0.5)
    fast_policy, blurred = dataclasses.replace(policy, fast_downscale=True), 0
    for i, data in enumerate(JPEGS):
        d = draw(policy, 3, 1, i)
        unblurred = CpuPipeline(dataclasses.replace(policy, blur=None)).run_draw(
            data, dataclasses.replace(d, blur=None)
        )
        if d.blur is None:
            assert np.array_equal(CpuPipeline(policy)(data, i, seed=3, epoch=1), unblurred)
            continue
        blurred += 1
        assert 0.1 <= d.blur <= 2.0
        want = F.gaussian_blur(torch.from_numpy(unblurred), [23, 23], [d.blur, d.blur]).numpy()
        np.testing.assert_array_equal(CpuPipeline(policy)(data, i, seed=3, epoch=1), want)
        arr = np.ascontiguousarray(unblurred.transpose(1, 2, 0))
        got = fast.gaussian_blur(arr, (23, 23), d.blur).transpose(2, 0, 1)
        assert np.abs(got.astype(int) - want).max() <= 1
    assert 0 < blurred < len(JPEGS)
    assert fast_policy.blur == policy.blur


def test_color_jitter_and_grayscale_after_the_augmentation_equal_torchvision():
    """ColorJitter and RandomGrayscale after RandAugment (timm's order for '3a' and for an auto_augment with
    grayscale_prob): the policy keeps the order, and the exact mode's pixels are torchvision's to the bit."""
    t = T.Compose(
        [
            T.RandomResizedCrop(96),
            T.RandomHorizontalFlip(),
            T.RandAugment(),
            T.ColorJitter(0.4, 0.4, 0.4),
            T.RandomGrayscale(0.3),
        ]
    )
    policy = policy_from_transform(t, decode="exact")
    assert policy.color_after_augment and policy.jitter is not None and policy.grayscale == 0.3
    grey = 0
    for i, d, got, ref in ours_and_torchvision(policy):
        grey += d.grayscale
        assert np.array_equal(got, ref), (i, [op.name for op in d.ops])
    assert grey > 0


def test_squashed_resize_then_center_crop():
    """Resize((h, w)) squashes the image to exactly h x w (timm's no-aug and 'squash' crops); the exact
    mode resamples the same fractional box torchvision keeps."""
    p = policy_from_transform(T.Compose([T.Resize((240, 260)), T.CenterCrop(224), T.PILToTensor()]), decode="exact")
    assert p.center_resize == (240, 260) and p.size == (224, 224)
    for data in JPEGS[:3]:
        img = Image.open(io.BytesIO(data)).convert("RGB")
        ref = F.center_crop(F.resize(F.pil_to_tensor(img), [240, 260], antialias=True), [224])
        ours = CpuPipeline(p)(data, 0)
        assert np.abs(ours.astype(np.float64) - ref.numpy()).mean() < 2.0  # as the eval form's bound above
    alone = policy_from_transform(T.Compose([T.Resize((64, 96)), T.PILToTensor()]), decode="exact")
    assert alone.center_resize == (64, 96) and alone.size == (64, 96)  # Resize((h, w)) alone: the squashed image
    for data in JPEGS[:3]:
        img = Image.open(io.BytesIO(data)).convert("RGB")
        ref = F.resize(F.pil_to_tensor(img), [64, 96], antialias=True)
        ours = CpuPipeline(alone)(data, 0)
        assert ours.shape == tuple(ref.shape) and np.abs(ours.astype(np.float64) - ref.numpy()).mean() < 2.0
    with pytest.raises(ValueError, match=r"only Resize\(int\) \(the shorter side\) \+ CenterCrop"):
        policy_from_transform(T.Compose([T.Resize(64), T.PILToTensor()]))
    with pytest.raises(ValueError, match=r"crop.resize: \[200, 300\] is smaller than the 224x224"):
        load_policy(
            {"output": {"size": 224}, "crop": {"mode": "center", "resize": [200, 300]}, "augment": {"type": "none"}}
        )


@pytest.mark.parametrize(
    "pipeline, match",
    [
        (
            [T.RandomResizedCrop(224, interpolation=InterpolationMode.BOX)],
            r"transform 0 \(RandomResizedCrop.*interpolation='box'",
        ),
        ([T.RandomResizedCrop(224, antialias=False)], r"transform 0 .*antialias=False"),
        ([T.RandomHorizontalFlip(), T.RandomResizedCrop(224)], r"transform 0 \(RandomHorizontalFlip.*must start with"),
        (
            [T.RandomResizedCrop(224), T.ColorJitter(0.4), T.RandAugment(), T.ColorJitter(0.2)],
            r"transform 3 \(ColorJitter.*cannot be expressed here",
        ),
        (
            [T.RandomResizedCrop(224), T.RandomApply([T.RandomHorizontalFlip()], p=0.5)],
            r"transform 1 \(RandomApply.*only around a single ColorJitter",
        ),
        (
            [T.RandomResizedCrop(224), T.RandomChoice([T.ColorJitter(0.4)])],
            r"transform 1 \(RandomChoice.*no FusionFlow",
        ),
        (
            [T.RandomResizedCrop(224), T.RandAugment(interpolation=InterpolationMode.BOX)],
            r"transform 1 \(RandAugment.*'box'",
        ),
        (
            [T.RandomResizedCrop(224), T.PILToTensor(), T.Normalize(MEAN, STD)],
            r"transform 2 \(Normalize.*needs ToDtype",
        ),
        (
            [T.RandomResizedCrop(224), *TAIL[:2], T.RandomErasing(), T.Normalize(MEAN, STD)],
            r"transform 4 \(Normalize.*comes after RandomErasing",
        ),
        ([T.RandomResizedCrop(224), T.PILToTensor(), T.ToDtype(torch.float16, scale=True)], r"transform 2 .*float16"),
        (
            [T.RandomResizedCrop(224), T.PILToTensor(), T.RandomErasing(value="random")],
            r"no FusionFlow equivalent: .*erase\.value: 'random'",
        ),
        ([T.Resize(256)], r"transform 0 \(Resize.*only Resize\(int\) \(the shorter side\) \+ CenterCrop"),
        ([T.Resize(256, max_size=300), T.CenterCrop(224)], r"only Resize\(int\) .* or Resize\(\(h, w\)\)"),
        ([], r"the pipeline is empty"),
    ],
)
def test_what_cannot_be_expressed_is_named(pipeline, match):
    with pytest.raises(ValueError, match=match):
        policy_from_transform(T.Compose(pipeline) if pipeline else pipeline)


def _v1_and_v2(augment: str, erase: float, eval_form: bool = False):
    """One recipe written with torchvision.transforms (v1) and with v2, the same parameters."""
    import torchvision.transforms as V1

    def build(M, to_float):
        if eval_form:
            head = [M.Resize(232, antialias=True), M.CenterCrop(224)]
        else:
            head = [M.RandomResizedCrop(176, antialias=True), M.RandomHorizontalFlip(0.5)]
            head += {
                "ra": [M.RandAugment(magnitude=7, interpolation=M.InterpolationMode.BILINEAR)],
                "ta_wide": [M.TrivialAugmentWide()],
                "autoaugment": [M.AutoAugment(M.AutoAugmentPolicy.IMAGENET)],
                "none": [],
            }[augment]
        tail = [M.PILToTensor(), to_float, M.Normalize(MEAN, STD)] + ([M.RandomErasing(erase)] if erase else [])
        return M.Compose(head + tail)

    return build(V1, V1.ConvertImageDtype(torch.float)), build(T, T.ToDtype(torch.float32, scale=True))


@pytest.mark.parametrize("augment", ["ra", "ta_wide", "autoaugment", "none"])
def test_v1_pipelines_read_as_their_v2_twins(augment):
    v1, v2 = _v1_and_v2(augment, 0.25)
    assert policy_from_transform(v1) == policy_from_transform(v2)
    v1, v2 = _v1_and_v2(augment, 0.0, eval_form=True)
    assert policy_from_transform(v1, decode="exact") == policy_from_transform(v2, decode="exact")
    # ToTensor is PILToTensor + ToDtype(float32, scale=True)
    import torchvision.transforms as V1

    totensor = V1.Compose([V1.Resize(256), V1.CenterCrop(224), V1.ToTensor(), V1.Normalize(MEAN, STD)])
    same = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor(), T.ToDtype(torch.float32, scale=True)])
    assert policy_from_transform(totensor) == policy_from_transform(
        T.Compose([*same.transforms, T.Normalize(MEAN, STD)])
    )


class Preset:
    """A recipe preset as torchvision's classification reference builds one (its published
    parameters: crop size, flip, auto-augment, erasing, backend pil/tensor, v1/v2), holding its
    pipeline in `.transforms` and called on an image."""

    def __init__(self, train: bool, use_v2: bool, backend: str, auto_augment: str | None = "ra", erase: float = 0.1):
        import torchvision.transforms as V1

        M = T if use_v2 else V1
        steps = [M.PILToTensor()] if backend == "tensor" else []
        if train:
            steps += [M.RandomResizedCrop(176, antialias=True), M.RandomHorizontalFlip(0.5)]
            if auto_augment == "ra":
                steps.append(M.RandAugment(magnitude=9))
            elif auto_augment == "ta_wide":
                steps.append(M.TrivialAugmentWide())
        else:
            steps += [M.Resize(232, antialias=True), M.CenterCrop(224)]
        if backend == "pil":
            steps.append(M.PILToTensor())
        steps += [M.ToDtype(torch.float, scale=True) if use_v2 else M.ConvertImageDtype(torch.float)]
        steps.append(M.Normalize(MEAN, STD))
        if train and erase:
            steps.append(M.RandomErasing(erase))
        if use_v2:
            steps.append(T.ToPureTensor())
        self.transforms = M.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


@pytest.mark.parametrize("use_v2", [False, True])
@pytest.mark.parametrize("backend", ["pil", "tensor"])
def test_the_reference_recipes_presets_convert_as_they_are(use_v2, backend):
    def recipe(p):  # the policy without its `source` (which names what it was read from)
        return dataclasses.replace(p, source=None, name=None)

    train = policy_from_transform(Preset(True, use_v2, backend))
    want = policy_from_transform(Preset(True, True, "pil").transforms)
    assert recipe(train) == recipe(want) and train.augment.type == "rand" and train.erase is not None
    evaluation = policy_from_transform(Preset(False, use_v2, backend))
    assert recipe(evaluation) == recipe(
        load_policy("eval", resize=232, normalize={"mean": list(MEAN), "std": list(STD)})
    )


def test_pretrained_weights_eval_transform():
    from torchvision.models import ResNet50_Weights

    preset = ResNet50_Weights.IMAGENET1K_V2.transforms()  # resize 232, crop 224, bilinear, ImageNet mean/std
    policy = policy_from_transform(preset, decode="exact")
    assert (policy.size, policy.center_resize) == ((224, 224), 232)
    assert policy.normalize == (tuple(preset.mean), tuple(preset.std))
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS[:4]):
        ref = preset(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
        # the eval policy's documented sub-pixel window rounding, in normalised units (std ~0.225)
        assert np.abs(pipe(data, i) - ref).mean() < 2.0 / 255 / 0.224


def test_what_is_not_torchvision_is_named():
    import torchvision.transforms as V1

    class MyCrop(V1.RandomResizedCrop):
        pass

    for pipeline, k in (([V1.RandomResizedCrop(224), V1.Lambda(lambda x: x)], 1), ([MyCrop(224)], 0)):
        with pytest.raises(
            ValueError, match=rf"transform {k} \(.*not a torchvision or timm transform FusionFlow can read"
        ):
            policy_from_transform(pipeline)
    v1_bicubic = policy_from_transform(
        V1.Compose([V1.RandomResizedCrop(224, interpolation=V1.InterpolationMode.BICUBIC)])
    )
    assert v1_bicubic.crop_interpolation == "bicubic"


def test_antialias_none_is_refused_where_the_resize_sees_tensors():
    """torchvision does not antialias a tensor resized with antialias=None: read as antialiased, its pixels
    were 6-10 levels off on average. On the PIL path antialias is ignored, so None reads as True there."""
    import torchvision.transforms as V1

    for M in (T, V1):
        for crop in (M.RandomResizedCrop(64, antialias=None), M.Resize(72, antialias=None)):
            steps = [crop] + ([M.CenterCrop(64)] if isinstance(crop, M.Resize) else [])
            with pytest.raises(ValueError, match="antialias=None on tensors"):
                policy_from_transform([M.PILToTensor(), *steps])
            on_pil = policy_from_transform([*steps, M.PILToTensor()])
            crop.antialias = True
            assert on_pil == policy_from_transform([*steps, M.PILToTensor()])


def test_subclasses_and_containers_that_do_more_are_refused_not_read_as_torchvision_s():
    """A v2 subclass was read as the stock transform (its own behaviour dropped), and any object holding
    `.transforms` was opened, whatever its call returned (two views became one)."""

    class InvertingFlip(T.RandomHorizontalFlip):
        def transform(self, inpt, params):
            return F.invert(super().transform(inpt, params))

    class TwoViews:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, img):
            return self.transforms(img), self.transforms(img)

    class Logged(T.Compose):
        def forward(self, *inputs):
            print("augmenting")
            return super().forward(*inputs)

    for pipeline, says in (
        ([T.RandomResizedCrop(64), InvertingFlip(1.0)], r"transform 1 \(.*subclass of torchvision's RandomHorizontalF"),
        (TwoViews(T.Compose([T.RandomResizedCrop(64)])), r"its call does more than `return self.transforms\(img\)`"),
        (Logged([T.RandomResizedCrop(64)]), "transform 0 .*subclass of torchvision's Compose"),
    ):
        with pytest.raises(ValueError, match=says):
            policy_from_transform(pipeline)


def test_a_v2_random_apply_of_a_v1_jitter_reads_as_its_v2_twin():
    import torchvision.transforms as V1

    mixed = policy_from_transform([T.RandomResizedCrop(64), T.RandomApply([V1.ColorJitter(0.4, 0.4)], p=0.8)])
    assert mixed == policy_from_transform([T.RandomResizedCrop(64), T.RandomApply([T.ColorJitter(0.4, 0.4)], p=0.8)])


def test_odd_arguments_are_named_not_crashed_on():
    with pytest.raises(ValueError, match=r"transform 0 \(Resize.*max_size"):
        policy_from_transform([T.Resize(None, max_size=64), T.PILToTensor()])
    with pytest.raises(ValueError, match="transform 2 .*a policy has one grayscale step"):
        policy_from_transform([T.RandomResizedCrop(64), T.RandomGrayscale(0.2), T.Grayscale(3)])
