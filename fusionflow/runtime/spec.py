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

import torch

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


def base_seed(generator=None) -> int:
    """The draw DataLoader makes as an iterator starts (from the loader's generator, else torch's global RNG),
    made by every epoch's iterator at that point, before the sampler's: the order is DataLoader's whatever
    num_workers and persistent_workers (DataLoader's persistent workers draw once, so from its second epoch
    its order differs from its own without them), and a state resumes in a loader of either kind. Drawn at the
    epoch's first next() (FusionFlow's iterators start lazily), where DataLoader draws it at iter(): RNG draws made
    between the two (two loaders zipped) come in another order than DataLoader's."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def next_base_seed(generator=None) -> int:
    """The base seed the next iteration will draw, drawn from a copy (the RNG is left as it was): for a runtime
    started ahead of its first epoch (a SharedLoader's), so the epochs' own draws stay the iterators'."""
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    return base_seed(torch.Generator().set_state(state))
