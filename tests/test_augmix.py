"""torchvision's AugMix as a policy (`augment.type: augmix`, configs/augmix.yaml): its tables equal
torchvision's, exact mode equals torchvision's own AugMix given the same draw (the test injects each
FusionFlow draw into torchvision's object: its Dirichlet samples and its randint calls answered with the
draw's decisions), fast mode stays within a stated tolerance, the draw's distribution is AugMix's, the
recipe's transforms convert, and the loader runs it exactly once per sample (the DALI accelerator
declines it)."""

import logging

import numpy as np
import pytest
import torchvision.transforms as T1
import torchvision.transforms.v2 as T
from PIL import Image, ImageFilter
from scipy import stats
from test_interpolation import Bytes  # a dataset of encoded bytes and their sizes
from tv_reference import tv_augmix  # torchvision's AugMix with a FusionFlow draw injected

from fusionflow import load_policy, policy_from_transform
from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import draw
from fusionflow.policy.tv_augmix import magnitude_table


def _image(size, seed):
    h, w = size
    rng = np.random.default_rng(seed)
    noise = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return noise.filter(ImageFilter.GaussianBlur(1.5))  # photo-like: smooth regions and edges


def _policy(mode="exact", size=64, **augment):
    return load_policy({"output": {"size": size}, "decode": {"mode": mode}, "augment": {"type": "augmix", **augment}})


@pytest.mark.parametrize("size", [(64, 64), (48, 80), (224, 224)])
@pytest.mark.parametrize("all_ops", [True, False])
def test_tables_are_torchvisions(size, all_ops):
    space = T1.AugMix(all_ops=all_ops)._augmentation_space(10, size)
    ours = magnitude_table(all_ops, *size)
    assert list(ours) == list(space)  # the order its op index draws from
    for name, (magnitudes, _signed) in space.items():
        want = tuple(float(v) for v in magnitudes.tolist()) if magnitudes.ndim else None
        assert ours[name] == want, name


CASES = [
    dict(),  # torchvision's defaults: severity 3, width 3, depth 1..3, alpha 1, all ops, bilinear
    dict(severity=10, mixture_width=2, chain_depth=2, alpha=0.5, all_ops=False, interpolation="nearest"),
    dict(severity=6, mixture_width=4, chain_depth=-1, alpha=3.0, fill=[10, 200, 30]),
    dict(severity=1, mixture_width=1, chain_depth=3),
]


@pytest.mark.parametrize("kw", CASES)
def test_exact_mode_is_torchvisions_augmix_given_the_same_draw(kw):
    fill = kw.get("fill")
    t = T1.AugMix(
        severity=kw.get("severity", 3),
        mixture_width=kw.get("mixture_width", 3),
        chain_depth=kw.get("chain_depth", -1),
        alpha=kw.get("alpha", 1.0),
        all_ops=kw.get("all_ops", True),
        interpolation=T1.InterpolationMode(kw.get("interpolation", "bilinear")),
        fill=fill,
    )
    for size in ((64, 64), (40, 72)):
        policy = _policy(size=list(size), **kw)
        pipe = CpuPipeline(policy)
        for i in range(12):
            img, d = _image(size, i), draw(policy, 3, 1, i)
            got = np.asarray(pipe.augment_image(img, d))
            np.testing.assert_array_equal(got, tv_augmix(t, img, d), err_msg=f"{kw} {size} sample {i}")


def test_fast_mode_stays_within_its_stated_tolerance():
    """Fast mode runs FusionFlow's own kernels (Pillow's op semantics) where torchvision's AugMix runs its
    tensor ops: stated tolerance (configs/README.md) mean |diff| <= 0.5 levels over samples, <= 3 per image."""
    exact, fast = CpuPipeline(_policy("exact")), CpuPipeline(_policy("fast"))
    per_image = []
    for i in range(40):
        img, d = _image((64, 64), 100 + i), draw(exact.policy, 0, 0, i)
        want = np.asarray(exact.augment_image(img, d)).astype(np.int16)
        per_image.append(np.abs(fast.augment_array(np.asarray(img), d).astype(np.int16) - want).mean())
    assert np.mean(per_image) <= 0.5 and max(per_image) <= 3.0, per_image


def test_draw_follows_augmix_distribution():
    policy = _policy(size=224)
    draws = [draw(policy, 7, 0, i) for i in range(3000)]
    assert draw(policy, 7, 0, 5) == draws[5] and draw(policy, 7, 1, 5) != draws[5]  # pure, per epoch
    depths = np.bincount([len(c) for d in draws for c in d.mix.chains])[1:]
    assert len(depths) == 3 and stats.chisquare(depths).pvalue > 1e-3  # 1..3 uniformly
    names = list(magnitude_table(True, 224, 224))
    ops = np.bincount([names.index(s.op) for d in draws for s in d.steps], minlength=len(names))
    assert stats.chisquare(ops).pvalue > 1e-3  # every op equally likely
    bins = np.bincount([int(s.level) for d in draws for s in d.steps])
    assert len(bins) == 3 and stats.chisquare(bins).pvalue > 1e-3  # severity 3: the first 3 bins
    m = np.array([d.mix.m for d in draws])
    assert stats.kstest(m, "beta", args=(1.0, 1.0)).pvalue > 1e-3  # Beta(1, 1): uniform
    w = np.array([d.mix.weights for d in draws])
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-6)
    assert stats.kstest(w[:, 0], "beta", args=(1.0, 2.0)).pvalue > 1e-3  # Dirichlet(1,1,1)'s marginal
    signed = [s.negate for d in draws for s in d.steps if s.op in ("Rotate", "ShearX", "Brightness")]
    assert 0.45 < np.mean(signed) < 0.55
    assert not any(s.negate for d in draws for s in d.steps if s.op in ("Posterize", "Equalize"))


@pytest.mark.parametrize("module", [T1, T])
def test_recipe_transform_converts(module):
    tf = module.Compose(
        [
            module.RandomResizedCrop(176, antialias=True),
            module.RandomHorizontalFlip(),
            module.AugMix(severity=5, mixture_width=2, interpolation=module.InterpolationMode.NEAREST),
            module.PILToTensor(),
        ]
    )
    policy = policy_from_transform(tf)
    ref = load_policy("augmix", size=176, interpolation="nearest")
    assert policy.size == (176, 176) and policy.flip == 0.5
    assert policy.augment.augmix.severity == 5 and policy.augment.augmix.mixture_width == 2
    assert policy.augment.interpolation == ref.augment.interpolation == "nearest"
    assert (
        load_policy("augmix").augment.augmix
        == policy_from_transform([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.AugMix()]).augment.augmix
    )


def test_what_does_not_convert_says_why():
    bicubic = T.AugMix(interpolation=T.InterpolationMode.BICUBIC)
    with pytest.raises(ValueError, match="AugMix.*interpolation='bicubic'"):
        policy_from_transform([T.RandomResizedCrop(64), bicubic])
    with pytest.raises(ValueError, match="augment.severity"):
        _policy(severity=11)
    with pytest.raises(ValueError, match="augment.chain_depth"):
        _policy(chain_depth=0)
    with pytest.raises(ValueError, match=r"augment: unknown key.*num_ops|num_ops"):
        _policy(num_ops=2)


def loader_runs_it_once_and_dali_declines(policy, caplog, word):
    """The loader with accelerator='dali-cpu' on a policy DALI declines: one log line naming it, every
    sample exactly once from the CPU workers, at the policy's size."""
    pytest.importorskip("nvidia.dali")
    with caplog.at_level(logging.WARNING, logger="fusionflow.loader"):
        loader = FusionFlowLoader(Bytes(20), batch_size=6, num_workers=1, policy=policy, accelerator="dali-cpu")
    said = [r.getMessage() for r in caplog.records if "declines policy" in r.getMessage()]
    assert len(said) == 1 and word in said[0] and loader.config.accelerator is None
    with loader:
        batches = list(loader)
    assert sorted(int(v) for _, y in batches for v in y) == list(range(20))
    assert batches[0][0].shape[1:] == (3, *policy.size) and loader.stats.accelerator_tiny_batches == 0


def test_loader_runs_augmix_exactly_once_and_the_accelerator_declines(caplog):
    loader_runs_it_once_and_dali_declines(load_policy("augmix", size=64), caplog, "augmix")


def test_interpolation_override_keeps_to_what_augmix_takes():
    assert load_policy("augmix", interpolation="nearest").augment.interpolation == "nearest"
    with pytest.raises(ValueError, match="interpolation.*AugMix"):
        load_policy("augmix", interpolation="bicubic")
