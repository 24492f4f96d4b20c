"""timm's augmentations as policy data: RandAugment (`augment.type: timm-rand`), AutoAugment
(`timm-auto`) and AugMix (`timm-augmix`), with timm's op set and level functions.

timm (pytorch-image-models, `timm/data/auto_augment.py`) defines its ops on a magnitude *level*
0..10 (up to `magnitude_max`), perturbed per op call by Gaussian noise (`magnitude_std`, `mstd` in its
config strings; inf: uniform in [0, magnitude]) and clamped; each op applies with a probability; the
signed ones flip sign with p = 0.5; the geometric ones resample bilinear, bicubic or -- timm's
'random' -- one of the two drawn per op call, and fill with the dataset mean. The level -> argument
formulas below follow its functions in meaning and arithmetic (so a draw gives the same pixels);
the values land in FusionFlow's op units (fusionflow/policy/op_specs.py): enhancement factor f as f - 1,
timm's translations (fractional pixels, matrix x_in = x + p) as ShiftX/ShiftY by -p, its shears as
SkewX/SkewY (the factor's matrix as written).

Keys (configs/README.md documents them for users):
  timm-rand    ops [names], num_ops (2), magnitude (10), prob (0.5), weights (optional: the ops are then
               drawn without replacement with these weights, as timm's numpy choice does)
  timm-auto    subpolicies [[[op, prob, level], ...], ...] (one drawn uniformly per sample)
  timm-augmix  ops [names], magnitude (3), width (3), depth (-1: 1..3 per chain), alpha (1.0), blended (false)
  all          magnitude_std (rand/auto 0, augmix inf), magnitude_max (10), translate_pct (0.45),
               translate_const (250), interpolation (bilinear | bicubic | random), fill ([r, g, b])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionflow.policy.draws import MixDraw, OpDraw, TimmStep
from fusionflow.policy.reader import Reader

TIMM_TYPES = ("timm-rand", "timm-auto", "timm-augmix")
TIMM_INTERPOLATIONS = ("bilinear", "bicubic", "random")
LEVEL_DENOM = 10.0  # timm's _LEVEL_DENOM: level 10 is an op's full strength


def _signed(v: float, negate: bool) -> float:
    return -v if negate else v


def _enhance(level, negate, t, h, w):  # timm: factor = level / 10 * 1.8 + 0.1
    return (level / LEVEL_DENOM) * 1.8 + 0.1 - 1.0


def _enhance_increasing(level, negate, t, h, w):  # timm: factor = max(0.1, 1 +- level / 10 * 0.9)
    return max(0.1, 1.0 + _signed((level / LEVEL_DENOM) * 0.9, negate)) - 1.0


def _minmax(level: float, lo: float, hi: float) -> float:  # timm's _minmax_level_to_arg, clamped
    return max(lo, min(hi, lo + (hi - lo) * (level / LEVEL_DENOM)))


def _desaturate(level, negate, t, h, w):  # timm: Color enhance by min(1, max(0, 1 - level's 0.5..1 arg))
    return min(1.0, max(0.0, 1.0 - _minmax(level, 0.5, 1.0))) - 1.0


def _posterize(level, negate, t, h, w):  # bits kept 0..4
    return int((level / LEVEL_DENOM) * 4)


def _solarize(level, negate, t, h, w):  # threshold 0..256
    return min(256, int((level / LEVEL_DENOM) * 256))


def _shear(level, negate, t, h, w):
    return _signed((level / LEVEL_DENOM) * 0.3, negate)


def _translate_abs(level, negate, t, h, w):
    return -_signed((level / LEVEL_DENOM) * float(t.translate_const), negate)


def _translate_rel_x(level, negate, t, h, w):  # timm: pixels = pct * image width
    return -(_signed((level / LEVEL_DENOM) * t.translate_pct, negate) * w)


def _translate_rel_y(level, negate, t, h, w):
    return -(_signed((level / LEVEL_DENOM) * t.translate_pct, negate) * h)


# timm op -> (FusionFlow op, value(level, negate, timm settings, height, width) or None without magnitude)
TIMM_OPS = {
    "AutoContrast": ("AutoContrast", None),
    "Equalize": ("Equalize", None),
    "Invert": ("Invert", None),
    "Rotate": ("Rotate", lambda level, n, t, h, w: _signed((level / LEVEL_DENOM) * 30.0, n)),
    "Posterize": ("Posterize", _posterize),
    "PosterizeIncreasing": ("Posterize", lambda level, n, t, h, w: 4 - _posterize(level, n, t, h, w)),
    "PosterizeOriginal": ("Posterize", lambda level, n, t, h, w: _posterize(level, n, t, h, w) + 4),
    "Solarize": ("Solarize", _solarize),
    "SolarizeIncreasing": ("Solarize", lambda level, n, t, h, w: 256 - _solarize(level, n, t, h, w)),
    "SolarizeAdd": ("SolarizeAdd", lambda level, n, t, h, w: min(128, int((level / LEVEL_DENOM) * 110))),
    **{name: (name, _enhance) for name in ("Color", "Contrast", "Brightness", "Sharpness")},
    **{f"{name}Increasing": (name, _enhance_increasing) for name in ("Color", "Contrast", "Brightness", "Sharpness")},
    "ShearX": ("SkewX", _shear),
    "ShearY": ("SkewY", _shear),
    "TranslateX": ("ShiftX", _translate_abs),
    "TranslateY": ("ShiftY", _translate_abs),
    "TranslateXRel": ("ShiftX", _translate_rel_x),
    "TranslateYRel": ("ShiftY", _translate_rel_y),
    # timm's 3a (DeiT III's three augmentations): its own ops
    "Desaturate": ("Color", _desaturate),
    "GaussianBlur": ("GaussianBlur", lambda level, n, t, h, w: _minmax(level, 0.1, 2.0)),
    "GaussianBlurRand": ("GaussianBlur", None),  # radius uniform in [0.1, 2 * level / 10]: drawn (RANDOM_RADIUS)
}
RANDOM_RADIUS = {"GaussianBlurRand"}  # ops whose argument timm draws inside the op: TimmStep.aux holds it


@dataclass(frozen=True)
class TimmAugment:
    """One timm augmentation's settings (the policy's `augment` section for the timm-* types)."""

    ops: tuple[str, ...] = ()  # rand, augmix: timm op names
    weights: tuple[float, ...] | None = None  # rand: choice weights (normalised), drawn without replacement
    num_ops: int = 2
    prob: float = 0.5  # rand: each op's probability
    magnitude: float = 10.0
    magnitude_std: float = 0.0  # inf: uniform in [0, magnitude]
    magnitude_max: float | None = None  # the clamp's upper bound (None: 10)
    subpolicies: tuple[tuple[tuple[str, float, float], ...], ...] = ()  # auto: (op, prob, level) steps
    width: int = 3  # augmix: chains
    depth: int = -1  # augmix: ops per chain; <= 0: 1..3 drawn per chain
    alpha: float = 1.0  # augmix: Dirichlet / Beta parameter
    blended: bool = False
    translate_pct: float = 0.45
    translate_const: float = 250.0


def parse_timm(r: Reader, raw: Mapping, kind: str):
    """`augment:` of a timm-* type -> (TimmAugment, interpolation, fill); ValueError naming the key."""
    common = ("magnitude_std", "magnitude_max", "translate_pct", "translate_const", "interpolation", "fill")
    if kind == "timm-rand":
        a = r.mapping(raw, "augment", ("type", "ops"), ("num_ops", "magnitude", "prob", "weights", *common))
    elif kind == "timm-auto":
        a = r.mapping(raw, "augment", ("type", "subpolicies"), common)
    else:
        a = r.mapping(raw, "augment", ("type", "ops"), ("magnitude", "width", "depth", "alpha", "blended", *common))
    std = a.get("magnitude_std", math.inf if kind == "timm-augmix" else 0.0)
    std = math.inf if std in ("inf", math.inf) else r.number(std, "augment.magnitude_std", 0.0, 1e9)
    mmax = a.get("magnitude_max")
    fields: dict[str, Any] = {
        "magnitude_std": std,
        "magnitude_max": None if mmax is None else r.number(mmax, "augment.magnitude_max", 0.0, 100.0),
        "translate_pct": r.number(a.get("translate_pct", 0.45), "augment.translate_pct", 0.0, 1.0),
        "translate_const": r.number(a.get("translate_const", 250), "augment.translate_const", 0.0, 1e5),
        "magnitude": r.number(a.get("magnitude", 3 if kind == "timm-augmix" else 10), "augment.magnitude", 0.0, 100.0),
    }
    if kind != "timm-auto":
        fields["ops"] = _op_names(r, a["ops"], "augment.ops")
    if kind == "timm-rand":
        fields["num_ops"] = r.integer(a.get("num_ops", 2), "augment.num_ops", 1, 16)
        fields["prob"] = r.number(a.get("prob", 0.5), "augment.prob", 0.0, 1.0)
        if a.get("weights") is not None:
            fields["weights"] = _weights(r, a["weights"], len(fields["ops"]), fields["num_ops"])
    elif kind == "timm-auto":
        fields["subpolicies"] = _subpolicies(r, a["subpolicies"])
    else:
        fields["width"] = r.integer(a.get("width", 3), "augment.width", 1, 16)
        fields["depth"] = r.integer(a.get("depth", -1), "augment.depth", -1, 16)
        fields["alpha"] = r.number(a.get("alpha", 1.0), "augment.alpha", 1e-3, 1e3)
        fields["blended"] = r.boolean(a.get("blended", False), "augment.blended")
    interpolation = r.choice(a.get("interpolation", "bilinear"), "augment.interpolation", TIMM_INTERPOLATIONS)
    fill_raw = a.get("fill", [128, 128, 128])
    fill = r.fill(fill_raw, "augment.fill")
    return TimmAugment(**fields), interpolation, fill


def _op_names(r: Reader, raw: Any, path: str) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        r.fail(path, f"expected a non-empty list of timm op names, got {raw!r}")
    for i, name in enumerate(raw):
        _timm_op_name(r, name, f"{path}[{i}]")
    return tuple(raw)


def _timm_op_name(r: Reader, name: Any, path: str) -> None:
    if not isinstance(name, str):
        r.fail(path, f"expected a timm op name, got {type(name).__name__} {name!r}")
    if name not in TIMM_OPS:
        import difflib

        near = difflib.get_close_matches(str(name), TIMM_OPS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f"; timm's ops here: {', '.join(TIMM_OPS)}"
        r.fail(path, f"unknown timm op {name!r}{hint}")


def _weights(r: Reader, raw: Any, n: int, num_ops: int) -> tuple[float, ...]:
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        r.fail("augment.weights", f"expected {n} numbers, one per op, got {raw!r}")
    w = [r.number(v, f"augment.weights[{i}]", 0.0, None) for i, v in enumerate(raw)]
    if sum(1 for v in w if v > 0) < num_ops:
        r.fail(
            "augment.weights", f"num_ops={num_ops} ops are drawn without replacement: give that many non-zero weights"
        )
    total = sum(w)
    return tuple(v / total for v in w)


def _subpolicies(r: Reader, raw: Any):
    out: list[list[tuple[str, float, float]]] = []
    for i, spath, step in r.subpolicy_steps(raw, "augment.subpolicies", "[op, probability, level]"):
        if not isinstance(step, (list, tuple)) or len(step) != 3:
            r.fail(spath, f"expected [op, probability, level], got {step!r}")
        _timm_op_name(r, step[0], f"{spath}[0]")
        prob = r.number(step[1], f"{spath}[1]", 0.0, 1.0)
        if i == len(out):  # the first step of sub-policy i
            out.append([])
        out[i].append((step[0], prob, r.number(step[2], f"{spath}[2]", 0.0, 100.0)))
    return tuple(tuple(sp) for sp in out)


def max_ops(kind: str, t: TimmAugment) -> int:
    if kind == "timm-rand":
        return t.num_ops
    if kind == "timm-auto":
        return max(len(sp) for sp in t.subpolicies)
    return t.width * (t.depth if t.depth > 0 else 3)


# ---- the draw ------------------------------------------------------------------------------------------


def draw_timm(augment, size: tuple[int, int], rng):
    """(ops, mix, steps) of one sample for a timm-* augment; `rng` is the sample's stream (random(n),
    integers(high)). Every op call takes five uniforms: apply, two for the magnitude noise, sign,
    interpolation -- whether used or not, so one op's settings never shift the next's draws."""
    t: TimmAugment = augment.timm
    if augment.type == "timm-augmix":
        return _draw_augmix(augment, t, size, rng)
    if augment.type == "timm-auto":
        k = rng.integers(len(t.subpolicies))
        steps = [_step(augment, t, name, prob, level, rng, k) for name, prob, level in t.subpolicies[k]]
    else:
        steps = [_step(augment, t, name, t.prob, t.magnitude, rng) for name in _choose(t, rng)]
    ops = tuple(op for op in (_op(s, t, size) for s in steps) if op is not None)
    return ops, None, tuple(steps)


def _choose(t: TimmAugment, rng) -> list[str]:
    """RandAugment's ops: uniformly with replacement, or with weights without replacement."""
    if t.weights is None:
        return [t.ops[rng.integers(len(t.ops))] for _ in range(t.num_ops)]
    left, chosen = list(range(len(t.ops))), []
    for _ in range(t.num_ops):
        u, acc, pick = rng.random() * sum(t.weights[i] for i in left), 0.0, None
        for i in left:
            acc += t.weights[i]
            if t.weights[i] > 0:
                pick = i
                if acc > u:
                    break
        chosen.append(t.ops[pick])
        left.remove(pick)
    return chosen


def _step(augment, t: TimmAugment, name: str, prob: float, magnitude: float, rng, group: int = 0) -> TimmStep:
    u_apply, u1, u2, u_sign, u_interp = rng.random(5)
    applied = not (prob < 1.0 and u_apply > prob)  # timm skips the op when random() > prob
    level = magnitude
    if t.magnitude_std == math.inf:
        level = magnitude * u1  # random.uniform(0, magnitude)
    elif t.magnitude_std > 0:  # a normal deviate (Box-Muller)
        level = magnitude + t.magnitude_std * math.cos(2 * math.pi * u1) * math.sqrt(-2.0 * math.log(1.0 - u2))
    resample = augment.interpolation
    if resample == "random":
        resample = "bilinear" if u_interp < 0.5 else "bicubic"
    aux = 0.0
    if name in RANDOM_RADIUS:  # unsigned: the sign's uniform draws timm's random.uniform(0.1, 2 * factor)
        factor = _minmax(max(0.0, min(level, t.magnitude_max or LEVEL_DENOM)), 0.0, 1.0)
        aux = 0.1 + (2.0 * factor - 0.1) * u_sign
    return TimmStep(name, applied, level, u_sign > 0.5, resample, group, aux)


def _op(step: TimmStep, t: TimmAugment, size: tuple[int, int]) -> OpDraw | None:
    if not step.applied:
        return None
    upper = t.magnitude_max or LEVEL_DENOM
    level = max(0.0, min(step.level, upper))
    name, value = TIMM_OPS[step.op]
    h, w = size
    if step.op in RANDOM_RADIUS:
        return OpDraw(name, step.aux, (0.0, 0.0), step.resample)
    return OpDraw(name, 0.0 if value is None else float(value(level, step.negate, t, h, w)), (0.0, 0.0), step.resample)


def _draw_augmix(augment, t: TimmAugment, size, rng):
    mixer = np.random.default_rng(rng.integers(1 << 53))
    weights = mixer.dirichlet([t.alpha] * t.width)
    m = mixer.beta(t.alpha, t.alpha)
    chains, steps = [], []
    for k in range(t.width):
        depth = t.depth if t.depth > 0 else 1 + rng.integers(3)
        chain = [_step(augment, t, t.ops[rng.integers(len(t.ops))], 1.0, t.magnitude, rng, k) for _ in range(depth)]
        steps += chain
        chains.append(tuple(_op(s, t, size) for s in chain))
    mix = MixDraw(tuple(float(v) for v in weights), float(m), tuple(chains), t.blended)
    return (), mix, tuple(steps)
