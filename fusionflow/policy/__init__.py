"""Augmentation policies: config file -> frozen Policy, and per-sample draws.

Pure Python + numpy + PyYAML; nothing here imports torch or DALI.
"""
from fusionflow.policy.sampling import OpDraw, SampleDraw, crop_window, draw
from fusionflow.policy.schema import Augment, OpChoice, Policy, Step, load_policy, shipped_policies

__all__ = ["Augment", "OpChoice", "OpDraw", "Policy", "SampleDraw", "Step", "crop_window", "draw",
           "load_policy", "shipped_policies"]
