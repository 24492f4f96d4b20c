"""What the runtime counts, in one object handed once to the parts that count.

The loader passes its `LoaderStats` (fusionflow/loader/stats.py: a subclass that adds what the loader
itself measures); a manager built without one (tests, tools) gets a `RuntimeCounters`. Each field is
declared once, here or there. Every part increments the same object directly, from its own
thread: the CPU worker pool, the lending agent, the accelerator, the remote workers -- under the
board's lock, except the accelerator's pipeline builds and out-of-memory counts, which only its
own thread writes. Counts go on
across managers (a loader without persistent workers builds one per epoch) because the object does;
`tiny_batches_per_worker` too, by worker id (until session 47 it started again with each manager: without
persistent workers it held the last epoch's counts beside the whole run's batches and samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SERIES_MAX = 1 << 17  # a per-batch series keeps its newest entries, at most this many (~4 MB of floats)


def append_bounded(series: list, value) -> None:
    """`series.append(value)`, keeping a per-batch series (stats' wait_seconds, taas_k) bounded in a long run:
    past SERIES_MAX entries its older half is dropped (amortised O(1); it stays a list: indexing, slicing). A
    90-epoch ImageNet run at batch 32 appended 3.6 million waits, ~120 MB, for the loader's life."""
    series.append(value)
    if len(series) > SERIES_MAX:
        del series[: len(series) - SERIES_MAX // 2]


@dataclass
class RuntimeCounters:
    tiny_batches_per_worker: list = field(default_factory=list)  # by worker id, over the whole run
    worker_restarts: int = 0  # CPU workers replaced after they died
    workers_stuck: int = 0  # CPU workers killed for making no progress (runtime/liveness.py), then replaced
    tiny_batches_rerun: int = 0  # straggling tiny-batches started again on an idle worker (runtime/reruns.py)
    reruns_won: int = 0  # of those, the ones whose second copy finished first (the first's worker was stopped)
    accelerator_tiny_batches: int = 0  # run by the DALI accelerator worker
    accelerator_runs: int = 0  # its DALI runs that produced them (one run: tiny-batches of one or two mini-batches)
    accelerator_samples: int = 0  # samples those runs produced
    accelerator_feed_cpu_seconds: float = 0.0  # CPU time of the training process's accelerator thread
    accelerator_inputs_cpu_seconds: float = 0.0  # CPU time of its input helper processes (accel/input_helpers.py)
    accelerator_land_cpu_seconds: float = 0.0  # of the thread's, landing DALI's outputs in the ring (host copy on CPU)
    accelerator_given_back: int = 0  # handed to the CPU workers (undecodable by DALI, or not bytes)
    # DALI pipeline builds (AoT: 1 a loader -- a runtime runs the pipeline the last one left idle (accel/session.py)
    # --, +1 after each failed run or a retirement; one per run without)
    accelerator_builds: int = 0
    accelerator_out_of_memory: int = 0  # DALI runs out of memory (their tiny-batches went to the CPU workers)
    accelerator_retired: str | None = None  # why the accelerator stopped taking work (repeated failures)
    global_manager: str | None = None  # "active", "lost" (its GM died: own workers only) or None (off)
    workers_lent: int = 0  # times one of this loader's idle workers was lent to another loader (rank)
    workers_borrowed: int = 0  # workers of other loaders that served this one
    lent_tiny_batches: int = 0  # tiny-batches this loader's workers ran for others (counted when they are home)
    borrowed_tiny_batches: int = 0  # tiny-batches of this loader that borrowed workers ran
    worker_count_changes: int = 0  # elastic resizes applied (GlobalManagerClient.set_workers)
    remote_tiny_batches: int = 0  # run by remote (Ray) CPU workers (remote_workers=RayWorkers(...))
    remote_workers_lost: int = 0  # Ray workers that died or whose node left (their tiny-batches re-ran)
    remote_gateways_lost: int = 0  # Ray gateway processes that died (their tiny-batches re-ran locally)


def count_stuck_kill(counters) -> None:
    """A worker (own or lent to this loader) killed for making no progress or stopping mid-message:
    the local manager's stuck bound, the pool's and the lending agent's mid-message bound count here."""
    counters.workers_stuck += 1


def count_worker_task(counters, worker_id: int) -> None:
    """One more tiny-batch done by own worker `worker_id` (the list grows as the pool does)."""
    per = counters.tiny_batches_per_worker
    if worker_id >= len(per):
        per.extend([0] * (worker_id + 1 - len(per)))
    per[worker_id] += 1
