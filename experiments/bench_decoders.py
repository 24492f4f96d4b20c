"""Which decoder for the CPU workers: decode + RandomResizedCrop window + resize to 224, per core.

Every candidate produces the same thing -- the drawn crop window of a JPEG as a 224x224 RGB uint8
image -- on the same draws, one thread, interleaved repeats, medians:
  pillow_full        Pillow decodes the whole image, crop, Pillow resize (torchvision's path)
  pillow_draft       Pillow draft() DCT scaling of the whole image when the window is >= 2x the
                     output, Pillow resize from the fractional box (FusionFlow's previous fast mode)
  nvimgcodec_roi     nvImageCodec's CPU backend (libjpeg-turbo) decoding only the window
                     (CodeStream.get_sub_code_stream(region=...)), torch antialiased resize
  simplejpeg_scaled  simplejpeg: DCT-scaled decode of the whole image, slice, torch resize
  opencv_reduced     OpenCV IMREAD_REDUCED_COLOR_2/4/8 of the whole image, slice, cv2 INTER_AREA
  ff_window_exact    ours (fusionflow/kernels/jpeg_roi.cc, called through decode.decode_crop_resize):
                     window at full scale, Pillow resize
  ff_window_fast     ours: window at 1/2-1/8 DCT scale when it covers the output, else torch resize
Candidates whose library is not installed are skipped (simplejpeg and opencv-python-headless are
not FusionFlow dependencies; `pip install simplejpeg opencv-python-headless` to include them).

    .venv/bin/python -m experiments.bench_decoders [--images 150] [--repeats 5] [--sizes 200-1000]
"""

from __future__ import annotations

import argparse
import io
import sys

import numpy as np

from experiments.harness import interleaved_rates, provenance, result_path, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="200-1000", help="min-max side in px")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from PIL import Image

    from fusionflow import load_policy
    from fusionflow.ops import decode, jpeg, resample
    from fusionflow.policy import crop_window, draw
    from fusionflow.tools.synthetic import make_jpegs

    torch.set_num_threads(1)
    lo, hi = (int(v) for v in args.sizes.split("-"))
    data = make_jpegs(args.images, lo, hi, seed=21)
    policy = load_policy("default")
    out = 224
    jobs = []
    for i, d in enumerate(data):
        W, H = Image.open(io.BytesIO(d)).size
        jobs.append((d, H, W, crop_window(policy, draw(policy, 0, 0, i), H, W)))
    bilinear = Image.Resampling.BILINEAR

    def pillow_full():
        for d, H, W, (t, l, h, w) in jobs:
            Image.open(io.BytesIO(d)).convert("RGB").crop((l, t, l + w, t + h)).resize(
                (out, out), bilinear, reducing_gap=None
            )

    def pillow_draft():
        for d, H, W, win in jobs:
            img = Image.open(io.BytesIO(d))
            t, l, h, w = win
            r = decode.dct_reduction(h, w, out, out)
            box = (l, t, l + w, t + h)
            if r > 1:
                img.draft("RGB", (W // r, H // r))
                sx, sy = img.size[0] / W, img.size[1] / H
                box = (l * sx, t * sy, (l + w) * sx, (t + h) * sy)
            img.convert("RGB").resize((out, out), bilinear, box=box, reducing_gap=None)

    def ff(fast):
        def go():
            for d, H, W, win in jobs:
                decode.decode_crop_resize(d, lambda *_: win, (out, out), fast)

        return go

    candidates = {"pillow_full": pillow_full, "pillow_draft": pillow_draft}
    skipped = {}
    try:
        from nvidia import nvimgcodec as nv

        dec = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
        params = nv.DecodeParams(apply_exif_orientation=False)

        def nvimgcodec_roi():
            for d, H, W, (t, l, h, w) in jobs:
                cs = nv.CodeStream(d).get_sub_code_stream(region=nv.Region(t, l, t + h, l + w))
                arr = np.asarray(dec.decode(cs, params=params).cpu())
                resample.resize_antialiased(arr, out, out)

        candidates["nvimgcodec_roi"] = nvimgcodec_roi
    except Exception as exc:  # not installed, or no CPU backend in this build
        skipped["nvimgcodec_roi"] = repr(exc)
    try:
        import simplejpeg

        def simplejpeg_scaled():
            for d, H, W, (t, l, h, w) in jobs:
                r = decode.dct_reduction(h, w, out, out)
                arr = simplejpeg.decode_jpeg(d, colorspace="RGB", min_height=-(-H // r), min_width=-(-W // r))
                sy, sx = arr.shape[0] / H, arr.shape[1] / W
                win = arr[round(t * sy) : round((t + h) * sy), round(l * sx) : round((l + w) * sx)]
                resample.resize_antialiased(np.ascontiguousarray(win), out, out)

        candidates["simplejpeg_scaled"] = simplejpeg_scaled
    except ImportError as exc:
        skipped["simplejpeg_scaled"] = repr(exc)
    try:
        import cv2

        cv2.setNumThreads(1)
        flags = {
            1: cv2.IMREAD_COLOR,
            2: cv2.IMREAD_REDUCED_COLOR_2,
            4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8,
        }

        def opencv_reduced():
            for d, H, W, (t, l, h, w) in jobs:
                r = decode.dct_reduction(h, w, out, out)
                arr = cv2.imdecode(np.frombuffer(d, np.uint8), flags[r])
                sy, sx = arr.shape[0] / H, arr.shape[1] / W
                win = arr[round(t * sy) : round((t + h) * sy), round(l * sx) : round((l + w) * sx)]
                cv2.cvtColor(cv2.resize(win, (out, out), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)

        candidates["opencv_reduced"] = opencv_reduced
    except ImportError as exc:
        skipped["opencv_reduced"] = repr(exc)
    if jpeg.available():
        candidates["ff_window_exact"] = ff(False)
        candidates["ff_window_fast"] = ff(True)
    else:
        skipped["ff_window"] = jpeg.why_unavailable()

    times, rate = interleaved_rates(candidates, len(jobs), args.repeats)
    ratio = {n: v / rate["pillow_full"] for n, v in rate.items()}
    print(
        "img/s (decode + crop + resize to 224, 1 thread): "
        + ", ".join(f"{n} {rate[n]:.0f} ({ratio[n]:.2f}x)" for n in rate)
    )
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    import PIL

    versions = {"pillow": PIL.__version__, "torch": torch.__version__}
    for mod in ("simplejpeg", "cv2"):
        if mod in sys.modules:
            versions[mod] = sys.modules[mod].__version__
    write_json(
        {
            "benchmark": "decoders",
            "images": len(jobs),
            "repeats": args.repeats,
            "sizes": args.sizes,
            **provenance(),
            "versions": versions,
            "img_per_s_median": rate,
            "ratio_vs_pillow_full": ratio,
            "seconds_per_repeat": times,
            "skipped": skipped,
        },
        result_path(args.out, f"decoders_{args.sizes}.json"),
    )


if __name__ == "__main__":
    main()
