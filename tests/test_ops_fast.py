"""The array kernels (fusionflow/ops/fast.py) against the exact Pillow ops (fusionflow/ops/exact.py,
themselves checked against torchvision in test_ops_exact.py), op by op, with each fast kernel's stated
tolerance; the array pipeline's resize and write."""

import numpy as np
import pytest
from PIL import Image
from test_ops_exact import VALUES
from tv_reference import psnr

from fusionflow.ops import exact, fast, pixel_kernels, resample
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy.op_specs import OP_NAMES, OPS
from fusionflow.tools.synthetic import make_image

VALUES = {**VALUES, "Cutout": [0.0, 40.0, 300.0]}
for _name in ("Brightness", "Color", "Contrast", "Sharpness"):  # to the schema's largest factor, 11
    VALUES[_name] = [*VALUES[_name], 3.0, 10.0]
# Fast kernels and what they may differ by from the exact op: "same" pixels; "level": at most one or
# two levels anywhere (they round where Pillow truncates); "geometry": pixels whose source lies on a
# sampling boundary take the neighbour, and bilinear weights round a level apart (at most 2% of
# pixels off by more than two levels, most of them on the fill border of a small image; PSNR >= 30 dB).
FAST_TOLERANCE = {name: "same" for name in OP_NAMES}
FAST_TOLERANCE.update(Brightness="level", Contrast="level", Color="level", Sharpness="level", AutoContrast="same")
# "hue": the fast Hue turns the hue in float without Pillow's 8-bit HSV round trip, which alone moves
# pixels by up to 5 levels: at most 8 levels anywhere, under half a level on average
FAST_TOLERANCE.update(Hue="hue")
FAST_TOLERANCE.update(
    ShearX="geometry",
    ShearY="geometry",
    Rotate="geometry",
    ShiftX="geometry",
    ShiftY="geometry",
    SkewX="geometry",
    SkewY="geometry",
)
STYLES = [exact.Style("nearest", (0, 0, 0)), exact.Style("bilinear", (128, 30, 200))]
IMAGES = [make_image(224, 224, 1), make_image(120, 200, 2), make_image(97, 61, 3)]
CASES = [(n, v) for n, vs in VALUES.items() for v in vs]


def _pair(name, value, arr, style, table):
    h, w = arr.shape[:2]
    params = OPS[name].resolve(value, (0.3, 0.7), h, w)
    want = np.asarray(exact.apply(name, Image.fromarray(arr), value, params, style))
    got = table[name](arr, value, params, style)
    assert got.dtype == np.uint8 and got.shape == arr.shape and got.flags.c_contiguous
    return got, want


def test_every_op_has_both_kernels():
    assert set(fast.EXACT) == set(OP_NAMES) == set(fast.FAST) == set(FAST_TOLERANCE)


@pytest.mark.parametrize("name,value", CASES)
@pytest.mark.parametrize("style", STYLES, ids=["nearest", "bilinear-fill"])
def test_exact_kernels_equal_pillow_to_the_bit(name, value, style):
    for arr in IMAGES:
        got, want = _pair(name, value, arr, style, fast.EXACT)
        np.testing.assert_array_equal(got, want)


@pytest.fixture(params=["native", "library"])
def kernels(request, monkeypatch):
    """The fast table with the native pixel kernels (fusionflow/kernels/pixel_ops.cc), and as it runs
    where they cannot be built (OpenCV's kernels)."""
    if request.param == "native":
        assert pixel_kernels.available(), pixel_kernels.why_unavailable()  # the CPU path is never skipped
    else:
        monkeypatch.setattr(pixel_kernels, "_LIB", None)
        monkeypatch.setattr(pixel_kernels, "_WHY_NOT", "turned off by the test")
    return request.param


@pytest.mark.parametrize("name,value", CASES)
@pytest.mark.parametrize("style", STYLES, ids=["nearest", "bilinear-fill"])
def test_fast_kernels_within_their_stated_tolerance(name, value, style, kernels):
    arr0 = IMAGES[0].copy()
    for arr in IMAGES:
        got, want = _pair(name, value, arr, style, fast.FAST)
        diff = np.abs(got.astype(int) - want)
        kind = FAST_TOLERANCE[name]
        if kind == "geometry" and style.interpolation == "nearest":
            kind = "same"  # Pillow's fixed-point walk, reproduced natively, else Pillow's own: host-independent
        if kind == "same":
            np.testing.assert_array_equal(got, want)
        elif kind == "level":
            assert diff.max() <= 2 and psnr(got, want) >= 40.0, (diff.max(), psnr(got, want))
        elif kind == "hue":
            assert diff.max() <= 8 and diff.mean() < 0.5, (diff.max(), diff.mean())
        else:
            moved = np.mean(diff.max(axis=2) > 2)  # bilinear weights may round a level apart anywhere
            assert moved <= 0.03 and psnr(got, want) >= 30.0, (moved, psnr(got, want))
    np.testing.assert_array_equal(IMAGES[0], arr0)  # kernels never write into their input


def test_translate_past_the_image_is_all_fill_and_solarize_thresholds():
    arr, style = IMAGES[1], exact.Style("nearest", (9, 8, 7))
    for v in (-200.0, 200.0, -119.0):
        params = OPS["TranslateX"].resolve(v, (0, 0), *arr.shape[:2])
        want = np.asarray(exact.apply("TranslateX", Image.fromarray(arr), v, params, style))
        np.testing.assert_array_equal(fast.FAST["TranslateX"](arr, v, params, style), want)
    assert (
        fast.FAST["TranslateX"](arr, 200.0, OPS["TranslateX"].resolve(200.0, (0, 0), 120, 200), style) == (9, 8, 7)
    ).all()
    for thr in (0.0, 0.5, 100.5, 255.0, 255.5, 256.0):
        params = OPS["Solarize"].resolve(thr, (0, 0), 120, 200)
        want = np.where(arr >= thr, 255 - arr, arr)
        np.testing.assert_array_equal(fast.FAST["Solarize"](arr, thr, params, style), want)


def test_blend_table_is_pillows_blend_for_every_level_and_factor():
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    img = Image.fromarray(np.stack([levels] * 3, -1))
    for degenerate in (0, 1, 77, 128, 254):
        for factor in (0.0, 0.1, 0.27, 0.5, 0.73, 1.0, 1.27, 1.9, 3.0, -0.3):
            want = np.asarray(Image.blend(Image.new("RGB", img.size, (degenerate,) * 3), img, factor))[..., 0]
            np.testing.assert_array_equal(exact.blend_lut(degenerate, factor)[levels], want)


def test_resize_window_per_scale_ratio_against_pillow():
    """Enlarging and up to 1.25x: OpenCV's bilinear (>= 38 dB against Pillow's antialiased filter on
    this image); beyond, Gaussian pre-blur + bilinear (>= 45 dB), also when one axis only shrinks."""
    src = make_image(600, 600, 5)
    for side, bound in ((150, 45.0), (224, 99.0), (250, 38.0), (280, 38.0), (300, 45.0), (440, 45.0), (445, 45.0)):
        win = np.ascontiguousarray(src[:side, 17 : 17 + side])
        if side == 445:  # tall and narrow: only the height is shrunk beyond 1.25x
            win = np.ascontiguousarray(src[:side, 17 : 17 + 200])
        want = np.asarray(Image.fromarray(win).resize((224, 224), Image.Resampling.BILINEAR, reducing_gap=None))
        got = resample.resize_window(win, 224, 224)
        assert got.shape == (224, 224, 3) and got.dtype == np.uint8
        assert psnr(got, want) >= min(bound, 98.0), (side, psnr(got, want))


def test_write_into_a_non_contiguous_or_float_slot():
    pipe = CpuPipeline("randaugment")
    arr = IMAGES[0]
    strided = np.zeros((3, 224, 448), np.uint8)[:, :, ::2]
    pipe._write_array(arr, strided)
    np.testing.assert_array_equal(strided, arr.transpose(2, 0, 1))
    ring = np.zeros((2, 3, 224, 224), np.uint8)
    pipe._write_array(arr, ring[1])
    np.testing.assert_array_equal(ring[1], arr.transpose(2, 0, 1))
    assert not ring[0].any()
