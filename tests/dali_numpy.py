"""A DALI policy pipeline's output for a few samples as one numpy array (tests only: the runtime
copies DALI's output into the ring, fusionflow/accel/accelerator.py)."""

import numpy as np


def run_numpy(pipe, samples, indices, seed: int = 0, epoch: int = 0, copies=None) -> np.ndarray:
    """`pipe.run(...)` (a fusionflow.accel.dali_graph.DaliPolicyPipeline) stacked into [N, C, H, W] on the host."""
    out = pipe.run(samples, indices, seed, epoch, copies)
    if pipe.device == "gpu":
        out = out.as_cpu()
    return np.stack([np.array(out[i]) for i in range(len(samples))])
