"""Operator library: one registry of augmentation ops.

`specs` (pure) declares each op once: magnitude domain and how a value becomes parameters.
`cpu` implements every op on Pillow/numpy, `dali` as a DALI graph fragment (device 'cpu' or
'gpu'). `pipeline` runs a whole policy on CPU; `dali_pipeline` builds the equivalent DALI pipeline.
Import the implementation modules explicitly; this package import stays light.
"""

from fusionflow.policy.op_specs import OP_NAMES, OPS, OpSpec

__all__ = ["OPS", "OP_NAMES", "OpSpec"]
