"""RuntimeSpec: what the runtime needs of a loader's configuration, cut once and passed whole.

The loader resolves its arguments into a frozen LoaderConfig (loader/config.py); the runtime does not
know that class (it sits below the loader). `loader/lifecycle.py` cuts this spec from it when it
starts the runtime, and the LocalManager and its WorkerPool take the spec as one object instead of a
dozen unpacked parameters, so a setting travels down under one name (`pin_workers` stays
`pin_workers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusionflow.runtime.shm import RingLayout


@dataclass(frozen=True)
class RuntimeSpec:
    policy: Any  # the frozen Policy (None: a runtime that never augments, e.g. a board-only test)
    layout: RingLayout  # the batch ring: slots x capacity x the policy's output shape
    num_workers: int  # CPU worker processes
    seed: int  # the augmentation seed
    base_seed: int = 0  # the per-worker torch/random seeds derive from it (DataLoader's base_seed)
    worker_init_fn: Any = None  # called in each worker at its start, with its id
    mp_context: Any = None  # a multiprocessing context (None: the default one)
    pin_workers: bool | str = True  # True, False or "auto": workers pinned to cores claimed node-wide
    trainer_cores: int = 1  # cores the pinning claim leaves to the training process: 1, + DALI's threads
    max_retries: int = 2  # worker deaths a sample may cause before its mini-batch fails
    tiny_batch_size: int = 4  # samples per tiny-batch
    stages: tuple[str, ...] | None = None  # stage names workers time per sample, or None
    job: str | None = None  # the global manager's job (worker lending), or None
    cache: Any = None  # the loader's CacheAttachment (fusionflow/cache/attach.py): workers get handles, or None
