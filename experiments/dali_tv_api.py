"""Issue 41's other lead: DALI 2.4's `nvidia.dali.experimental.torchvision` (a torchvision-v2-like API) as the
accelerator's engine "where its semantics match". What it is (read from the installed package, DALI 2.4.0):
`Compose([...])` builds one DALI pipeline (conditionals, exec_dynamic, prefetch 1) whose input is an already
decoded image -- a PIL image, a CHW tensor, or a dense NCHW batch of equal-sized images -- and runs it
synchronously at each call; its operators draw their own random numbers inside DALI. Its ops: RandomResizedCrop,
RandomCrop, CenterCrop, Resize, flips, Pad, Normalize, GaussianBlur, ColorJitter (DALI's color_twist in a fixed
order: torchvision draws the order), Grayscale / RandomGrayscale; no RandAugment or affine ops.

DALI's CPU backend, one DALI thread, one process, rounds interleaved, medians, the same policy on both sides
(RandomResizedCrop 224 bilinear + horizontal flip) over the harness's mixed-size JPEGs (200-1000 px):
  ours        fusionflow's DALI graph (DaliPolicyPipeline) fed runs of `--run` encoded samples: decode included
  tv_sample   the torchvision API called per sample on a decoded CHW uint8 tensor (decoding not timed): what
              mixed sizes leave it, since a call's batch must be one dense tensor
  tv_sample_decode  the same with torchvision's decode_jpeg (libjpeg-turbo) timed before each call: bytes in,
              as ours
  tv_batch    the torchvision API called on dense batches of `--run` equal-sized decoded images (the set's
              images resized to 500x375 first, not timed): its best case
img/s and the calling thread's CPU per sample.

    .venv/bin/python -m experiments.dali_tv_api [--images 128] [--run 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from experiments.harness import mixed_jpegs, provenance, result_path, rotation, write_json

POLICY = {"output": {"size": 224}, "flip": 0.5, "crop": {"scale": [0.08, 1.0]}, "augment": {"type": "none"}}


def ours(data, run: int):
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    pipe = DaliPolicyPipeline(POLICY, run, device="cpu", num_threads=1)

    def one_pass():
        for start in range(0, len(data) - run + 1, run):
            pipe.submit(data[start : start + run], list(range(start, start + run)))
            pipe.collect()
        return len(data) // run * run

    return one_pass, pipe.close


def cpu_tensors_feed_without_cuda() -> None:
    """DALI 2.4's feed_input asks torch.cuda.current_stream() for any torch tensor, a CPU one too, which raises
    where torch is a CUDA build without a GPU (this machine): CPU tensors are fed without a stream here."""
    from nvidia.dali import types

    real = types._get_default_stream_for_array

    def stream_for(array):
        first = array[0] if isinstance(array, list) and array else array
        return None if getattr(first, "is_cuda", None) is False else real(array)

    types._get_default_stream_for_array = stream_for


def tv_sample(data, decode: bool = False):
    import torch
    from nvidia.dali.experimental import torchvision as dtv
    from torchvision.io import decode_jpeg

    def decoded(d):
        return decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8)).contiguous()

    images = data if decode else [decoded(d) for d in data]
    t = dtv.Compose([dtv.RandomResizedCrop(224), dtv.RandomHorizontalFlip()], batch_size=1, num_threads=1)

    def one_pass():
        for image in images:
            t(decoded(image) if decode else image)
        return len(images)

    return one_pass, lambda: None


def tv_batch(data, run: int):
    import torch
    import torch.nn.functional as F
    from nvidia.dali.experimental import torchvision as dtv
    from torchvision.io import decode_jpeg

    def equal(d):
        x = decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8))[None].float()
        return F.interpolate(x, size=(375, 500), mode="bilinear").round().clamp(0, 255).to(torch.uint8)[0]

    images = torch.stack([equal(d) for d in data])
    t = dtv.Compose([dtv.RandomResizedCrop(224), dtv.RandomHorizontalFlip()], batch_size=run, num_threads=1)

    def one_pass():
        for start in range(0, len(images) - run + 1, run):
            t(images[start : start + run])
        return len(images) // run * run

    return one_pass, lambda: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--run", type=int, default=32, help="samples per DALI run (ours, tv_batch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = mixed_jpegs(args.images)
    cpu_tensors_feed_without_cuda()
    engines = {
        "ours": ours(data, args.run),
        "tv_sample": tv_sample(data),
        "tv_sample_decode": tv_sample(data, decode=True),
        "tv_batch": tv_batch(data, args.run),
    }
    rates: dict = {k: [] for k in engines}
    cpu: dict = {k: [] for k in engines}
    try:
        for one_pass, _ in engines.values():  # warm: pipelines built, buffers grown
            one_pass()
        for r in range(args.rounds):
            for name in rotation(engines, r):
                wall, thread = time.perf_counter(), time.thread_time()
                n = engines[name][0]()
                wall, thread = time.perf_counter() - wall, time.thread_time() - thread
                rates[name].append(n / wall)
                cpu[name].append(thread / n * 1e6)
                print(
                    f"round {r + 1}/{args.rounds}: {name} {n / wall:.0f} img/s, thread {cpu[name][-1]:.0f} us a sample"
                )
    finally:
        for _, close in engines.values():
            close()
    med = {k: {"img_s": statistics.median(rates[k]), "thread_us_per_sample": statistics.median(cpu[k])} for k in rates}
    for k, v in med.items():
        print(
            f"{k}: {v['img_s']:.0f} img/s ({v['img_s'] / med['ours']['img_s']:.2f}x ours), "
            f"{v['thread_us_per_sample']:.0f} us"
        )
    result = {**provenance(), "args": vars(args), "median": med, "rates": rates, "thread_us_per_sample": cpu}
    write_json(result, result_path(args.out, "dali_tv_api.json"))


if __name__ == "__main__":
    main()
