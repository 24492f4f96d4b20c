"""The native pixel kernels (fusionflow/kernels/pixel_ops.cc) against Pillow's own ops, bit for bit:
nearest affine warps over many random matrices, sizes and fills; Equalize and AutoContrast on the
images whose tables are special cases; and what happens where a kernel declines."""

import logging

import numpy as np
import pytest
from PIL import Image

from fusionflow.ops import exact, fast, pixel_kernels
from fusionflow.policy.op_specs import OPS
from fusionflow.tools.synthetic import make_image

SIZES = [(224, 224), (120, 200), (97, 61), (1, 1), (5, 300), (300, 2)]
FILLS = [(0, 0, 0), (128, 30, 200)]
RANGES = {"ShearX": 0.99, "ShearY": 0.99, "Rotate": 180.0}


@pytest.fixture(autouse=True)
def _native():
    assert pixel_kernels.available(), pixel_kernels.why_unavailable()


def _pillow(name, arr, value, params, style):
    return np.asarray(exact.apply(name, Image.fromarray(arr), value, params, style))


@pytest.mark.parametrize("name", sorted(RANGES))
def test_affine_nearest_is_pillows_transform(name):
    rng = np.random.default_rng(len(name))
    extremes = [0.0, -0.0, RANGES[name], -RANGES[name]]
    for k, (h, w) in enumerate(SIZES):
        arr = make_image(h, w, k + 1)
        for value in [*rng.uniform(-RANGES[name], RANGES[name], 12), *extremes]:
            for fill in FILLS:
                style = exact.Style("nearest", fill)
                params = OPS[name].resolve(float(value), (0.3, 0.7), h, w)
                got = pixel_kernels.affine_nearest(arr, params, fill)
                assert got is not None
                np.testing.assert_array_equal(got, _pillow(name, arr, float(value), params, style), err_msg=f"{value}")


def test_affine_nearest_general_matrices_and_a_non_square_scale():
    rng = np.random.default_rng(7)
    arr = make_image(90, 130, 4)
    img = Image.fromarray(arr)
    for _ in range(200):
        m = (*rng.uniform(-2, 2, 2), rng.uniform(-150, 150), *rng.uniform(-2, 2, 2), rng.uniform(-150, 150))
        want = np.asarray(
            img.transform(img.size, Image.Transform.AFFINE, m, Image.Resampling.NEAREST, fillcolor=(1, 2, 3))
        )
        got = pixel_kernels.affine_nearest(arr, m, (1, 2, 3))
        if m[1] == 0 and m[3] == 0:  # Pillow scales by another path; never drawn from random floats
            continue
        np.testing.assert_array_equal(got, want, err_msg=str(m))


def test_affine_nearest_declines_past_fixed_point_and_the_op_still_matches():
    arr = make_image(64, 64, 5)
    far = (1.0, 0.2, 40000.0, 0.0, 1.0, 0.0)  # corners beyond Pillow's 16.16 range
    assert pixel_kernels.affine_nearest(arr, far, (9, 9, 9)) is None
    style = exact.Style("nearest", (9, 9, 9))
    got = fast.FAST["ShearX"](arr, 0.2, far, style)  # OpenCV's warp takes over
    np.testing.assert_array_equal(got, np.full_like(arr, 9))


def _table_images():
    rng = np.random.default_rng(3)
    yield make_image(224, 224, 1)
    yield make_image(97, 61, 3)
    yield np.zeros((10, 10, 3), np.uint8)  # one value: left as it is
    yield np.full((4, 5, 3), 7, np.uint8)
    yield rng.integers(0, 256, (50, 51, 3), dtype=np.uint8)
    yield (rng.integers(0, 2, (30, 30, 3)) * 255).astype(np.uint8)  # two values
    yield rng.integers(100, 110, (64, 64, 3), dtype=np.uint8)  # a narrow range: a large stretch
    two = np.zeros((1, 2, 3), np.uint8)
    two[0, 1] = (1, 255, 128)
    yield two
    yield make_image(1, 1, 2)
    yield make_image(1, 17, 2)  # a pixel count that is not a whole number of blocks


@pytest.mark.parametrize("name", ["Equalize", "AutoContrast"])
def test_table_ops_are_pillows(name):
    fn = {"Equalize": pixel_kernels.equalize, "AutoContrast": pixel_kernels.autocontrast}[name]
    for arr in _table_images():
        before = arr.copy()
        got = fn(arr)
        np.testing.assert_array_equal(got, _pillow(name, arr, 0.0, (), exact.Style()), err_msg=str(arr.shape))
        np.testing.assert_array_equal(arr, before)


def test_inputs_the_kernels_do_not_take_are_declined():
    arr = make_image(20, 20, 1)
    assert pixel_kernels.equalize(arr[:, ::-1]) is None  # not contiguous
    assert pixel_kernels.autocontrast(arr[..., :2].copy()) is None  # not three channels
    assert pixel_kernels.affine_nearest(arr.astype(np.float32), (1, 0.1, 0, 0, 1, 0), (0, 0, 0)) is None


def test_unbuildable_kernels_warn_once_and_the_fast_ops_fall_back(monkeypatch, caplog):
    from fusionflow import native

    def fail(*a, **k):
        raise native.NativeBuildError("building ff_pixel_ops failed (c++ ... exit 1)")

    monkeypatch.setattr(pixel_kernels, "_LIB", None)
    monkeypatch.setattr(pixel_kernels, "_WHY_NOT", None)
    monkeypatch.setattr(native, "build", fail)
    arr = make_image(40, 40, 2)
    with caplog.at_level(logging.WARNING, logger="fusionflow"):
        assert pixel_kernels.equalize(arr) is None
        assert pixel_kernels.affine_nearest(arr, (1, 0.1, 0, 0, 1, 0), (0, 0, 0)) is None
    said = [r for r in caplog.records if "native pixel kernels are unavailable" in r.getMessage()]
    assert len(said) == 1 and "ff_pixel_ops failed" in said[0].getMessage()
    np.testing.assert_array_equal(
        fast.FAST["Equalize"](arr, 0.0, (), exact.Style()), _pillow("Equalize", arr, 0.0, (), exact.Style())
    )
