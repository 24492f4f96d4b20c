"""The torch DataLoader + torchvision baseline that the demo and `python -m fusionflow bench` compare
FusionFlow against, and the timing of a loader's iteration they share."""

from __future__ import annotations

import io
import time

TV_POLICIES = ("default", "randaugment", "trivialaugment", "autoaugment")


class BaselineSampleError(RuntimeError):
    """A sample the torchvision baseline could not read or augment. Its line naming the sample starts with
    BASELINE_FAILED (from a DataLoader worker it comes after DataLoader's own first lines: `failed_line`)."""


BASELINE_FAILED = "the torchvision baseline could not read "


def failed_line(e: BaselineSampleError) -> str:
    """The line of `e` naming the sample, wherever DataLoader's re-raise put it."""
    text = str(e)
    return next((line[line.index(BASELINE_FAILED) :] for line in text.splitlines() if BASELINE_FAILED in line), text)


class TorchvisionSamples:
    """Baseline dataset: decode with PIL, augment with torchvision.transforms.v2 (`normalize`: (mean, std),
    then float32 normalised output; None: uint8)."""

    def __init__(self, ds, policy_name: str, size: int, normalize=None):
        self.ds, self.policy_name, self.size, self.normalize = ds, policy_name, size, normalize
        self._tf = None

    def _transform(self):
        import torchvision.transforms.v2 as T

        aug = {
            "default": [],
            "randaugment": [T.RandAugment(num_ops=2, magnitude=9)],
            "trivialaugment": [T.TrivialAugmentWide()],
            "autoaugment": [T.AutoAugment()],
        }[self.policy_name]
        tail = [T.PILToTensor()]
        if self.normalize is not None:  # (mean, std) in 0..1 units: float32 out, as a training recipe delivers
            import torch

            tail += [T.ToDtype(torch.float32, scale=True), T.Normalize(*self.normalize)]
        return T.Compose([T.RandomResizedCrop(self.size, antialias=True), T.RandomHorizontalFlip(), *aug, *tail])

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        from PIL import Image

        if self._tf is None:
            self._tf = self._transform()
        data, label = self.ds[i]
        try:
            return self._tf(Image.open(io.BytesIO(data)).convert("RGB")), label
        except Exception as e:  # a corrupt image: named, not a bare Pillow error from a worker
            what = self.ds.describe(i) if hasattr(self.ds, "describe") else f"sample {i}"
            raise BaselineSampleError(f"{BASELINE_FAILED}{what}: {type(e).__name__}: {e}") from e


def timed_batches(loader):
    """Iterate `loader`, yielding (images, labels, seconds blocked in next())."""
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            return
        yield x, y, time.perf_counter() - t0
