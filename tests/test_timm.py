"""timm's transforms read by policy_from_transform / from_timm, and FusionFlow's pixels equal to timm's
own objects given the same draws: the test replays each sample's FusionFlow draw into timm (its
`random` and numpy calls answered with the draw's decisions) and compares the outputs."""

import contextlib
import dataclasses
import io
import logging
import math

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image
from test_interpolation import Bytes  # a dataset of encoded bytes and their sizes

import fusionflow
from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import crop_window, draw
from fusionflow.tools.synthetic import make_image, make_jpegs

timm = pytest.importorskip("timm")
aa = pytest.importorskip("timm.data.auto_augment")
re_mod = pytest.importorskip("timm.data.random_erasing")
timm_tf = pytest.importorskip("timm.data.transforms")
from timm.data import create_transform  # noqa: E402

JPEGS = make_jpegs(12, 150, 500, seed=21)
SIGNED = {  # the ops whose level function draws a sign (timm's call pattern, which the replay follows)
    name
    for name, fn in aa.LEVEL_TO_ARG.items()
    if fn
    in (
        aa._rotate_level_to_arg,
        aa._enhance_increasing_level_to_arg,
        aa._shear_level_to_arg,
        aa._translate_abs_level_to_arg,
        aa._translate_rel_level_to_arg,
    )
}
PIL_MODES = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


class Replay:
    """Stands in for timm's `random` and `np.random`, answering each call from queues filled with a
    FusionFlow draw's decisions; `done()` checks that timm asked for exactly what was queued."""

    def __init__(self):
        self.q = {k: [] for k in ("random", "gauss", "uniform", "choice", "randint", "np_choice", "dirichlet", "beta")}

    def _pop(self, kind):
        assert self.q[kind], f"timm called {kind} more often than the draw says"
        return self.q[kind].pop(0)

    def random(self):
        return self._pop("random")

    def gauss(self, mu, sigma):
        return self._pop("gauss")

    def uniform(self, a, b):
        return self._pop("uniform")

    def choice(self, seq):
        want = self._pop("choice")
        return next(x for x in seq if x == want) if not isinstance(want, list) else want

    def randint(self, a, b=None):
        return self._pop("randint")

    def done(self):
        assert not any(self.q.values()), f"queued but never asked for: { {k: v for k, v in self.q.items() if v} }"


@contextlib.contextmanager
def replaying(monkeypatch, replay):
    class NpRandom:
        def choice(self, a, size=None, replace=True, p=None):
            return np.array(replay._pop("np_choice"), dtype=object)

        def randint(self, lo, hi=None):
            return replay._pop("randint")

        def dirichlet(self, alpha):
            return replay._pop("dirichlet")

        def beta(self, a, b):
            return replay._pop("beta")

    class Np:
        random = NpRandom()

        def __getattr__(self, name):
            return getattr(np, name)

    with monkeypatch.context() as m:
        m.setattr(aa, "random", replay)
        m.setattr(aa, "np", Np())
        m.setattr(re_mod, "random", replay)
        yield replay
    replay.done()


def queue_ops(replay, timm_aug, d, policy):
    """The draw's timm steps as the answers timm's objects will ask for, in their call order."""
    t = policy.augment.timm
    kind = type(timm_aug).__name__
    if kind == "AugMixAugment":
        replay.q["dirichlet"].append(np.asarray(d.mix.weights))
        replay.q["beta"].append(d.mix.m)
    if kind == "AutoAugment":
        replay.q["choice"].append(timm_aug.policy[d.steps[0].group])
    for g in sorted({s.group for s in d.steps}):
        steps = [s for s in d.steps if s.group == g]
        if kind == "AugMixAugment" and t.depth <= 0:
            replay.q["randint"].append(len(steps))
        if kind != "AutoAugment":  # one numpy choice per RandAugment call / AugMix chain
            by_name = {op.name: op for op in timm_aug.ops}
            replay.q["np_choice"].append([by_name[s.op] for s in steps])
        for k, s in enumerate(steps):
            prob = timm_aug.policy[g][k].prob if kind == "AutoAugment" else timm_aug.ops[0].prob
            if prob < 1.0:
                replay.q["random"].append(0.0 if s.applied else 1.0)
            if not s.applied:
                continue
            if math.isinf(t.magnitude_std):
                replay.q["uniform"].append(s.level)
            elif t.magnitude_std > 0:
                replay.q["gauss"].append(s.level)
            if s.op in SIGNED:
                replay.q["random"].append(1.0 if s.negate else 0.0)
            if s.op == "GaussianBlurRand":  # its radius: timm's random.uniform inside the op
                replay.q["uniform"].append(s.aux)
            if policy.augment.interpolation == "random" and s.op.startswith(("Rotate", "Shear", "Translate")):
                replay.q["choice"].append(PIL_MODES[s.resample])


def _posterize_zero(img, d, pipe):
    """The sample timm cannot make (0 bits): FusionFlow's 0-bit Posterize is black, torchvision's tensor
    semantics; every other op of the draw as checked elsewhere."""
    out = pipe.augment_image(img, d)
    zero = [op for op in d.ops if op.name == "Posterize" and op.value == 0]
    assert zero and np.asarray(pipe.augment_image(img, dataclasses.replace(d, ops=(zero[0],)))).max() == 0
    return out


def _transform(**kw):
    return create_transform(224, is_training=True, **kw)


RECIPES = {
    "rand-m9-mstd0.5-inc1": dict(auto_augment="rand-m9-mstd0.5-inc1", interpolation="random"),
    "rand-m7-n3-mstd1-tweights": dict(auto_augment="rand-m7-n3-mstd1-tweights"),
    "rand-m9-mstd101": dict(auto_augment="rand-m9-mstd101-inc0", interpolation="bicubic"),
    "augmix-m5-w4-d2": dict(auto_augment="augmix-m5-w4-d2"),
    "augmix-m3-b1": dict(auto_augment="augmix-m3-b1", interpolation="random"),
    "original-mstd0.5": dict(auto_augment="original-mstd0.5"),
    "v0r": dict(auto_augment="v0r", interpolation="bicubic"),
    "3a": dict(auto_augment="3a", color_jitter=None),  # DeiT III's: Solarize, Desaturate, a random-radius blur
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_timm_augmentations_equal_timm_given_the_same_draws(recipe, monkeypatch):
    transform = _transform(**RECIPES[recipe])
    timm_aug = transform.transforms[2]
    policy = fusionflow.policy_from_transform(transform, decode="exact")
    pipe = CpuPipeline(policy)
    img = Image.fromarray(make_image(224, 224, 5))
    applied = 0
    for index in range(40):
        d = draw(policy, 3, 1, index)
        replay = Replay()
        queue_ops(replay, timm_aug, d, policy)
        try:
            with replaying(monkeypatch, replay):
                want = np.asarray(timm_aug(img))
        except ValueError as exc:  # timm's Posterize below level 2.5 asks Pillow for 0 bits, which it refuses
            assert "bits must be" in str(exc) and any(s.op == "Posterize" and s.level < 2.5 for s in d.steps)
            want = np.asarray(_posterize_zero(img, d, pipe))
        got = np.asarray(pipe.augment_image(img, d))
        np.testing.assert_array_equal(got, want, err_msg=f"{recipe} sample {index}: {d.steps}")
        applied += sum(s.applied for s in d.steps)
    assert applied >= 20  # the draws applied ops (not a test of identity against identity)


@pytest.mark.parametrize("recipe", ["rand-m9-mstd0.5-inc1", "augmix-m5-w4-d2", "original-mstd0.5"])
def test_fast_mode_stays_close_to_timm(recipe):
    transform = _transform(**RECIPES[recipe])
    exact = fusionflow.policy_from_transform(transform, decode="exact")
    fast = CpuPipeline(dataclasses.replace(exact, fast_downscale=True))
    exact = CpuPipeline(exact)
    arr = make_image(224, 224, 6)
    worst = []
    for index in range(30):
        d = draw(exact.policy, 0, 0, index)
        a = np.asarray(exact.augment_image(Image.fromarray(arr), d)).astype(np.float64)
        b = fast.augment_array(arr, d).astype(np.float64)
        mse = np.mean((a - b) ** 2)
        worst.append(99.0 if mse == 0 else 10 * math.log10(255.0**2 / mse))
    # fast kernels round where Pillow truncates and OpenCV's bilinear warps differ on edge pixels
    assert np.median(worst) >= 40.0 and min(worst) >= 25.0, sorted(worst)[:5]


def test_whole_train_transform_equals_timm_with_crop_flip_and_erasing(monkeypatch):
    transform = _transform(
        auto_augment="rand-m9-mstd0.5-inc1", interpolation="random", re_prob=0.6, re_mode="pixel", re_count=2
    )
    crop_t, flip_t, timm_aug, to_tensor, normalize, erasing = transform.transforms
    policy = fusionflow.policy_from_transform(transform, decode="exact")
    pipe = CpuPipeline(policy)
    erased = 0
    for index, data in enumerate(JPEGS):
        d = draw(policy, 7, 0, index)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        top, left, h, w = crop_window(policy, d, img.height, img.width)
        replay = Replay()
        replay.q["choice"].append(F.InterpolationMode(d.crop_resample))
        monkeypatch.setattr(type(crop_t), "get_params", staticmethod(lambda *a, _c=(top, left, h, w): _c))
        monkeypatch.setattr(timm_tf, "random", replay)
        x = crop_t(img)
        x = F.horizontal_flip(x) if d.flip else x
        queue_ops(replay, timm_aug, d, policy)
        with replaying(monkeypatch, replay):
            x = normalize(to_tensor(timm_aug(x)))
            fills = iter(d.erase.fills(policy.erase) if d.erase else [])
            if d.erase is None:
                replay.q["random"].append(1.0)
            else:
                erased += 1
                replay.q["random"].append(0.0)
                replay.q["randint"].append(len(d.erase.rects))
                for top_, left_, eh, ew in d.erase.rects:  # answers that give timm exactly this rectangle
                    replay.q["uniform"] += [eh * ew * len(d.erase.rects) / (224 * 224), math.log(eh / ew)]
                    replay.q["randint"] += [top_, left_]
            monkeypatch.setattr(
                re_mod, "_get_pixels", lambda per_pixel, rand_color, size, _f=fills, **k: torch.from_numpy(next(_f))
            )
            x = erasing(x)
        got = pipe(data, index, seed=7, epoch=0)
        np.testing.assert_allclose(got, x.numpy(), atol=2e-6, err_msg=f"sample {index}")
    assert erased >= 3


def test_eval_transform_converts_and_matches_timm():
    for kw in (dict(), dict(interpolation="bicubic", crop_pct=0.95)):
        transform = create_transform(224, is_training=False, **kw)
        policy = fusionflow.policy_from_transform(transform, decode="exact")
        assert policy.augment.type == "none" and policy.center_resize == (256 if not kw else 235)
        pipe = CpuPipeline(policy)
        for index, data in enumerate(JPEGS[:4]):
            want = transform(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
            got = pipe(data, index)
            assert got.shape == want.shape
            assert np.median(np.abs(got - want)) < 0.02  # eval's fractional-box bound: docs in README


def test_what_converts_reads_timm_objects():
    p = fusionflow.from_timm(
        224,
        is_training=True,
        auto_augment="rand-m9-mstd0.5-inc1",
        interpolation="random",
        re_prob=0.25,
        re_mode="pixel",
    )
    t = p.augment.timm
    assert p.augment.type == "timm-rand" and t.magnitude == 9 and t.magnitude_std == 0.5 and t.num_ops == 2
    assert "PosterizeIncreasing" in t.ops and p.augment.interpolation == "random" and p.crop_interpolation == "random"
    assert p.augment.fill == (124, 116, 104) and t.translate_const == 100
    assert p.erase.p == 0.25 and p.erase.value is None and p.erase.noise == "pixel" and p.erase.count == (1, 1)
    p = fusionflow.from_timm(224, is_training=True, auto_augment="augmix-m5-w4-d2")
    t = p.augment.timm
    assert (p.augment.type, t.magnitude, t.width, t.depth, t.translate_pct) == ("timm-augmix", 5, 4, 2, 0.3)
    assert math.isinf(t.magnitude_std)
    p = fusionflow.from_timm(224, is_training=True, auto_augment="v0", re_prob=0.3, re_mode="rand", re_count=3)
    assert p.augment.type == "timm-auto" and len(p.augment.timm.subpolicies) == 25
    assert p.erase.noise == "color" and p.erase.count == (1, 3)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(naflex=True), r"RandomResizedCropToSequence has no FusionFlow equivalent"),
        (dict(train_crop_mode="rkrr", drop="crop_or_pad"), r"ResizeKeepRatio must be followed by RandomCropOrPad"),
        (dict(train_crop_mode="rkrc", pad="edge"), r"padding_mode 'edge' is not expressible"),
    ],
)
def test_what_does_not_convert_says_why(kw, match):
    drop, pad = kw.pop("drop", None), kw.pop("pad", None)
    transform = create_transform(224, is_training=True, **kw)
    if drop:  # a pipeline timm does not build but a user could: the resize without its crop
        transform.transforms = [t for t in transform.transforms if not type(t).__name__.endswith("CropOrPad")]
    if pad:
        transform.transforms[1].padding_mode = pad
    with pytest.raises(ValueError, match=match):
        fusionflow.policy_from_transform(transform)


def test_draw_frequencies_follow_timm():
    policy = fusionflow.from_timm(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", interpolation="random")
    steps = [s for i in range(3000) for s in draw(policy, 0, 0, i).steps]
    names = policy.augment.timm.ops
    counts = np.array([sum(s.op == n for s in steps) for n in names])
    expected = len(steps) / len(names)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 36.1  # 14 degrees of freedom, p = 0.001
    for flag in ("applied", "negate"):
        assert abs(np.mean([getattr(s, flag) for s in steps]) - 0.5) < 0.03
    levels = np.array([s.level for s in steps])
    assert abs(levels.mean() - 9) < 0.03 and abs(levels.std() - 0.5) < 0.03
    assert abs(np.mean([s.resample == "bicubic" for s in steps]) - 0.5) < 0.03
    crops = [draw(policy, 0, 0, i).crop_resample for i in range(2000)]
    assert abs(crops.count("bicubic") / 2000 - 0.5) < 0.04
    mix = fusionflow.from_timm(224, is_training=True, auto_augment="augmix-m5-w3")
    draws = [draw(mix, 0, 0, i).mix for i in range(2000)]
    depths = np.bincount([len(c) for m in draws for c in m.chains], minlength=4)[1:]
    assert np.all(np.abs(depths / depths.sum() - 1 / 3) < 0.03)
    assert (
        abs(np.mean([m.weights[0] for m in draws]) - 1 / 3) < 0.02 and abs(np.mean([m.m for m in draws]) - 0.5) < 0.02
    )


def test_erase_rectangles_follow_timm():
    """Our erase draw against timm's own RandomErasing with its own (seeded) randomness: the erased
    area (the union of the rectangles: timm's may overlap), over many samples."""
    import random

    policy = fusionflow.from_timm(224, is_training=True, auto_augment="rand-m9", re_prob=1.0, re_count=3)
    ours = []
    for i in range(1500):
        mask = np.zeros((224, 224), bool)
        for top, left, h, w in draw(policy, 0, 0, i).erase.rects:
            mask[top : top + h, left : left + w] = True
        ours.append(int(mask.sum()))
    erasing = re_mod.RandomErasing(1.0, max_count=3, device="cpu")
    random.seed(1)
    theirs = []
    for _ in range(1500):
        x = torch.ones(3, 224, 224)
        erasing(x)
        theirs.append(int((x[0] == 0).sum()))
    assert abs(np.mean(ours) / np.mean(theirs) - 1) < 0.06  # standard error of the ratio ~2%
    assert np.bincount([len(draw(policy, 0, 0, i).erase.rects) for i in range(600)])[1:].min() > 150


def test_loader_runs_a_timm_policy_and_the_accelerator_declines(caplog):
    pytest.importorskip("nvidia.dali")
    policy = fusionflow.from_timm(96, is_training=True, auto_augment="augmix-m3-w2", re_prob=0.5, re_count=2)
    with caplog.at_level(logging.WARNING, logger="fusionflow.loader"):
        loader = FusionFlowLoader(Bytes(24), batch_size=6, num_workers=1, policy=policy, accelerator="dali-cpu")
    said = [r.getMessage() for r in caplog.records if "declines policy" in r.getMessage()]
    assert len(said) == 1 and "timm-augmix" in said[0] and loader.config.accelerator is None
    with loader:
        seen = sorted(int(v) for _, y in loader for v in y)
    assert seen == list(range(24)) and loader.stats.accelerator_tiny_batches == 0
