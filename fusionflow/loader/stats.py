"""LoaderStats: what a FusionFlowLoader did, for tuning and for the tests (`loader.stats`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import numpy as np

from fusionflow.runtime.counters import RuntimeCounters

# the cache's counters that count this loader's run (reset() starts them again); the others describe the cache
_CACHE_RUN = ("hits", "misses", "fills", "fill_bytes", "hit_seconds", "seconds_saved", "crop_hits")


class _FormerName:
    """A stats field's former name: reading it warns (DeprecationWarning) and reads the field; writing it
    raises (a write by the old name would otherwise be lost silently)."""

    def __init__(self, field_name: str, why: str):
        self.field_name, self.why = field_name, why

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        message = f"LoaderStats.{self.name} is deprecated: use {self.field_name} ({self.why})"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(obj, self.field_name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"LoaderStats.{self.name} is a deprecated, read-only name: set {self.field_name}")


@dataclass
class LoaderStats(RuntimeCounters):
    """What the loader did, for tuning and for the tests. Reset by `reset()`. The runtime's parts
    count into the fields of `RuntimeCounters` (fusionflow/runtime/counters.py: workers, lending,
    accelerator, remote workers); those declared here are what the loader itself measures or sets."""

    batches: int = 0
    samples: int = 0
    skipped: int = 0
    skipped_indices: list = field(default_factory=list)
    # on_error="skip": samples dropped per cause: "pixel_limit" (over decode.max_pixels), "corrupt"
    # (could not be decoded), "error" (anything else, e.g. the dataset raised)
    skipped_by_cause: dict = field(default_factory=dict)
    wait_seconds: list = field(default_factory=list)  # time blocked in next(), per batch (the newest 65-131k)
    startup_seconds: float | None = None  # worker start-up, first time
    accelerator_build_seconds: float | None = None
    taas_k: list = field(default_factory=list)  # tiny-batches reserved for the accelerator, per mini-batch (ditto)
    gpu_sharing: str | None = None  # what gpu_sharing="auto" chose, once profiled
    memory_bridge: str | None = None  # "on", or "off: <why>"
    bridge_lends: int = 0  # arenas of PyTorch's memory lent to DALI (one per accelerator start)
    bridge_max_lent_bytes: int = 0  # the largest arena lent
    bridge_max_borrowed_bytes: int = 0  # most bytes DALI had allocated from the arena at once
    bridge_fallback_bytes: int = 0  # bytes DALI took from its own pool while an arena was lent (they did not fit)
    bridge_pinned_bytes: int = 0  # lent bytes DALI still held when the arena was last given back
    bridge_seconds: float = 0.0  # time spent lending and taking back
    stage_ns: dict = field(default_factory=dict)  # stage_times=True: worker -> {stage: ns}, summed over samples
    # persistent workers: next-epoch mini-batches submitted before its iter(), then taken or discarded
    next_epoch_speculated: int = 0
    next_epoch_adopted: int = 0
    next_epoch_discarded: int = 0
    # the decoded-image cache (cache=): this loader's hits, misses, fills, fill_bytes, hit_seconds and
    # seconds_saved (the decodes its hits skipped, as measured when filled), crop_hits (samples whose kept
    # crop was reused: DecodedCache(reuse_crop_epochs)) since reset(); the cache's
    # entries, bytes, budget, refused (not admitted) and full, node-wide. Empty without a cache.
    cache: dict = field(default_factory=dict)

    # The two maxima were first named like totals, and the lends counted prep windows (until 2026-11-28, when
    # the bridge lent per window); the old names stay as read-only deprecated aliases.
    bridge_windows = _FormerName("bridge_lends", "arenas lent, one per accelerator start")
    bridge_lent_bytes = _FormerName("bridge_max_lent_bytes", "a maximum, not a total")
    bridge_borrowed_bytes = _FormerName("bridge_max_borrowed_bytes", "a maximum, not a total")

    def add_stage_times(self, names, worker, ns) -> None:
        """A task's per-stage totals from `worker` (the manager thread, under its lock)."""
        totals = self.stage_ns.setdefault(worker, dict.fromkeys(names, 0))
        for name, v in zip(names, ns):
            totals[name] += v

    def stage_seconds(self, worker=None) -> dict:
        """Seconds per stage summed over samples: of one worker, or of all workers (worker=None)."""
        out: dict = {}
        for w, totals in list(self.stage_ns.items()):
            if worker is None or w == worker:
                for name, v in list(totals.items()):
                    out[name] = out.get(name, 0.0) + v / 1e9
        return out

    def stage_shares(self, worker=None) -> dict:
        """Each stage's share of CPU pipeline time (largest first), e.g. {"decode+crop+resize": 0.48, ...}."""
        from fusionflow.ops.stages import shares

        return shares(self.stage_seconds(worker))

    def summary(self) -> dict:
        """Plain values for logging. The bridge maxima appear under their names and, deprecated, under
        the old ones (bridge_lent_bytes, bridge_borrowed_bytes) for readers of older summaries."""
        w = np.asarray(self.wait_seconds) if self.wait_seconds else np.zeros(1)
        return {
            "batches": self.batches,
            "samples": self.samples,
            "skipped": self.skipped,
            "skipped_by_cause": dict(self.skipped_by_cause),
            "wait_mean_ms": 1e3 * float(w.mean()),
            "wait_median_ms": 1e3 * float(np.median(w)),  # one long wait (a start-up, a pause) moves the mean only
            "wait_p95_ms": 1e3 * float(np.percentile(w, 95)),
            "tiny_batches_per_worker": list(self.tiny_batches_per_worker),
            "worker_restarts": self.worker_restarts,
            "workers_stuck": self.workers_stuck,
            "tiny_batches_rerun": self.tiny_batches_rerun,
            "reruns_won": self.reruns_won,
            "startup_seconds": self.startup_seconds,
            "accelerator_tiny_batches": self.accelerator_tiny_batches,
            "accelerator_runs": self.accelerator_runs,
            "accelerator_samples": self.accelerator_samples,
            "accelerator_feed_cpu_seconds": self.accelerator_feed_cpu_seconds,
            "accelerator_inputs_cpu_seconds": self.accelerator_inputs_cpu_seconds,
            "accelerator_land_cpu_seconds": self.accelerator_land_cpu_seconds,
            "accelerator_given_back": self.accelerator_given_back,
            "accelerator_builds": self.accelerator_builds,
            "accelerator_build_seconds": self.accelerator_build_seconds,
            "accelerator_out_of_memory": self.accelerator_out_of_memory,
            "accelerator_retired": self.accelerator_retired,
            "taas_k_last": self.taas_k[-1] if self.taas_k else None,
            "global_manager": self.global_manager,
            "workers_lent": self.workers_lent,
            "workers_borrowed": self.workers_borrowed,
            "lent_tiny_batches": self.lent_tiny_batches,
            "borrowed_tiny_batches": self.borrowed_tiny_batches,
            "memory_bridge": self.memory_bridge,
            "bridge_lends": self.bridge_lends,
            "bridge_windows": self.bridge_lends,
            "bridge_max_lent_bytes": self.bridge_max_lent_bytes,
            "bridge_max_borrowed_bytes": self.bridge_max_borrowed_bytes,
            "bridge_lent_bytes": self.bridge_max_lent_bytes,
            "bridge_borrowed_bytes": self.bridge_max_borrowed_bytes,
            "bridge_fallback_bytes": self.bridge_fallback_bytes,
            "bridge_pinned_bytes": self.bridge_pinned_bytes,
            "bridge_seconds": self.bridge_seconds,
            "stage_shares": self.stage_shares(),
            "remote_tiny_batches": self.remote_tiny_batches,
            "remote_workers_lost": self.remote_workers_lost,
            "remote_gateways_lost": self.remote_gateways_lost,
            "cache": dict(self.cache),
        }

    def watch_cache(self, counts) -> None:
        """`counts()`: the cache attachment's counters (fusionflow/cache/attach.py; None once it is
        closed), or None. A new attachment (the loader iterated again after close()) continues the
        counts: its own start at 0."""
        self.__dict__["_cache_counts"] = counts
        self.__dict__["_cache_base"] = {k: -v for k, v in self.cache.items() if k in _CACHE_RUN}
        self.refresh_cache()

    def refresh_cache(self) -> None:
        counts = self.__dict__.get("_cache_counts")
        now = counts() if counts is not None else None
        if now is None:
            return  # no cache, or closed: the last counts stay
        base = self.__dict__.get("_cache_base", {})
        self.cache = {k: v - base.get(k, 0) if k in _CACHE_RUN else v for k, v in now.items()}

    def __getstate__(self) -> dict:
        """Pickled and copied without the live cache's callback (a copy is a snapshot)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache_counts", "_cache_base")}

    def reset(self) -> None:
        """Every field back to its default (fresh lists and dicts), except what describes the loader's
        state rather than the run: startup_seconds (measured once), memory_bridge (on, or why off),
        global_manager (active / lost) and accelerator_retired (why, once retired)."""
        for f in dataclasses.fields(self):
            if f.name in ("startup_seconds", "memory_bridge", "global_manager", "accelerator_retired"):
                continue
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        counts = self.__dict__.get("_cache_counts")
        now = counts() if counts is not None else None
        if now is not None:
            self.__dict__["_cache_base"] = {k: v for k, v in now.items() if k in _CACHE_RUN}
            self.refresh_cache()
