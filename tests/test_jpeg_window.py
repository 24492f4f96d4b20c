"""The JPEG window decoder (fusionflow/kernels/jpeg_roi.cc via fusionflow.ops.jpeg) against Pillow's
full decode, and the fast decode mode against the exact one."""

import dataclasses
import io
import logging

import numpy as np
import pytest
from PIL import Image
from tv_reference import psnr, tv_sample

from fusionflow import DecodeError, load_policy
from fusionflow.ops import decode, jpeg
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.policy import crop_window, draw, shipped_policies
from fusionflow.tools.synthetic import make_image, make_jpegs

pytestmark = pytest.mark.skipif(not jpeg.available(), reason=f"window decoder: {jpeg.why_unavailable()}")


def _jpeg(arr, subsampling=2, progressive=False, mode=None, **kw) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    (img.convert(mode) if mode else img).save(
        buf, "JPEG", quality=90, subsampling=subsampling, progressive=progressive, **kw
    )
    return buf.getvalue()


def _pillow_scaled(data, denom):
    img = Image.open(io.BytesIO(data))
    if denom > 1:
        img.draft("RGB", (img.size[0] // denom, img.size[1] // denom))
    return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("subsampling", [0, 1, 2])  # 4:4:4, 4:2:2, 4:2:0
@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("denom", [1, 2, 4, 8])
def test_window_equals_pillows_full_decode(subsampling, progressive, denom):
    rng = np.random.default_rng(subsampling * 10 + progressive * 100 + denom)
    data = _jpeg(make_image(333, 517, seed=denom), subsampling, progressive)
    full = _pillow_scaled(data, denom)
    H, W = full.shape[:2]
    assert (H, W) == (-(-333 // denom), -(-517 // denom))
    windows = [(0, 0, H, W), (0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, W - 7, H, 7), (5, 16, 9, 16)]
    for _ in range(25):
        h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
        windows.append((int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w))
    for top, left, h, w in windows:
        arr, scaled = jpeg.decode_window(data, top, left, h, w, (1, denom))
        assert scaled == (H, W)
        assert np.array_equal(arr, full[top : top + h, left : left + w]), (top, left, h, w)


def test_grayscale_becomes_rgb_like_pillow():
    data = _jpeg(make_image(120, 90, seed=2)[:, :, 0])
    arr, _ = jpeg.decode_window(data, 10, 20, 50, 60)
    assert np.array_equal(arr, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[10:60, 20:80])


def test_exif_orientation_is_ignored_like_pillow_and_torchvision():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display: neither Pillow's decode nor torchvision's applies it
    data = _jpeg(make_image(64, 96, seed=3), exif=exif.tobytes())
    arr, scaled = jpeg.decode_window(data, 0, 0, 64, 96)
    assert scaled == (64, 96)
    assert np.array_equal(arr, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_cmyk_and_truncated_jpegs_go_to_pillow():
    cmyk = _jpeg(make_image(80, 80, seed=4), mode="CMYK")
    with pytest.raises(jpeg.WindowDecodeError, match="CMYK"):
        jpeg.decode_window(cmyk, 0, 0, 80, 80)
    policy = dataclasses.replace(load_policy("default"), fast_downscale=False)
    d = draw(policy, 0, 0, 7)
    ref = tv_sample(policy, cmyk, d, crop_window(policy, d, 80, 80))
    assert np.array_equal(CpuPipeline(policy)(cmyk, 7), ref)  # Pillow's CMYK -> RGB, as torchvision
    good = make_jpegs(1, 300, 300, seed=9)[0]
    assert jpeg.is_complete_jpeg(good) and not jpeg.is_complete_jpeg(good[:-100])
    with pytest.raises(DecodeError, match=r"sample 3: cannot decode JPEG"):
        CpuPipeline("randaugment")(good[:-100], 3)
    big = make_jpegs(1, 1200, 1600, seed=5)[0]
    size = "x".join(map(str, Image.open(io.BytesIO(big)).size))
    for policy in ("eval", "randaugment"):  # decoded at a DCT scale: the error named the scaled size (381x367)
        with pytest.raises(DecodeError, match=rf"sample 4: cannot decode JPEG {size}: image file is truncated"):
            CpuPipeline(policy)(big[: len(big) // 3], 4)


@pytest.mark.skipif(not jpeg.can_scale(), reason="the native decoder (info_many) is not built: nvImageCodec only")
def test_headers_read_together_equal_pillows_sizes_and_refuse_what_is_not_a_complete_jpeg():
    """`info_many` reads a run's headers in one call: Pillow's (height, width) for every complete JPEG (baseline,
    progressive, grayscale, trailing padding), (0, 0) for what is not one -- truncated, a PNG, junk, a stray SOI --
    and for a CMYK one (since session 40: the accelerator's screen, whose DALI decoded one black), without losing
    the images after it."""
    good = make_jpegs(6, 20, 900, seed=5)
    progressive = _jpeg(make_image(61, 37, seed=1), progressive=True)
    gray = _jpeg(make_image(30, 50, seed=2)[..., 0])
    cmyk = _jpeg(make_image(44, 28, seed=4), mode="CMYK")
    png = io.BytesIO()
    Image.fromarray(make_image(10, 12, seed=3)).save(png, "PNG")
    items = [good[0], good[1][:-100], progressive, png.getvalue(), gray, b"junk", b"\xff\xd8\xff\xd9"]
    items += [cmyk, good[2] + b"\0\r\n ", good[3][:30] + good[3][-2:], *good[4:]]
    hw = jpeg.info_many(items)
    assert hw.shape == (len(items), 2)
    for item, (h, w) in zip(items, hw.tolist()):
        if jpeg.is_complete_jpeg(item) and (h, w) != (0, 0):
            assert (w, h) == Image.open(io.BytesIO(item)).size
    refused = [k for k, z in enumerate(hw.tolist()) if z == [0, 0]]
    assert refused == [1, 3, 5, 6, 7, 9]  # truncated, PNG, junk, SOI+EOI only, CMYK, a header cut short
    assert jpeg.info_many([]).shape == (0, 2)


@pytest.mark.parametrize("crop", ["bilinear", "bicubic", "centre"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_a_jpeg_header_the_window_decoder_cannot_read_is_reported_as_pillow_reports_it(crop, fast, monkeypatch):
    """SOI ... EOI with garbage between: every decode path (window, filtered, centre box) hands it to
    Pillow, whose DecodeError names the sample, as on a host without the window decoder."""
    spec = {"output": {"size": 32}, "augment": {"type": "none"}, "crop": {"interpolation": crop}}
    policy = load_policy("eval", size=32) if crop == "centre" else load_policy(spec)
    policy = dataclasses.replace(policy, fast_downscale=fast)
    pipe = CpuPipeline(policy)
    corrupt = b"\xff\xd8" + b"\x00garbage" * 50 + b"\xff\xd9"

    def outcome():
        with pytest.raises(DecodeError) as got:
            pipe(corrupt, 0, what="sample 7")
        return str(got.value)

    with_window = outcome()
    monkeypatch.setattr(decode.jpeg, "available", lambda: False)
    assert "sample 7" in with_window and with_window == outcome()


@pytest.mark.parametrize("damage", ["stray_marker", "flipped_bits"])
def test_corrupt_entropy_data_gives_what_pillow_gives(damage, monkeypatch):
    """A stream libjpeg only warns about is handed to Pillow: the result (pixels, or the error naming
    the sample) equals the Pillow-only path's. A stray marker: Pillow decodes it (grey below);
    flipped bits: Pillow raises."""
    good = make_jpegs(1, 400, 400, seed=5)[0]
    sos = good.index(b"\xff\xda")
    if damage == "stray_marker":
        bad = good[: sos + 600] + b"\xff\xd0" + good[sos + 600 :]
    else:
        bad = bytes(b ^ 0x5A if sos + 40 <= k < sos + 2000 and (k - sos) % 7 == 0 else b for k, b in enumerate(good))
    with pytest.raises(jpeg.WindowDecodeError, match="corrupt"):
        jpeg.decode_window(bad, 300, 0, 100, 400)  # rows above are entropy-decoded: the damage is seen
    pipe = CpuPipeline(dataclasses.replace(load_policy("default"), fast_downscale=False))

    def outcome():
        try:
            return pipe(bad, 0)
        except DecodeError as exc:
            return str(exc)

    with_window = outcome()
    monkeypatch.setattr(decode.jpeg, "available", lambda: False)
    without = outcome()
    assert type(with_window) is type(without)
    assert (with_window == without) if isinstance(without, str) else np.array_equal(with_window, without)


def test_fast_mode_keeps_each_samples_draw(monkeypatch):
    """Fast and exact resolve the same crop window from the same draw; only resampling differs."""
    seen = {True: [], False: []}

    def spy(real, fast):  # the exact path's Pillow-image decode, the fast path's array decode
        def run(data, window_fn, out_size, *rest):
            def recording(h, w):
                win = window_fn(h, w)
                seen[fast].append(win)
                return win

            return real(data, recording, out_size, *rest)

        return run

    monkeypatch.setattr(decode, "_jpeg_window_crop_resize", spy(decode._jpeg_window_crop_resize, False))
    monkeypatch.setattr(decode, "decode_fast_window", spy(decode.decode_fast_window, True))
    policy = load_policy("randaugment")
    fast, exact = CpuPipeline(policy), CpuPipeline(dataclasses.replace(policy, fast_downscale=False))
    for i, data in enumerate(make_jpegs(8, 200, 900, seed=6)):
        fast(data, i, seed=1, epoch=2)
        exact(data, i, seed=1, epoch=2)
    assert seen[True] == seen[False] and len(seen[True]) == 8


# Documented fidelity of the fast mode against the exact mode (README, "CPU pipeline, per core"):
# crop + flip only: every sample >= 30 dB; with a policy's ops, median >= 38 dB and at least 75% of
# samples >= 30 dB (Equalize, AutoContrast, Posterize and Solarize amplify one-level differences:
# a flipped threshold moves whole regions by many levels; AutoAugment, rich in them, has the lowest
# median: 39-40 dB since windows of 1.25-2x the output are pre-blurred and resized bilinearly).
@pytest.mark.parametrize("name", shipped_policies())
def test_fast_mode_within_documented_tolerance(name, monkeypatch):
    scales = []
    real = jpeg.decode_window
    monkeypatch.setattr(
        jpeg, "decode_window", lambda *a, **k: scales.append(a[5] if len(a) > 5 else (1, 1)) or real(*a, **k)
    )
    policy = load_policy(name)
    assert policy.decode_mode == "fast"
    fast, exact = CpuPipeline(policy), CpuPipeline(dataclasses.replace(policy, fast_downscale=False))
    crop_only = dataclasses.replace(policy, augment=dataclasses.replace(policy.augment, type="none"))
    fast_crop, exact_crop = CpuPipeline(crop_only), CpuPipeline(dataclasses.replace(crop_only, fast_downscale=False))
    with_ops, crop = [], []
    for i, data in enumerate(make_jpegs(24, 300, 1400, seed=8)):
        with_ops.append(psnr(fast(data, i), exact(data, i)))
        crop.append(psnr(fast_crop(data, i), exact_crop(data, i)))
    assert min(crop) >= 30.0, sorted(crop)[:3]
    assert np.median(with_ops) >= 38.0 and np.mean(np.asarray(with_ops) >= 30.0) >= 0.75, sorted(with_ops)[:5]
    if policy.crop_interpolation == "bilinear":  # bicubic crops (deepaa) resample the full-scale window
        assert any(s != (1, 1) for s in scales)  # the DCT-scaled branch really ran


def test_unavailable_decoder_logs_why_and_pillow_decodes(monkeypatch, tmp_path, caplog):
    from fusionflow import native

    monkeypatch.setattr(native, "KERNELS", tmp_path / "nowhere")
    monkeypatch.setattr(jpeg, "_LIB", None)
    monkeypatch.setattr(jpeg, "_WHY_NOT", None)
    monkeypatch.setattr(jpeg, "_NV", False)  # and no nvImageCodec either
    with caplog.at_level(logging.WARNING, logger="fusionflow.ops.jpeg"):
        assert not jpeg.available() and jpeg.backend() is None
    assert "window decoder is unavailable (native sources not found" in caplog.text
    assert "decoding whole images with Pillow" in caplog.text and "libjpeg-turbo8-dev" in caplog.text
    policy = dataclasses.replace(load_policy("randaugment"), fast_downscale=False)
    data = make_jpegs(1, 300, 500, seed=3)[0]
    d = draw(policy, 0, 0, 2)
    W, H = Image.open(io.BytesIO(data)).size
    assert np.array_equal(CpuPipeline(policy)(data, 2), tv_sample(policy, data, d, crop_window(policy, d, H, W)))


@pytest.fixture
def nvimgcodec_only(monkeypatch):
    """As on a machine where the native decoder cannot be built (no compiler or no jpeglib.h)."""
    monkeypatch.setattr(jpeg, "_LIB", None)
    monkeypatch.setattr(jpeg, "_WHY_NOT", "simulated: no jpeglib.h")
    if jpeg._nvimgcodec() is None:
        pytest.skip("nvImageCodec's CPU decoder is not installed")
    assert jpeg.backend() == "nvImageCodec CPU" and not jpeg.can_scale()


def test_nvimgcodec_fallback_windows_equal_pillows_full_decode(nvimgcodec_only):
    rng = np.random.default_rng(12)
    for sub in (0, 1, 2):
        data = _jpeg(make_image(301, 455, seed=sub), sub, progressive=bool(sub % 2))
        full = _pillow_scaled(data, 1)
        for _ in range(15):
            h, w = int(rng.integers(1, 302)), int(rng.integers(1, 456))
            top, left = int(rng.integers(0, 302 - h)), int(rng.integers(0, 456 - w))
            arr, scaled = jpeg.decode_window(data, top, left, h, w)
            assert scaled == (301, 455) and np.array_equal(arr, full[top : top + h, left : left + w])
    with pytest.raises(jpeg.WindowDecodeError, match="full scale only"):
        jpeg.decode_window(data, 0, 0, 10, 10, (1, 2))


def test_nvimgcodec_fallback_keeps_exact_mode_and_errors(nvimgcodec_only):
    policy = dataclasses.replace(load_policy("randaugment"), fast_downscale=False)
    pipe = CpuPipeline(policy)
    for i, data in enumerate(make_jpegs(6, 200, 900, seed=13)):
        d = draw(policy, 1, 0, i)
        W, H = Image.open(io.BytesIO(data)).size
        assert np.array_equal(pipe(data, i, seed=1), tv_sample(policy, data, d, crop_window(policy, d, H, W)))
    fast = CpuPipeline(load_policy("randaugment"))  # windows >= 2x the output take Pillow's draft path
    assert fast(make_jpegs(1, 1400, 1400, seed=2)[0], 0).shape == (3, 224, 224)
    good = make_jpegs(1, 300, 300, seed=9)[0]
    cmyk = _jpeg(make_image(80, 80, seed=4), mode="CMYK")
    d = draw(policy, 0, 0, 7)
    assert np.array_equal(CpuPipeline(policy)(cmyk, 7), tv_sample(policy, cmyk, d, crop_window(policy, d, 80, 80)))
    with pytest.raises(DecodeError, match=r"sample 3: cannot decode JPEG"):
        pipe(good[:-100], 3)


def test_pillow_draft_fallback_reduces_by_the_intended_factor(monkeypatch):
    """Without a window decoder, fast mode asks Pillow's draft() for the DCT reduction the window allows:
    a 1001-px image whose window covers 4x the output must be decoded at 1/4 (ceil-sized requests used to
    make draft() pick 1/2)."""
    from PIL import JpegImagePlugin

    monkeypatch.setattr(decode.jpeg, "available", lambda: False)
    sizes = []
    real = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        out = real(self, mode, size)
        sizes.append(self.size)
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    data = _jpeg(make_image(1001, 1003, seed=1))
    decode.decode_crop_resize(data, lambda h, w: (0, 0, h, w), (224, 224), fast=True)
    assert sizes == [(251, 251)]  # ceil(1003 / 4), ceil(1001 / 4)


@pytest.mark.parametrize("host", ["nvimgcodec", "pillow", "no-pixel-kernels"])
@pytest.mark.parametrize("policy", ["randaugment", "deepaa", "eval"])
def test_fast_mode_pixels_do_not_depend_on_the_hosts_decoder(host, policy, monkeypatch):
    """A sample's pixels are a pure function of (seed, epoch, index, copy) wherever it runs, fast mode included:
    a host whose native decoder or pixel kernels could not be built (nvImageCodec's decoder, which cannot
    scale; Pillow alone; OpenCV's kernels) gives the native host's pixels, bit for bit -- the bilinear crop
    (randaugment), the bicubic one (deepaa) and evaluation's box resize, at every DCT scale, for grayscale,
    progressive, 4:4:4, CMYK and multi-picture (MPO) JPEGs and windows far wider than tall."""
    from fusionflow.ops import pixel_kernels

    assert jpeg.can_scale() and pixel_kernels.available()  # the native host: the CPU path is never skipped
    images = [*make_jpegs(6, 200, 1400, seed=21), _jpeg(make_image(900, 1300, seed=7))]
    images += [_jpeg(make_image(700, 260, seed=5), 0, progressive=True), _jpeg(make_image(64, 1500, seed=6))]
    images += [_jpeg(make_image(500, 600, seed=8), mode="L"), _jpeg(make_image(300, 400, seed=9), mode="CMYK")]
    mpo = io.BytesIO()
    second = Image.fromarray(make_image(200, 250, seed=11))
    Image.fromarray(make_image(800, 1000, seed=10)).save(mpo, "MPO", save_all=True, append_images=[second])
    images.append(mpo.getvalue())
    assert Image.open(io.BytesIO(images[-1])).format == "MPO"
    loaded = load_policy(policy)
    assert loaded.decode_mode == "fast"
    pipe = CpuPipeline(loaded)
    native = [pipe(data, i, seed=3, epoch=1) for i, data in enumerate(images)]
    if host == "no-pixel-kernels":
        monkeypatch.setattr(pixel_kernels, "_LIB", None)
        monkeypatch.setattr(pixel_kernels, "_WHY_NOT", "turned off by the test")
    else:
        monkeypatch.setattr(jpeg, "_LIB", None)
        monkeypatch.setattr(jpeg, "_WHY_NOT", "simulated: no jpeglib.h")
        if host == "pillow":
            monkeypatch.setattr(jpeg, "_NV", False)
        elif jpeg._nvimgcodec() is None:
            pytest.skip("nvImageCodec's CPU decoder is not installed")
    for i, data in enumerate(images):
        np.testing.assert_array_equal(pipe(data, i, seed=3, epoch=1), native[i], err_msg=f"image {i} on {host}")
