"""Operator library: one registry of augmentation ops.

The registry itself is fusionflow/policy/op_specs.py (pure: each op's magnitude domain and how a
value becomes parameters), re-exported here. `exact` implements every op with Pillow/torchvision
semantics, `fast` on arrays (OpenCV, native kernels); `pipeline` runs a whole policy on the CPU.
The DALI fragments and pipeline are the GPU wing's (fusionflow/accel/dali_ops.py, dali_graph.py).
Import the implementation modules explicitly; this package import stays light.
"""

from fusionflow.policy.op_specs import OP_NAMES, OPS, OpSpec

__all__ = ["OPS", "OP_NAMES", "OpSpec"]
