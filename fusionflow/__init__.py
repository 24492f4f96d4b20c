"""FusionFlow: CPU-GPU cooperative data augmentation for PyTorch training.

Public API: `load_policy`, `Policy`, and FusionFlow's errors. Heavier pieces (the CPU pipeline,
which imports Pillow, and the DALI pipeline) are imported from their modules when needed.
"""
from fusionflow.errors import DecodeError, FusionFlowError
from fusionflow.policy import Policy, load_policy

__all__ = ["DecodeError", "FusionFlowError", "Policy", "load_policy"]
__version__ = "0.1.0"
