"""CPU ops against torchvision.transforms.v2's functional ops on the same PIL input."""

import math

import numpy as np
import pytest
from PIL import Image
from tv_reference import tv_op

# VALUES: op -> values to test at, in the op's unit (experiments/dali_agreement.py: the GPU agreement
# check and the DALI tests use the same table)
from experiments.dali_agreement import VALUES
from fusionflow.ops import exact
from fusionflow.policy.op_specs import OP_NAMES, OPS, inverse_affine

# Per-op tolerance on max |difference|: every op here reproduces torchvision's PIL path exactly.
TOLERANCE = {name: 0 for name in VALUES}
# but ShiftX/Y and SkewX/Y, timm's translation and shear (exact against timm in tests/test_timm.py):
# torchvision's affine goes through the centre and the shear angle, an ulp away from timm's matrix --
# one level on rare bilinear pixels
TOLERANCE.update(ShiftX=1, ShiftY=1, SkewX=1, SkewY=1)

CASES = [(n, v) for n, vs in VALUES.items() for v in vs]


def run(name, img, value, style):
    h, w = img.size[1], img.size[0]
    return exact.apply(name, img, value, OPS[name].resolve(value, (0.5, 0.5), h, w), style)


@pytest.mark.parametrize("name,value", CASES)
@pytest.mark.parametrize("fill,interp", [((0, 0, 0), "nearest"), ((128, 64, 32), "bilinear")])
def test_op_matches_torchvision(image224, name, value, fill, interp):
    img = Image.fromarray(image224)
    ours = np.asarray(run(name, img, value, exact.Style(interp, fill))).astype(int)
    ref = np.asarray(tv_op(name, img, value, fill, interp)).astype(int)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOLERANCE[name], f"{name}({value}) differs from torchvision"


def test_ops_on_non_square_image():
    img = Image.fromarray(
        np.ascontiguousarray(__import__("fusionflow.tools.synthetic", fromlist=["x"]).make_image(160, 240, 3))
    )
    for name, value in [("ShearX", 0.3), ("TranslateY", -40.0), ("Rotate", 25.0), ("Sharpness", 0.5)]:
        ours = np.asarray(run(name, img, value, exact.Style()))
        assert np.array_equal(ours, np.asarray(tv_op(name, img, value))), name


@pytest.mark.parametrize("side,aux", [(80, (0.5, 0.5)), (40, (0.0, 0.99)), (224, (0.3, 0.7)), (0, (0.5, 0.5))])
def test_cutout_matches_erase(image224, side, aux):
    img = Image.fromarray(image224)
    fill = (128, 128, 128)
    ours = exact.apply("Cutout", img, side, OPS["Cutout"].resolve(side, aux, 224, 224), exact.Style(fill=fill))
    assert np.array_equal(np.asarray(ours), np.asarray(tv_op("Cutout", img, side, fill, aux=aux)))


def test_every_op_has_a_cpu_impl_and_a_test():
    assert set(exact.CPU_IMPLS) == set(OP_NAMES)
    # Cutout: against torchvision's erase above; GaussianBlur (Pillow's radius, timm's 3a): against timm's own
    # op in tests/test_timm.py (torchvision has no Pillow blur)
    assert set(VALUES) | {"Cutout", "GaussianBlur"} == set(OP_NAMES)


def test_inverse_affine_inverts_forward_map():
    # point p mapped forward by translate/rotate/shear about a centre, then back by our inverse
    center, angle, translate, shear = (30.0, 40.0), 25.0, (5.0, -3.0), (10.0, -7.0)
    a, b, c, d, e, f = inverse_affine(center, angle, translate, shear)
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    R = np.array([[math.cos(rot), -math.sin(rot)], [math.sin(rot), math.cos(rot)]])
    shx = np.array([[1, -math.tan(sx)], [0, 1]])
    shy = np.array([[1, 0], [-math.tan(sy), 1]])
    M = R @ shy @ shx
    p = np.array([12.0, 77.0])
    q = M @ (p - center) + center + translate
    back = np.array([a * q[0] + b * q[1] + c, d * q[0] + e * q[1] + f])
    assert np.allclose(back, p)


@pytest.mark.parametrize("name", ["AutoContrast", "Equalize", "Invert", "Posterize", "Solarize", "SolarizeAdd"])
def test_point_ops_on_degenerate_histograms(name):
    """The LUT ops rebuild Pillow's tables with numpy: check the corners of its loops (a constant band,
    two values, a narrow range, one pixel off, all 256 values) against torchvision's PIL path."""
    rng = np.random.default_rng(3)
    bands = {
        "constant": np.full((31, 47), 77, np.uint8),
        "two_values": np.where(rng.random((31, 47)) < 0.5, 10, 200).astype(np.uint8),
        "narrow": rng.integers(120, 124, (31, 47)).astype(np.uint8),
        "one_off": np.pad(np.full((30, 47), 5, np.uint8), ((0, 1), (0, 0)), constant_values=250),
        "full": (np.arange(31 * 47) % 256).astype(np.uint8).reshape(31, 47),
    }
    keys = list(bands)
    for k in range(len(keys)):
        arr = np.stack([bands[keys[k]], bands[keys[(k + 1) % 5]], bands[keys[(k + 2) % 5]]], axis=2)
        img = Image.fromarray(arr)
        for value in VALUES[name]:
            ours = np.asarray(run(name, img, value, exact.Style()))
            assert np.array_equal(ours, np.asarray(tv_op(name, img, value))), (name, value, keys[k])


@pytest.mark.parametrize("hw", [(224, 224), (3, 3), (2, 9), (5, 7), (61, 40)])
def test_vectorised_smooth_equals_pillows_filter(hw):
    """Sharpness's blur is re-implemented with numpy (Pillow's filter is per pixel); it must stay
    Pillow's SMOOTH filter bit for bit, borders and tiny images included."""
    from PIL import ImageFilter

    rng = np.random.default_rng(hw[0] * 1000 + hw[1])
    for arr in (
        rng.integers(0, 256, hw + (3,)).astype(np.uint8),
        __import__("fusionflow.tools.synthetic", fromlist=["x"]).make_image(*hw, seed=hw[1]),
        np.full(hw + (3,), 255, np.uint8),
    ):
        img = Image.fromarray(arr)
        assert np.array_equal(np.asarray(exact.smooth(img)), np.asarray(img.filter(ImageFilter.SMOOTH)))


def test_point_fast_path_equals_public_point(image224):
    img = Image.fromarray(image224)
    lut = [(i * 7) % 256 for i in range(256)] * 3
    out = exact._point(img, lut)
    assert out.mode == "RGB" and np.array_equal(np.asarray(out), np.asarray(img.point(lut)))
