"""What one sample's draw decided, as plain frozen data: the ops with their values, the erased
rectangles, timm's AugMix mixture. `fusionflow.policy.sampling.draw` makes them (a pure function of
policy, seed, epoch, index and copy); every worker kind executes them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusionflow.policy.image_sections import Erase
from fusionflow.policy.op_specs import OPS, ParamTuple


@dataclass(frozen=True)
class OpDraw:
    name: str
    value: float  # in the op's unit (see fusionflow.policy.op_specs), sign applied
    aux: tuple[float, float]  # two uniforms for ops that place something (Cutout)
    resample: str | None = None  # this op's interpolation when drawn per op (timm's 'random'); None: the policy's
    fill: tuple[int, int, int] | None = None  # this op's fill (DeepAA's cutout colour); None: the policy's

    def params(self, height: int, width: int) -> ParamTuple:
        return OPS[self.name].resolve(self.value, self.aux, height, width)


@dataclass(frozen=True)
class EraseDraw:
    """RandomErasing's parameters at the output size: the rectangle (timm's count > 1: more in
    `more`), and the seed of the standard normal noise when the policy erases with noise."""

    top: int
    left: int
    height: int
    width: int
    noise_seed: int
    more: tuple[tuple[int, int, int, int], ...] = ()  # further (top, left, height, width), in order

    @property
    def rects(self) -> tuple[tuple[int, int, int, int], ...]:
        return ((self.top, self.left, self.height, self.width), *self.more)

    def fill(self, erase: Erase) -> np.ndarray:
        """What goes into the first rectangle, float32 broadcastable to (3, height, width)."""
        return self.fills(erase)[0]

    def fills(self, erase: Erase) -> list[np.ndarray]:
        """What goes into each rectangle: the value, or noise (per pixel, or per channel for
        'random_color') from one generator in rectangle order."""
        if erase.value is not None:
            return [np.asarray(erase.value, np.float32).reshape(3, 1, 1)] * len(self.rects)
        rng = np.random.default_rng(self.noise_seed)
        shape = (lambda h, w: (3, 1, 1)) if erase.noise == "color" else (lambda h, w: (3, h, w))
        return [rng.standard_normal(shape(h, w), np.float32) for _, _, h, w in self.rects]


@dataclass(frozen=True)
class TimmStep:
    """One op call as drawn, in its library's terms (what a test feeds that library's own objects). timm's
    AugmentOp: the op, whether it applied, the magnitude before clamping, the sign, the interpolation,
    and its group: AutoAugment's sub-policy index, AugMix's chain (0 for RandAugment). torchvision's
    AugMix: `level` is the magnitude bin, `group` the chain. DeepAA: `level` the bin, `group` the layer,
    `negate` the sign flipped (RandFlip: the mirror taken)."""

    op: str
    applied: bool
    level: float
    negate: bool
    resample: str
    group: int = 0
    aux: float = 0.0  # an argument timm draws inside the op (GaussianBlurRand's radius), as drawn


@dataclass(frozen=True)
class MixDraw:
    """AugMix on the sample: `chains[k]` applied to the image. timm's (style "timm"): the results summed
    with weights[k] (Dirichlet), then blended with the image by m (Beta). torchvision's (style
    "torchvision"): m * image + sum_k m_mix * weights[k] * chain_k, (m, m_mix) its Beta pair as a
    2-Dirichlet. float64 as drawn, used as float32 (fusionflow/ops/augmix.py)."""

    weights: tuple[float, ...]
    m: float
    chains: tuple[tuple[OpDraw, ...], ...]
    blended: bool = False  # timm's 'b1': each chain blended into the running image, no final blend
    style: str = "timm"  # timm | torchvision: whose arithmetic mixes the chains
    m_mix: float = 0.0  # torchvision: the mixture's share (m[1] of its Dirichlet pair)


@dataclass(frozen=True)
class SampleDraw:
    crop_u: tuple[float, ...]  # CROP_TRIES * 4 uniforms: area, log-ratio, top, left
    flip: bool
    ops: tuple[OpDraw, ...]  # applied in order after crop and flip
    erase: EraseDraw | None = None  # applied last, to the (normalised) output; None: not erased
    mix: MixDraw | None = None  # timm's AugMix, after crop and flip (then `ops` is empty)
    crop_resample: str | None = None  # the crop's filter when drawn per sample; None: the policy's
    steps: tuple[TimmStep, ...] = ()  # timm, AugMix, DeepAA policies: the draw in the library's terms
    crops: tuple[tuple[float, ...], ...] | None = None  # DeepAA: its layers' random resized crops, each
    # CROP_TRIES * 4 uniforms, composed in order (empty: no layer cropped, the centre output-size window);
    # None: the policy's crop
    jitter: tuple[OpDraw, ...] = ()  # ColorJitter's adjustments in their drawn order, after the flip, before `ops`
    grayscale: bool = False  # RandomGrayscale drew this sample: Pillow's luma in all three channels, after the jitter
    vflip: bool = False  # flipped top to bottom, after the horizontal flip
    blur: float | None = None  # GaussianBlur's sigma, after the augment ops; None: not blurred
