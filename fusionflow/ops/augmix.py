"""AugMix mixtures on a uint8 HWC image.

torchvision's (`tv_augmix`): m[0] * image + sum_k (w_k * m[1]) * chain_k in float32, each product a
float32 tensor added in chain order, truncated to uint8 -- torchvision's AugMix.forward arithmetic, so
given the same draw and the same chain outputs the result is its pixels to the bit.

timm's (`augmix`): timm's AugMix mixture on a uint8 HWC image, given the sample's MixDraw: the chains' outputs summed
with the Dirichlet weights in float32, clipped and truncated to uint8, then blended with the image by
the Beta weight as Pillow's Image.blend does (float32 in1 + alpha * (in2 - in1), truncated); or, for
timm's blended variant, each chain blended into the running image with timm's derived weights.
The arithmetic is timm's own (`AugMixAugment._apply_basic` / `_apply_blended`), so exact mode is
timm's pixels to the bit (tests/test_timm.py); the same code runs in fast mode.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fusionflow.policy.draws import MixDraw


def pillow_blend(a: np.ndarray, b: np.ndarray, alpha) -> np.ndarray:
    """Image.blend(a, b, alpha) for uint8 arrays and 0 <= alpha <= 1: per byte in float32, truncated."""
    a32 = a.astype(np.float32)
    out = a32 + np.float32(alpha) * (b.astype(np.float32) - a32)
    return out.astype(np.uint8)


def tv_augmix(base: np.ndarray, m: MixDraw, chain: Callable[[tuple], np.ndarray]) -> np.ndarray:
    """torchvision's AugMix of `base` (uint8, any layout); `chain(ops)` returns `base` after those ops."""
    weights = np.float32(m.weights) * np.float32(m.m_mix)  # its combined_weights: float32 product
    mixed = np.float32(m.m) * base.astype(np.float32)
    for w, ops in zip(weights, m.chains):
        mixed += w * np.asarray(chain(ops), dtype=np.float32)
    return mixed.astype(np.uint8)


def mix(base: np.ndarray, m: MixDraw, chain: Callable[[tuple], np.ndarray]) -> np.ndarray:
    """The draw's mixture in its library's arithmetic."""
    return tv_augmix(base, m, chain) if m.style == "torchvision" else augmix(base, m, chain)


def augmix(base: np.ndarray, m: MixDraw, chain: Callable[[tuple], np.ndarray]) -> np.ndarray:
    """The mixed image; `chain(ops)` returns `base` after those ops (a new array)."""
    weights = np.float32(m.weights)  # timm: np.float32(np.random.dirichlet([alpha] * width))
    beta = np.float32(m.m)
    if m.blended:
        out = base
        for w, ops in zip(_blended_weights(weights, beta), m.chains):
            out = pillow_blend(out, chain(ops), w)
        return out
    mixed = np.zeros(base.shape, np.float32)
    for w, ops in zip(weights, m.chains):
        mixed += w * np.asarray(chain(ops), dtype=np.float32)
    np.clip(mixed, 0, 255.0, out=mixed)
    return pillow_blend(base, mixed.astype(np.uint8), beta)


def _blended_weights(weights: np.ndarray, beta: np.float32) -> np.ndarray:
    """timm's per-chain blend weights for the blended variant: the mixture's weights scaled by the Beta
    weight, turned from last to first into the alpha of successive blends (numpy float32 throughout)."""
    ws = weights * beta
    remaining, alphas = 1.0, []
    for w in ws[::-1]:
        alpha = w / remaining
        remaining *= 1 - alpha
        alphas.append(alpha)
    return np.array(alphas[::-1], dtype=np.float32)
