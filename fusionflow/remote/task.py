"""What runs on a remote node: the Ray actor's body for remote/kind.py's worker kind. It holds the
dataset and a CpuPipeline and runs a local CPU worker's per-sample code (fusionflow/runtime/sample.py), so a
tiny-batch's bytes are the same wherever it runs; it returns them instead of writing shared memory."""

from __future__ import annotations

import time
import traceback

import numpy as np


class RemoteTask:
    """The body of the Ray actor (wrapped with ray.remote by `actor_class`): a local CPU worker's
    tiny-batch code, returning its output instead of writing into shared memory."""

    def __init__(self, dataset, policy, seed: int, seeding: tuple, worker_init_fn=None, stages=None, cache_side=None):
        """`seeding`: (base_seed, worker id, num_workers), as a local worker's (its RNGs and torch's worker info,
        then `worker_init_fn`); `stages`: the stage names to time per sample (fusionflow/ops/stages.py), or None;
        `cache_side`: the loader's decoded-image cache's max_side (its rendering, without its store), or None."""
        from fusionflow.ops.cached import CacheRendering
        from fusionflow.ops.pipeline import CpuPipeline
        from fusionflow.runtime.worker import seed_as_dataloader

        self.dataset, self.seed = dataset, seed
        self.pipe = CpuPipeline(policy, cache=CacheRendering(cache_side) if cache_side is not None else None)
        self.clock = None
        if stages:
            from fusionflow.ops.stages import StageClock

            self.clock = StageClock(stages)
        seed_as_dataloader(*seeding, dataset)
        if worker_init_fn is not None:
            worker_init_fn(seeding[1])

    def probe(self, index: int) -> dict:
        """Where this actor runs, and whether it can read sample `index` there (None: yes)."""
        import os
        import socket

        from fusionflow.runtime.sample import describe, split_item

        error = None
        try:
            split_item(self.dataset[index], index)
        except Exception as exc:
            error = f"{describe(self.dataset, index)}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        return {"host": socket.gethostname(), "pid": os.getpid(), "error": error}

    def run(self, epoch: int, positions, indices, copies):
        """(images [n, *out_shape], targets, failures, seconds): a local worker's per-sample body
        (fusionflow/runtime/sample.py run_sample) into a local array; failed samples' rows are undefined and
        their targets None; failures carry their ring positions, as a local worker reports them."""
        import dataclasses

        from fusionflow.runtime.sample import run_samples

        t0 = time.perf_counter()
        n = len(indices)
        out = np.empty((n, *self.pipe.out_shape), self.pipe.out_dtype)
        ints, side = np.zeros(n, np.int64), {}
        found = run_samples(self.dataset, self.pipe, range(n), indices, copies, self.seed, epoch, out, ints, side,
                            self.clock)  # fmt: skip
        failures = [dataclasses.replace(f, position=positions[f.position]) for f in found]
        bad = {f.position for f in failures}
        labels = [None if pos in bad else side.get(k, int(ints[k])) for k, pos in enumerate(positions)]
        return out, labels, failures, time.perf_counter() - t0

    def run_many(self, units):
        """`run` for each (epoch, positions, indices, copies) of one call (Ray's cost is per call), and
        the call's per-stage totals (() without stage timing)."""
        results = [self.run(*unit) for unit in units]
        return results, self.clock.take() if self.clock is not None else ()


def actor_class(ray):
    return ray.remote(RemoteTask)
