"""Allocator bridge: PyTorch lends its free cached GPU blocks to DALI between training steps."""
