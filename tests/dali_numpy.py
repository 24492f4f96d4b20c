"""A DALI policy pipeline's output for a few samples as one numpy array (tests only: the runtime
copies DALI's output into the ring, fusionflow/accel/accelerator.py)."""

import numpy as np


def run_numpy(pipe, samples, indices, seed: int = 0, epoch: int = 0, copies=None) -> np.ndarray:
    """`pipe.run(...)` (a fusionflow.accel.dali_graph.DaliPolicyPipeline) stacked into [N, C, H, W] on the host."""
    out = pipe.run(samples, indices, seed, epoch, copies)
    if pipe.device == "gpu":
        out = out.as_cpu()
    return np.stack([np.array(out[i]) for i in range(len(samples))])


def nvjpeg_gap(jpegs: list[bytes], device_id: int = 0) -> tuple[float, float]:
    """How far the GPU's JPEG decoder (DALI's `mixed` decoder: nvJPEG, or the hardware decoder of an
    A100/H100) lands from libjpeg-turbo's (Pillow) on the same files, before any augmentation: the
    mean absolute difference in levels of 255 and the median PSNR. The GPU pipeline tests allow for
    it: the CPU path decodes with libjpeg-turbo, the GPU path with nvJPEG, and both are right."""
    import io

    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    @pipeline_def(batch_size=len(jpegs), num_threads=1, device_id=device_id)
    def decode():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(enc, device="mixed", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    pipe.feed_input("enc", [np.frombuffer(j, np.uint8) for j in jpegs])
    (out,) = pipe.run()
    out = out.as_cpu()
    diffs, scores = [], []
    for i, j in enumerate(jpegs):
        ref = np.asarray(Image.open(io.BytesIO(j)).convert("RGB"), np.float64)
        d = np.abs(np.array(out[i], np.float64) - ref)
        diffs.append(d.mean())
        mse = (d**2).mean()
        scores.append(float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse))
    return float(np.mean(diffs)), float(np.median(scores))
