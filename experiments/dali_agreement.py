"""FusionFlow's DALI ops against its CPU ops on identical input: the cases, the two runners, and the
per-op difference statistics. One place for what tests/test_ops_dali.py asserts (with its per-op
tolerances) and what experiments/gpu_bench.py reports on a GPU (`agreement`). And the GPU's JPEG
decoder against libjpeg-turbo (`nvjpeg_gap`, experiments/gpu_run.sh diag).

DALI is imported only when an op runs, so this module imports on machines without it.
"""

from __future__ import annotations

import numpy as np

from fusionflow.policy.op_specs import OPS
from fusionflow.tools.synthetic import make_image

# Op values each op runs at: the ends of its range, a few inside, and the values where rounding or a
# sign changes (the same values as the CPU ops' tests against torchvision)
VALUES = {
    "Identity": [0.0],
    "ShearX": [-0.99, -0.3, 0.09, 0.3],
    "ShearY": [-0.3, 0.09, 0.5, 0.99],
    "TranslateX": [-101.5, -30.4, 7.0, 32.0],
    "TranslateY": [-32.0, 30.45, 101.5],
    "ShiftX": [-100.8, -0.5, 22.4, 67.2],
    "ShiftY": [-67.2, 0.25, 33.6],
    "SkewX": [-0.3, 0.09, 0.45],
    "SkewY": [-0.45, 0.27],
    "Rotate": [-135.0, -30.0, 9.0, 90.0, 180.0],
    "Brightness": [-0.9, -0.27, 0.27, 0.99],
    "Color": [-0.9, -0.27, 0.27, 0.99],
    "Contrast": [-0.9, -0.27, 0.27, 0.99],
    "Sharpness": [-0.9, -0.27, 0.27, 0.99],
    "Posterize": [0.0, 2.0, 4.0, 7.0, 8.0],
    "Solarize": [0.0, 76.5, 178.5, 255.0, 256.0],
    "SolarizeAdd": [0.0, 33.0, 110.0],
    "AutoContrast": [0.0],
    "Equalize": [0.0],
    "Invert": [0.0],
    "FlipX": [0.0],
    "Hue": [-0.5, -0.27, -0.001, 0.0, 0.004, 0.1, 0.5],
}
# (op, value) of every op with a DALI implementation, and the cutout at two sizes
CASES = [(n, v) for n, vs in VALUES.items() for v in vs if n != "Identity" and OPS[n].dali]
CASES += [("Cutout", 40.0), ("Cutout", 80.0)]
IMAGES = [make_image(224, 224, s) for s in range(4)]
AUX = (0.3, 0.6)  # the per-sample uniforms an op's parameters may take (e.g. the cutout's centre)


def run_dali_op(name: str, value: float, style, images=IMAGES) -> np.ndarray:
    """Op `name` at `value` on `images` through FusionFlow's DALI implementation (`style`: a
    DaliStyle; device "cpu" or "gpu"): the outputs stacked, uint8 NHWC."""
    from nvidia.dali import fn, pipeline_def, types

    from fusionflow.accel.dali_ops import DALI_IMPLS

    params = [np.asarray(OPS[name].resolve(value, AUX, 224, 224), np.float32)] * len(images)

    @pipeline_def(batch_size=len(images), num_threads=1, device_id=None if style.device == "cpu" else 0)
    def graph():
        im = fn.external_source(name="im", dtype=types.UINT8, ndim=3, layout="HWC")
        pr = fn.external_source(name="pr", dtype=types.FLOAT, ndim=1)
        if style.device == "gpu":
            im = im.gpu()
        return DALI_IMPLS[name](im, pr, style), pr  # pr as an output so it is never pruned

    pipe = graph()
    pipe.build()
    pipe.feed_input("im", images)
    pipe.feed_input("pr", params)
    out, _ = pipe.run()
    if style.device == "gpu":
        out = out.as_cpu()
    return np.stack([np.array(out[i]) for i in range(len(images))])


def run_cpu_op(name: str, value: float, style, images=IMAGES) -> np.ndarray:
    """The same op through the CPU's exact implementation (Pillow), with the interpolation and fill
    of `style`: the outputs stacked, uint8 NHWC."""
    from PIL import Image

    from fusionflow.ops import exact

    params = OPS[name].resolve(value, AUX, 224, 224)
    cpu_style = exact.Style(style.interpolation, style.fill)
    return np.stack([np.asarray(exact.apply(name, Image.fromarray(im), value, params, cpu_style)) for im in images])


def agreement(device: str = "gpu") -> dict:
    """Per case, DALI on `device` against the CPU op: {"Op(value)": {max, mean, differing}} of the
    absolute difference in levels (`differing`: the fraction of values that differ at all)."""
    from fusionflow.accel.dali_ops import DaliStyle

    out = {}
    for name, value in CASES:
        a = run_dali_op(name, value, DaliStyle(device=device)).astype(int)
        b = run_cpu_op(name, value, DaliStyle()).astype(int)
        d = np.abs(a - b)
        out[f"{name}({value})"] = {"max": int(d.max()), "mean": float(d.mean()), "differing": float((d > 0).mean())}
    return out


def nvjpeg_gap(jpegs: list[bytes], device_id: int = 0) -> tuple[float, float]:
    """How far the GPU's JPEG decoder (DALI's `mixed` decoder: nvJPEG, or the hardware decoder of an
    A100/H100) lands from libjpeg-turbo's (Pillow's) on the same files, before any augmentation: the
    mean absolute difference in levels of 255, and the median PSNR (inf where identical)."""
    import io

    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    @pipeline_def(batch_size=len(jpegs), num_threads=1, device_id=device_id)
    def decode():
        encoded = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(encoded, device="mixed", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    pipe.feed_input("enc", [np.frombuffer(j, np.uint8) for j in jpegs])
    (out,) = pipe.run()
    out = out.as_cpu()
    levels, psnr = [], []
    for i, data in enumerate(jpegs):
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.float64)
        d = np.abs(np.array(out[i], np.float64) - ref)
        levels.append(d.mean())
        mse = (d**2).mean()
        psnr.append(float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse))
    return float(np.mean(levels)), float(np.median(psnr))
