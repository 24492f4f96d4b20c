"""Augmentation policies: config file -> frozen Policy (with validated overrides), and per-sample draws.

Pure Python + numpy + PyYAML; nothing here imports DALI, and torch only inside torchvision's AugMix
tables (policy/tv_augmix.py, computed by torch.linspace as torchvision's are).
"""

from fusionflow.policy.image_sections import Erase, Jitter
from fusionflow.policy.overrides import OVERRIDES, load_policy  # noqa: E402 (after schema: it builds on it)
from fusionflow.policy.sampling import EraseDraw, OpDraw, SampleDraw, crop_window, draw, uniforms
from fusionflow.policy.schema import Augment, OpChoice, Policy, Step, shipped_policies

__all__ = [
    "Augment",
    "Erase",
    "EraseDraw",
    "Jitter",
    "OVERRIDES",
    "OpChoice",
    "OpDraw",
    "Policy",
    "SampleDraw",
    "Step",
    "crop_window",
    "draw",
    "load_policy",
    "shipped_policies",
    "uniforms",
]
