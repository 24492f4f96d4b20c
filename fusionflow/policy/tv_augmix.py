"""torchvision's AugMix as policy data (`augment.type: augmix`): its operation set, magnitude tables and
draw, with the Dirichlet and Beta weights part of the per-sample draw.

torchvision's `AugMix(severity, mixture_width, chain_depth, alpha, all_ops, interpolation, fill)` (the
classification recipe's `--auto-augment augmix`) draws, per image: m = Dirichlet(alpha, alpha) (the
original's weight m[0], the mixture's m[1]); w = Dirichlet(alpha x mixture_width) * m[1]; then per chain a
depth (chain_depth, or 1..3 uniformly when chain_depth <= 0) and per op of the chain an op uniformly from
its table, a magnitude bin uniformly from the table's first `severity` of 10 bins, and for a signed op a
sign with p = 0.5. The output is m[0] * image + sum_i w_i * chain_i(image), computed in float32 and
truncated to uint8 (fusionflow/ops/augmix.py). Here the same quantities come from the sample's stream, so
(seed, epoch, index, copy) fixes them, and `SampleDraw.steps` records them in torchvision's terms (a
test feeds them to torchvision's own AugMix).

The tables are torchvision's `_augmentation_space(10, (height, width))` at the output size, computed by
torch.linspace as torchvision computes them (float32; computed once per size and process); each op's
value is in FusionFlow's unit (fusionflow/policy/op_specs.py), which for these ops is torchvision's magnitude.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fusionflow.policy.draws import MixDraw, OpDraw, TimmStep
from fusionflow.policy.reader import Reader

NUM_BINS = 10  # torchvision's AugMix._PARAMETER_MAX: the tables' length; severity picks a prefix
INTERPOLATIONS = ("nearest", "bilinear")  # torchvision's AugMix on tensors takes only these two
_BASIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize", "AutoContrast", "Equalize")
_ENHANCE = ("Brightness", "Color", "Contrast", "Sharpness")  # all_ops=True adds these
SIGNED = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", *_ENHANCE}


@dataclass(frozen=True)
class AugMixSettings:
    severity: int = 3
    mixture_width: int = 3
    chain_depth: int = -1  # <= 0: 1..3 drawn per chain
    alpha: float = 1.0
    all_ops: bool = True
    fill: tuple[int, int, int] | None = None  # None: torchvision's default (tensor ops without a fill)

    @property
    def ops(self) -> tuple[str, ...]:
        return _BASIC + _ENHANCE if self.all_ops else _BASIC

    @property
    def max_ops(self) -> int:
        return self.mixture_width * (self.chain_depth if self.chain_depth > 0 else 3)


def parse_augmix(r: Reader, raw: Mapping):
    """`augment:` of type augmix -> (AugMixSettings, interpolation, fill); ValueError naming the key."""
    keys = ("severity", "mixture_width", "chain_depth", "alpha", "all_ops", "interpolation", "fill")
    a = r.mapping(raw, "augment", ("type",), keys)
    fill = None if a.get("fill") is None else r.fill(a["fill"], "augment.fill")
    settings = AugMixSettings(
        severity=r.integer(a.get("severity", 3), "augment.severity", 1, NUM_BINS),
        mixture_width=r.integer(a.get("mixture_width", 3), "augment.mixture_width", 1, 16),
        chain_depth=r.integer(a.get("chain_depth", -1), "augment.chain_depth", -1, 16),
        alpha=r.number(a.get("alpha", 1.0), "augment.alpha", 1e-3, 1e3),
        all_ops=r.boolean(a.get("all_ops", True), "augment.all_ops"),
        fill=fill,
    )
    if settings.chain_depth == 0:
        r.fail("augment.chain_depth", "0 applies no op; give 1..16, or -1 for a depth of 1..3 drawn per chain")
    interpolation = r.choice(a.get("interpolation", "bilinear"), "augment.interpolation", INTERPOLATIONS)
    # FusionFlow's own kernels fill uncovered pixels with black when torchvision's fill is None
    return settings, interpolation, fill or (0, 0, 0)


def _linspace(start: float, end: float) -> tuple[float, ...]:
    """torch.linspace(start, end, 10) as torchvision's table holds it: torch's own float32 values (its CPU
    kernel's rounding depends on the SIMD width it dispatches to, so it is asked, not re-derived)."""
    import torch

    return tuple(float(v) for v in torch.linspace(start, end, NUM_BINS).tolist())


@lru_cache(maxsize=64)
def magnitude_table(all_ops: bool, height: int, width: int) -> dict[str, tuple[float, ...] | None]:
    """torchvision's AugMix tables at an image size: op -> the 10 bins' values (None: no magnitude), in
    torchvision's key order (the order its op index draws from)."""
    lin = lambda end: _linspace(0.0, end)  # noqa: E731
    posterize = tuple(4 - int(np.round(np.float32(b) / np.float32((NUM_BINS - 1) / 4))) for b in range(NUM_BINS))
    table: dict[str, tuple[float, ...] | None] = {
        "ShearX": lin(0.3),
        "ShearY": lin(0.3),
        "TranslateX": lin(width / 3.0),
        "TranslateY": lin(height / 3.0),
        "Rotate": lin(30.0),
        "Posterize": tuple(float(v) for v in posterize),
        "Solarize": _linspace(255.0, 0.0),
        "AutoContrast": None,
        "Equalize": None,
    }
    if all_ops:
        table.update({name: lin(0.9) for name in _ENHANCE})
    return table


def draw_augmix(settings: AugMixSettings, size: tuple[int, int], rng) -> tuple[MixDraw, tuple[TimmStep, ...]]:
    """One sample's AugMix: the weights from a generator seeded off the sample's stream (gamma deviates
    normalised as a Dirichlet is), then per chain its depth and per op four uniforms -- op, bin, sign and
    a spare -- whether used or not, so one op never shifts the next's draws."""
    table = magnitude_table(settings.all_ops, *size)
    names = tuple(table)
    mixer = np.random.default_rng(rng.integers(1 << 53))
    beta = _dirichlet(mixer, settings.alpha, 2)
    weights = _dirichlet(mixer, settings.alpha, settings.mixture_width)
    chains, steps = [], []
    for k in range(settings.mixture_width):
        depth = settings.chain_depth if settings.chain_depth > 0 else 1 + rng.integers(3)
        chain = []
        for _ in range(depth):
            u_op, u_bin, u_sign, _spare = rng.random(4)
            name = names[min(int(u_op * len(names)), len(names) - 1)]
            b = min(int(u_bin * settings.severity), settings.severity - 1)
            negate = name in SIGNED and u_sign < 0.5
            values = table[name]
            value = 0.0 if values is None else values[b]
            chain.append(OpDraw(name, -value if negate else value, (0.0, 0.0)))
            steps.append(TimmStep(name, True, float(b), negate, "", k))
        chains.append(tuple(chain))
    mix = MixDraw(weights, beta[0], tuple(chains), style="torchvision", m_mix=beta[1])
    return mix, tuple(steps)


def _dirichlet(gen: np.random.Generator, alpha: float, n: int) -> tuple[float, ...]:
    """A Dirichlet(alpha, ..., alpha) deviate as float32 values (torch samples it in float32): gamma
    deviates divided by their sum."""
    g = gen.standard_gamma(alpha, n).astype(np.float32)
    total = g.sum(dtype=np.float32)
    if total <= 0:  # every deviate underflowed (tiny alpha): all weight on one, as the limit is
        g, total = np.eye(n, dtype=np.float32)[gen.integers(n)], np.float32(1)
    return tuple(float(v) for v in (g / total).astype(np.float32))
