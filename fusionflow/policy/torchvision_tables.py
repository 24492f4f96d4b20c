"""torchvision's RandAugment / AutoAugment / TrivialAugmentWide / AugMix objects -> a policy's `augment` section
(for `policy_from_transform`, fusionflow/policy/from_torchvision.py).

The op tables come from the torchvision object itself (its magnitude bins at the policy's output
size), converted to FusionFlow's units (fusionflow/policy/op_specs.py: Solarize's threshold is 255 x
torchvision's magnitude on uint8 images), and every bin is checked to map to torchvision's value.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


def mode_name(interpolation) -> str:
    return getattr(interpolation, "value", str(interpolation))


def _fill(t, fail):
    fill = t.fill
    if isinstance(fill, dict):
        values = set(map(repr, fill.values()))
        if len(values) != 1:
            fail(f"fill={fill!r}: a per-type fill dict is not expressible; give one fill for images")
        fill = next(iter(fill.values()))
    if fill is None:
        return 0
    values = [fill] if isinstance(fill, (int, float)) else list(fill)
    if not all(float(v).is_integer() and 0 <= v <= 255 for v in values) or len(values) not in (1, 3):
        fail(f"fill={fill!r}: FusionFlow fills with integers 0..255, one value or [r, g, b]")
    return int(values[0]) if len(values) == 1 else [int(v) for v in values]


def _interpolation(t, fail) -> str:
    mode = mode_name(t.interpolation)
    if mode not in INTERPOLATIONS:
        fail(f"interpolation={mode!r}: the policy ops resample with one of {', '.join(INTERPOLATIONS)}")
    return mode


def _op_entry(name: str, magnitudes, signed: bool, num_bins: int, fail) -> dict:
    """One op's `augment.ops` entry from torchvision's magnitude bins, in FusionFlow's unit, checked
    to reproduce every bin."""
    from fusionflow.policy.op_specs import OPS
    from fusionflow.policy.schema import OpChoice

    if name not in OPS:
        fail(f"op {name!r} has no FusionFlow implementation")
    if magnitudes is None:
        return {}
    # torchvision's tables are float32: each value's shortest float32 spelling (0.3, not 0.30000001)
    values = [_unit(name, float(np.format_float_positional(np.float32(m)))) for m in magnitudes.tolist()]
    choice = OpChoice(name, (values[0], values[-1]), signed)
    for b, want in enumerate(values):
        got = choice.value(b, num_bins)
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-4):
            fail(f"op {name!r}: torchvision's bin {b} is {want}, a linear range gives {got}; not expressible")
    entry: dict[str, Any] = {"range": [values[0], values[-1]]}
    if signed:
        entry["signed"] = True
    return entry


def _unit(name: str, magnitude: float) -> float:
    """torchvision's magnitude -> FusionFlow's value (fusionflow/policy/op_specs.py) on uint8 images."""
    return 255.0 * magnitude if name == "Solarize" else magnitude


def augment_section(t, size, fail) -> dict:
    """The `augment` section of torchvision's auto-augmentation `t` at output `size`; `fail(why)` raises."""
    import torchvision.transforms.v2 as T

    height, width = size
    if isinstance(t, T.AugMix):
        return _augmix_section(t, fail)
    common = {"interpolation": _interpolation(t, fail), "fill": _fill(t, fail)}
    space = t._AUGMENTATION_SPACE
    if isinstance(t, T.AutoAugment):
        num_bins = 10  # torchvision's AutoAugment always maps its bins 0..9
        ops = {
            name: _op_entry(name, fn(num_bins, height, width), signed, num_bins, fail)
            for name, (fn, signed) in space.items()
        }
        subs = [
            [[name, float(p)] + ([int(b)] if b is not None and ops[name] else []) for name, p, b in sub]
            for sub in t._policies
        ]
        return {"type": "subpolicy", "num_bins": num_bins, "ops": ops, "subpolicies": subs, **common}
    num_bins = int(t.num_magnitude_bins)
    ops = {
        name: _op_entry(name, fn(num_bins, height, width), signed, num_bins, fail)
        for name, (fn, signed) in space.items()
    }
    if isinstance(t, T.TrivialAugmentWide):
        # fixed pixel ranges (32 px translate): a later size override must not rescale them
        for name in ("TranslateX", "TranslateY"):
            if ops.get(name):
                ops[name]["scale_with_size"] = False
        return {"type": "trivial", "num_bins": num_bins, "ops": ops, **common}
    if not 0 <= t.magnitude < num_bins:
        fail(f"magnitude={t.magnitude} must be in 0..num_magnitude_bins-1={num_bins - 1}")
    if t.num_ops < 1:
        fail(f"num_ops={t.num_ops}: FusionFlow draws 1..16 ops per sample; drop RandAugment for none")
    return {
        "type": "rand",
        "num_ops": int(t.num_ops),
        "magnitude": int(t.magnitude),
        "num_bins": num_bins,
        "ops": ops,
        **common,
    }


def _augmix_section(t, fail) -> dict:
    """torchvision's AugMix: its parameters as they are (policy/tv_augmix.py draws and mixes as it does)."""
    mode = mode_name(t.interpolation)
    if mode not in ("nearest", "bilinear"):
        fail(
            f"interpolation={mode!r}: torchvision's AugMix runs its chains on tensors, which take nearest or "
            "bilinear (torchvision itself raises at the first geometric op)"
        )
    if t.mixture_width < 1 or t.mixture_width > 16 or t.chain_depth == 0 or t.chain_depth > 16:
        fail(
            f"mixture_width={t.mixture_width}, chain_depth={t.chain_depth}: FusionFlow takes 1..16 chains of 1..16 ops"
        )
    section = {
        "type": "augmix",
        "severity": int(t.severity),
        "mixture_width": int(t.mixture_width),
        "chain_depth": max(-1, int(t.chain_depth)),
        "alpha": float(t.alpha),
        "all_ops": bool(t.all_ops),
        "interpolation": mode,
    }
    if t.fill is not None:
        section["fill"] = _fill(t, fail)
    return section
