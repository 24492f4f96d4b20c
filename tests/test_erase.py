"""RandomErasing: torchvision.transforms.v2.RandomErasing semantics, drawn per (seed, epoch, index)."""

import dataclasses

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from dali_numpy import run_numpy
from tv_reference import tv_recipe

from experiments.dali_agreement import nvjpeg_gap
from fusionflow import load_policy
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import Erase, draw, uniforms
from fusionflow.tools.synthetic import make_jpegs

JPEGS = make_jpegs(6, 200, 500, seed=3)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("value", [0, "random", [0.5, -1.0, 2.0]])
def test_cpu_erase_equals_torchvision_erase_on_identical_draws(value):
    policy = load_policy("randaugment", normalize=(MEAN, STD), erase={"p": 0.7, "value": value})
    policy = dataclasses.replace(policy, fast_downscale=False)
    pipe, erased = CpuPipeline(policy), 0
    for i, data in enumerate(JPEGS):
        d = draw(policy, 1, 0, i)
        erased += d.erase is not None
        ours = pipe(data, i, seed=1)
        np.testing.assert_allclose(ours, tv_recipe(policy, data, d), rtol=0, atol=1e-5)
    assert 0 < erased < len(JPEGS) or len(JPEGS) < 3


def test_uint8_erase_with_a_colour():
    policy = dataclasses.replace(load_policy("default", erase={"p": 1.0, "value": [10, 200, 30]}), fast_downscale=False)
    for i, data in enumerate(JPEGS[:3]):
        d = draw(policy, 0, 0, i)
        ours = CpuPipeline(policy)(data, i)
        assert ours.dtype == np.uint8 and np.array_equal(ours, tv_recipe(policy, data, d))
        e = d.erase
        assert (
            ours[:, e.top : e.top + e.height, e.left : e.left + e.width] == np.array([10, 200, 30]).reshape(3, 1, 1)
        ).all()


class _Replay:
    """Serves torchvision's RandomErasing.make_params our uniforms: try t's area and ratio draws are
    u[4t], u[4t+1]; the fitting try's top and left draws are u[4t+2], u[4t+3]."""

    def __init__(self, u):
        self.u, self.uniforms, self.ints = u, 0, 0

    def uniform(self, lo, hi):
        t, k = divmod(self.uniforms, 2)
        self.uniforms += 1
        return float(lo) + self.u[4 * t + k] * (float(hi) - float(lo))

    def randint(self, lo, hi):
        t = (self.uniforms - 1) // 2
        v = lo + int(self.u[4 * t + 2 + self.ints] * (hi - lo))
        self.ints += 1
        return v


def test_erase_draw_equals_torchvision_make_params(monkeypatch):
    """torchvision's own make_params, its torch draws replaced by our uniforms, picks the rectangle
    our draw picks, and gives up (leaving the image alone) where ours does."""
    policy = load_policy("default", erase={"p": 1.0, "scale": [0.5, 1.0], "ratio": [0.3, 3.3]})
    tv = T.RandomErasing(p=1.0, scale=(0.5, 1.0), ratio=(0.3, 3.3), value=0)
    H, W = policy.size
    img = torch.zeros(3, H, W)
    replay = None
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, lo=0.0, hi=1.0: self.fill_(replay.uniform(lo, hi)))
    monkeypatch.setattr(torch, "randint", lambda lo, hi, size: torch.tensor([replay.randint(lo, hi)]))
    gave_up = 0
    for i in range(300):
        u = uniforms(7, 0, i, n=82)  # crop (40), flip, then erase's apply draw, then its 40 tries
        replay = _Replay(u[42:82].tolist())
        params = tv.make_params([img])
        d = draw(policy, 7, 0, i)
        got = None if d.erase is None else (d.erase.top, d.erase.left, d.erase.height, d.erase.width)
        want = None if params["v"] is None else (params["i"], params["j"], params["h"], params["w"])
        gave_up += want is None
        assert got == want, i
    assert gave_up > 0  # areas of half the image and more at ratios to 3.3: some samples give up: that branch ran


def test_probability_and_determinism():
    policy = load_policy("default", erase=0.25)
    assert policy.erase == Erase(p=0.25)
    hits = sum(draw(policy, 0, 0, i).erase is not None for i in range(2000))
    assert 400 < hits < 600
    assert draw(policy, 0, 0, 5) == draw(policy, 0, 0, 5)
    # a policy's other draws do not depend on whether it erases
    plain = load_policy("randaugment")
    with_erase = load_policy("randaugment", erase=0.5)
    for i in range(20):
        a, b = draw(plain, 2, 1, i), draw(with_erase, 2, 1, i)
        assert (a.crop_u, a.flip, a.ops) == (b.crop_u, b.flip, b.ops)


def test_policy_key_and_override_validation():
    cfg = {
        "output": {"size": 32, "normalize": {"mean": list(MEAN), "std": list(STD)}},
        "augment": {"type": "none"},
        "erase": {"p": 0.25, "value": "random"},
    }
    assert load_policy(cfg).erase == Erase(0.25, (0.02, 0.33), (0.3, 3.3), None)
    with pytest.raises(ValueError, match=r"erase\.value: 'random' \(standard normal noise\) needs float output"):
        load_policy("default", erase={"value": "random"})
    with pytest.raises(ValueError, match=r"erase\.value: \[0\.5, 0\.5, 0\.5\]: without output\.normalize"):
        load_policy("default", erase={"value": 0.5})
    with pytest.raises(ValueError, match=r"erase\.p: 1\.5 is out of range"):
        load_policy("default", erase=1.5)
    with pytest.raises(ValueError, match=r"erase\.scal: unknown key; did you mean 'scale'"):
        load_policy("default", erase={"scal": [0.1, 0.2]})
    # dropping normalisation re-checks the erase value's units
    with pytest.raises(ValueError, match=r"erase\.value: 'random'"):
        load_policy(cfg, normalize=None)
    assert load_policy(cfg, erase=None).erase is None
    assert load_policy(cfg, erase=0).erase is None


@pytest.mark.parametrize("value", [0, "random", [0.5, -1.0, 2.0], "uint8"])
def test_dali_cpu_erase_matches_cpu_pipeline(value):
    """DALI (CPU backend): the erased rectangle holds exactly the CPU path's values; the rest of the
    image is within the pipeline tolerance of tests/test_ops_dali.py (decode/resize rounding)."""
    check_dali_erase(value, {})


@pytest.mark.gpu
@pytest.mark.parametrize("value", [0, "random"])
def test_dali_gpu_erase_matches_cpu_pipeline(value):
    check_dali_erase(value, {"device": "gpu", "device_id": 0})


def check_dali_erase(value, where):
    pytest.importorskip("nvidia.dali")
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    if value == "uint8":
        policy = load_policy("default", erase={"p": 0.7, "value": [10, 200, 30]})
    else:
        policy = load_policy("default", normalize=(MEAN, STD), erase={"p": 0.7, "value": value})
    policy = dataclasses.replace(policy, fast_downscale=False)
    dp, cp = DaliPolicyPipeline(policy, batch_size=len(JPEGS), **where), CpuPipeline(policy)
    idx = list(range(len(JPEGS)))
    out = run_numpy(dp, JPEGS, idx, seed=1)
    # the GPU's decoder (nvJPEG) is its own gap from libjpeg-turbo's, before any op (tests/dali_numpy.py)
    gap = nvjpeg_gap(JPEGS)[0] if where.get("device") == "gpu" else 0.0
    erased = 0
    for i in idx:
        ref, d = cp(JPEGS[i], i, seed=1), draw(policy, 1, 0, i)
        assert out[i].dtype == ref.dtype
        mask = np.zeros(ref.shape[1:], bool)
        if d.erase is not None:
            e = d.erase
            mask[e.top : e.top + e.height, e.left : e.left + e.width] = True
            erased += 1
            assert np.array_equal(out[i][:, mask], ref[:, mask])  # exact: both write the same values
        level = 1.0 if value == "uint8" else 1.0 / (255 * min(STD))  # ~ a level of 255, as test_ops_dali
        assert np.abs(out[i][:, ~mask].astype(np.float32) - ref[:, ~mask]).mean() < level * (1.0 + gap), gap
    assert erased >= 2
