"""What the runtime counts, in one object handed once to the parts that count.

The loader passes its `LoaderStats` (it has these fields, among others); a manager built without one
(tests, tools) gets a `RuntimeCounters`. Every part increments the same object directly, from its own
thread: the CPU worker pool, the lending agent, the accelerator, the remote workers -- under the
board's lock, except the accelerator's pipeline builds and out-of-memory counts, which only its
own thread writes. Counts go on
across managers (a loader without persistent workers builds one per epoch) because the object does;
`tiny_batches_per_worker` is per worker id of the current manager and starts again with each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RuntimeCounters:
    worker_restarts: int = 0  # CPU workers replaced after they died
    worker_count_changes: int = 0  # elastic resizes applied
    tiny_batches_per_worker: list = field(default_factory=list)  # by worker id, this manager's workers
    workers_lent: int = 0  # own idle workers lent to another loader
    workers_borrowed: int = 0  # other loaders' workers that served this one
    lent_tiny_batches: int = 0  # tiny-batches own workers ran for others (counted when they are home)
    borrowed_tiny_batches: int = 0  # tiny-batches borrowed workers ran here
    global_manager: str | None = None  # "active", "lost" (it died: own workers only) or None (no GM)
    accelerator_tiny_batches: int = 0
    accelerator_given_back: int = 0  # handed to the CPU workers
    accelerator_builds: int = 0  # DALI pipeline builds
    accelerator_out_of_memory: int = 0
    accelerator_retired: str | None = None  # why the accelerator stopped taking work


def count_worker_task(counters, worker_id: int) -> None:
    """One more tiny-batch done by own worker `worker_id` (the list grows as the pool does)."""
    per = counters.tiny_batches_per_worker
    if worker_id >= len(per):
        per.extend([0] * (worker_id + 1 - len(per)))
    per[worker_id] += 1
