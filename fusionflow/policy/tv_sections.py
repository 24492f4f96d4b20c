"""The sections `policy_from_transform` reads from single torchvision transforms (each returns the
policy section, or None when the transform is another one): ColorJitter and its RandomApply,
RandomGrayscale / Grayscale(3), GaussianBlur and its RandomApply."""

from __future__ import annotations

RANDOM_APPLY = "RandomApply is expressible only around a single ColorJitter or GaussianBlur"


def _applied(t, T, kind) -> tuple[float, object] | None:
    """(p, the transform) for `kind` itself (p = 1) or RandomApply([kind], p); None otherwise."""
    p = 1.0
    if type(t) is T.RandomApply and len(t.transforms) == 1:
        p, t = float(t.p), t.transforms[0]
    return (p, t) if type(t) is kind else None


def jitter_section(t, T) -> dict | None:
    """ColorJitter, or RandomApply([ColorJitter], p) (SimCLR's, timm's color_jitter_prob), as the
    policy's jitter section ({} when it adjusts nothing); None for any other transform."""
    found = _applied(t, T, T.ColorJitter)
    if found is None:
        return None
    p, t = found
    keys = ("brightness", "contrast", "saturation", "hue")
    section = {k: [float(v) for v in getattr(t, k)] for k in keys if getattr(t, k) is not None}
    return {**section, "p": p} if section else {}


def grayscale_p(t, T) -> float | None:
    """RandomGrayscale(p) -> p, Grayscale(3) -> 1; None for any other transform (Grayscale(1) too:
    FusionFlow's output has three channels)."""
    if type(t) is T.RandomGrayscale:
        return float(t.p)
    if type(t) is T.Grayscale and t.num_output_channels == 3:
        return 1.0
    return None


def blur_section(t, T) -> dict | None:
    """GaussianBlur(kernel_size, sigma), or RandomApply([GaussianBlur], p) (timm's gaussian_blur_prob),
    as the policy's blur section; None for any other transform."""
    found = _applied(t, T, T.GaussianBlur)
    if found is None:
        return None
    p, t = found
    return {"kernel_size": [int(k) for k in t.kernel_size], "sigma": [float(s) for s in t.sigma], "p": p}
