"""The whole CPU pipeline against torchvision's, and decoding of every input kind."""

import dataclasses
import io

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from tv_reference import psnr, tv_sample

from fusionflow import DecodeError, load_policy
from fusionflow.ops.decode import decode_crop_resize, open_image
from fusionflow.ops.decoded import to_rgb
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import crop_window, draw, shipped_policies
from fusionflow.tools.synthetic import encode, make_image, make_jpegs

JPEGS = make_jpegs(12, 200, 1000, seed=1)


@pytest.mark.parametrize("name", shipped_policies())
def test_exact_path_equals_torchvision_pipeline(name):
    policy = dataclasses.replace(load_policy(name), fast_downscale=False)
    pipe = CpuPipeline(policy)
    for i, data in enumerate(JPEGS):
        d = draw(policy, 5, 2, i)
        ours = pipe(data, i, seed=5, epoch=2)
        assert ours.dtype == np.uint8 and ours.shape == (3, 224, 224)
        if policy.center_resize is not None:  # eval: torchvision's Resize + CenterCrop itself
            tv = T.Compose([T.Resize(policy.center_resize), T.CenterCrop(list(policy.size)), T.PILToTensor()])
            ref = tv(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
            assert np.array_equal(ours, ref), f"{name} sample {i}"
            continue
        W, H = Image.open(io.BytesIO(data)).size
        ref = tv_sample(policy, data, d, crop_window(policy, d, H, W))
        assert np.array_equal(ours, ref), f"{name} sample {i}"


def test_fast_downscale_fidelity_and_use():
    exact = CpuPipeline(dataclasses.replace(load_policy("default"), fast_downscale=False))
    fast = CpuPipeline(load_policy("default"))
    reduced = 0
    for i, data in enumerate(make_jpegs(30, 600, 1000, seed=2)):
        d = draw(fast.policy, 0, 0, i)
        W, H = Image.open(io.BytesIO(data)).size
        _, _, h, w = crop_window(fast.policy, d, H, W)
        reduced += min(h, w) >= 448
        assert psnr(fast(data, i), exact(data, i)) > 30.0
    assert reduced >= 5  # the reduced-decode branch really ran


def _png(arr, mode=None):
    buf = io.BytesIO()
    (Image.fromarray(arr) if mode is None else Image.fromarray(arr).convert(mode)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["jpeg_rgb", "jpeg_gray", "png_rgb", "png_gray", "png_rgba", "png_la", "png_palette"])
def test_decode_to_rgb_matches_torchvision(kind):
    rgb = make_image(37, 53, 4)
    gray = rgb[:, :, 0].copy()
    data = {
        "jpeg_rgb": encode(rgb, "JPEG"),
        "jpeg_gray": encode(gray, "JPEG"),
        "png_rgb": _png(rgb),
        "png_gray": _png(gray),
        "png_rgba": _png(np.dstack([rgb, rgb[:, :, :1]])),
        "png_la": _png(np.dstack([gray, rgb[:, :, 1]]), "LA"),
        "png_palette": _png(rgb, "P"),
    }[kind]
    ours = np.asarray(to_rgb(open_image(data))).transpose(2, 0, 1)
    ref = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB).numpy()
    assert ours.shape == ref.shape == (3, 37, 53)
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1, kind


def test_sixteen_bit_png_and_array_and_pil_inputs():
    arr16 = np.arange(40 * 30, dtype=np.uint16).reshape(30, 40) * 50
    buf = io.BytesIO()
    Image.fromarray(arr16).save(buf, "PNG")
    img = to_rgb(open_image(buf.getvalue()))
    assert img.mode == "RGB" and np.array_equal(np.asarray(img)[:, :, 0], (arr16 >> 8).astype(np.uint8))
    for fmt in ("PPM", "TIFF"):  # the same 16-bit image in another container: the same pixels (a PGM opened as
        buf = io.BytesIO()  # Pillow's 32-bit "I" was clipped at 255, nearly white, until session 40)
        Image.fromarray(arr16).save(buf, fmt)
        assert np.array_equal(np.asarray(to_rgb(open_image(buf.getvalue()))), np.asarray(img)), fmt
    pipe = CpuPipeline("randaugment")
    rgb = make_image(300, 400, 9)
    from_bytes = pipe(encode(rgb, "PNG"), 3)
    assert np.array_equal(pipe(rgb, 3), from_bytes)
    assert np.array_equal(pipe(Image.fromarray(rgb), 3), from_bytes)
    assert pipe(rgb[:, :, 0], 3).shape == (3, 224, 224)
    with pytest.raises(TypeError, match="uint8 HW or HWC"):
        pipe(rgb.astype(np.float32), 3)
    with pytest.raises(TypeError, match="expected encoded bytes"):
        pipe(12345, 3)


@pytest.mark.parametrize("hw", [(1, 1), (3, 2000), (2000, 5), (16, 16)])
def test_any_image_size(hw):
    out = CpuPipeline("randaugment")(encode(make_image(*hw, seed=1), "PNG"), 0)
    assert out.shape == (3, 224, 224)


def test_corrupt_and_truncated_inputs_name_the_sample():
    pipe = CpuPipeline("default")
    with pytest.raises(DecodeError, match=r"sample 41: cannot identify an image in 64 bytes"):
        pipe(bytes(range(64)), 41)
    data = JPEGS[0]
    with pytest.raises(DecodeError, match=r"/data/x\.jpg: cannot decode JPEG"):
        pipe(data[: len(data) // 2], 0, what="/data/x.jpg")
    with pytest.raises(DecodeError, match="sample 3"):
        pipe(b"", 3)


def test_normalize_makes_float_output():
    cfg = {
        "output": {"size": [96, 128], "normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
        "flip": 0.5,
        "augment": {"type": "none"},
    }
    norm = CpuPipeline(cfg)
    raw = CpuPipeline({**cfg, "output": {"size": [96, 128]}})
    out, ref = norm(JPEGS[1], 4), raw(JPEGS[1], 4).astype(np.float32)
    mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
    assert out.dtype == np.float32 and out.shape == (3, 96, 128)
    np.testing.assert_allclose(out, (ref / 255 - mean) / std, rtol=1e-5, atol=1e-5)


def test_writes_into_given_buffer():
    pipe = CpuPipeline("randaugment")
    buf = np.zeros((4, 3, 224, 224), np.uint8)
    res = pipe(JPEGS[2], 9, out=buf[2])
    assert np.shares_memory(res, buf)
    assert np.array_equal(buf[2], pipe(JPEGS[2], 9)) and not buf[1].any()


def test_decode_crop_resize_window_is_honoured():
    rgb = make_image(100, 200, 2)
    img = decode_crop_resize(encode(rgb, "PNG"), lambda h, w: (10, 20, 50, 60), (50, 60), fast=True)
    assert np.array_equal(np.asarray(img), rgb[10:60, 20:80])


def test_importing_fusionflow_leaves_pillows_bomb_limit_alone():
    import subprocess
    import sys

    code = (
        "from PIL import Image; before = Image.MAX_IMAGE_PIXELS; import fusionflow.ops.pipeline, "
        "fusionflow.loader.front; assert Image.MAX_IMAGE_PIXELS == before, Image.MAX_IMAGE_PIXELS"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pixel_limit_refuses_a_bomb_before_decoding_on_every_cpu_path(monkeypatch):
    from fusionflow.errors import ImageTooLargeError
    from fusionflow.ops import jpeg
    from fusionflow.tools.synthetic import png_bomb

    bomb = png_bomb(30000, 30000)  # 900 megapixels in a few hundred bytes
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # the policy's default limit does the refusing
    with pytest.raises(
        ImageTooLargeError,
        match=r"sample 7: image of 30000x30000 = 900000000 pixels exceeds "
        r"the policy's decode\.max_pixels=178956970",
    ):
        CpuPipeline("default")(bomb, 7)
    small = {"output": {"size": 16}, "decode": {"max_pixels": 1000}, "augment": {"type": "none"}}
    rgb = make_image(30, 40, 1)  # 1200 pixels
    for data in (encode(rgb, "JPEG"), _png(rgb), Image.open(io.BytesIO(_png(rgb)))):
        with pytest.raises(ImageTooLargeError, match=r"/d/x: image of 40x30 = 1200 pixels exceeds"):
            CpuPipeline(small)(data, 0, what="/d/x")
    assert jpeg.available()  # so the JPEG above took the window decoder's header check
    CpuPipeline({**small, "decode": {"max_pixels": None}})(encode(rgb, "JPEG"), 0)  # null: no limit
    CpuPipeline({**small, "decode": {"max_pixels": 1200}})(_png(rgb), 0)  # at the limit: decoded
    CpuPipeline(small)(rgb, 0)  # arrays are already decoded: not checked


def test_pillows_own_bomb_check_neither_warns_nor_overrides_the_policy(monkeypatch):
    import warnings

    from fusionflow.errors import ImageTooLargeError

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the user's process-wide Pillow limit
    rgb = make_image(30, 40, 1)  # 1200 pixels: over Pillow's warning limit, under its error limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CpuPipeline("default")(_png(rgb), 0)  # the policy allows it: no DecompressionBombWarning
    big = _png(make_image(50, 50, 1))  # 2500 > 2 x 1000: Pillow refuses it before we see its size
    with pytest.raises(ImageTooLargeError, match=r"sample 2: Pillow refused the image.*raise it"):
        CpuPipeline("default")(big, 2)
    small = {"output": {"size": 16}, "decode": {"max_pixels": 2000}, "augment": {"type": "none"}}
    with pytest.raises(ImageTooLargeError, match=r"sample 2: image of 2500 pixels exceeds the policy's"):
        CpuPipeline(small)(big, 2)


def test_tensor_samples_give_the_same_pixels_as_the_equivalent_array():
    pipe = CpuPipeline("randaugment")
    rgb = make_image(37, 53, 4)
    ref = pipe(rgb, 3, seed=1)
    chw = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
    for t in (chw, torch.from_numpy(rgb), torch.from_numpy(rgb).permute(2, 0, 1)):  # CHW, HWC, non-contiguous CHW
        assert np.array_equal(pipe(t, 3, seed=1), ref)
    png = decode_image(torch.frombuffer(bytearray(_png(rgb)), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)
    assert tuple(png.shape) == (3, 37, 53) and np.array_equal(pipe(png, 3, seed=1), ref)  # torchvision.io's CHW
    gray = rgb[:, :, 0].copy()
    ref = pipe(gray, 3, seed=1)
    for t in (torch.from_numpy(gray), torch.from_numpy(gray)[None], torch.from_numpy(gray)[:, :, None]):
        assert np.array_equal(pipe(t, 3, seed=1), ref)  # HW, 1HW, HW1


def test_tensor_layout_rule_and_errors():
    from fusionflow.ops.decode import open_image

    t = torch.arange(36, dtype=torch.uint8).reshape(3, 3, 4)  # ambiguous: first dim 3 -> CHW (3 tall, 4 wide)
    assert open_image(t).size == (4, 3)
    assert np.array_equal(np.asarray(open_image(t)), t.permute(1, 2, 0).numpy())
    assert open_image(torch.zeros(5, 7, 4, dtype=torch.uint8)).size == (7, 5)  # 5 is no channel count: HWC
    with pytest.raises(TypeError, match=r"sample 2: a tensor sample must be uint8 HW, CHW or HWC .* torch\.float32"):
        CpuPipeline("default")(torch.zeros(3, 8, 8), 2)
    with pytest.raises(TypeError, match=r"got torch\.uint8 \(5, 6, 7\)"):
        open_image(torch.zeros(5, 6, 7, dtype=torch.uint8), "sample 2")
    encoded = np.frombuffer(make_jpegs(1, 20, 21)[0], np.uint8)  # a file's bytes as torchvision.io.read_file has them
    for flat in (torch.from_numpy(encoded.copy()), encoded):
        with pytest.raises(TypeError, match=r"holds an encoded file .* return its bytes: bytes\(x\.numpy\(\)\)"):
            open_image(flat, "sample 2")


@pytest.mark.parametrize(
    "sample",
    [np.zeros((0, 0, 3), np.uint8), np.zeros((0, 10), np.uint8), torch.zeros(3, 0, 4, dtype=torch.uint8), "pil"],
    ids=["array", "array-hw", "tensor", "pil"],
)
def test_an_empty_image_is_named_not_a_division_by_zero(sample):
    """A sample with no pixels (a dataset's bug: an empty crop) failed with ZeroDivisionError in the crop's window."""
    from PIL import Image

    sample = Image.new("RGB", (0, 5)) if isinstance(sample, str) else sample
    with pytest.raises(ValueError, match=r"sample 4: an empty image \(\d+x\d+ pixels\)"):
        CpuPipeline("default")(sample, 4)
