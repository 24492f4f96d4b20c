"""LoaderParts: what a FusionFlowLoader is made of besides its frozen configuration, built once at
construction. The loader holds them (`loader.parts`); the per-epoch iterators (loader/epoch.py) are
handed the parts and the configuration they run with, never the loader itself, and the SharedLoader
(shared/producer.py) reaches them through `loader.parts`: each part keeps one owner and nobody reads
the loader's private fields.

  stats       LoaderStats, `loader.stats`
  checkpoint  the epoch bookkeeping (set_epoch, state_dict, load_state_dict)
  delivery    on_error, batches out of the ring as tensors, the device
  tracing     the trace= file and `loader.trace(path)` blocks
  gpu         GpuSession with an accelerator (accel/session.py), else None
  runtime     LoaderRuntime: the workers, started at the first iteration, one shutdown procedure
  next_epoch  the next epoch's first mini-batches, speculated at an epoch's end

`held_epoch` starts an epoch for a SharedLoader, which drives the loader through its parts and
imports nothing of the loader package (it sits beside the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusionflow.loader.checkpoint import Checkpoint
from fusionflow.loader.dataset import wrap_samples
from fusionflow.loader.delivery import Delivery
from fusionflow.loader.epoch import WorkerIterator
from fusionflow.loader.lifecycle import LoaderRuntime
from fusionflow.loader.next_epoch import NextEpoch
from fusionflow.loader.stats import LoaderStats
from fusionflow.loader.trace import Tracing


@dataclass(frozen=True)
class LoaderParts:
    stats: LoaderStats
    checkpoint: Checkpoint
    delivery: Delivery
    tracing: Tracing
    gpu: Any  # accel.session.GpuSession, or None
    runtime: LoaderRuntime
    next_epoch: NextEpoch

    @classmethod
    def build(cls, cfg, dataset) -> LoaderParts:
        """The parts a resolved configuration (LoaderConfig) asks for, over `dataset` as given."""
        # the bridge's state from the start (the GPU session, its one writer, says "on" once it lends)
        stats = LoaderStats(memory_bridge=None if cfg.bridge_why_off is None else f"off: {cfg.bridge_why_off}")
        tracing = Tracing(cfg.trace_path)
        gpu = None
        if cfg.accelerator is not None:
            from fusionflow.accel.session import GpuSession

            gpu = GpuSession.for_config(stats, cfg)
        samples = wrap_samples(dataset, cfg.sample_keys, cfg.read_ahead)  # dict samples, reads ahead
        checkpoint = Checkpoint()
        return cls(
            stats=stats,
            checkpoint=checkpoint,
            # (with a collate_fn, its output is pinned instead, as DataLoader pins it: loader/epoch.py)
            delivery=Delivery(stats, cfg.device, cfg.pin_memory and cfg.collate is None, cfg.on_error),
            tracing=tracing,
            gpu=gpu,
            runtime=LoaderRuntime(samples, stats, tracing, gpu),
            next_epoch=NextEpoch(stats, checkpoint),
        )

    def held_epoch(self, config, slots):
        """The next epoch as a WorkerIterator on `config` over ring `slots` (a SlotPool), for a caller
        that holds delivered slots itself (shared/producer.py: batches stay in the ring until every
        client released them) and drives it with `wait_next` / `give_back`."""
        epoch, progress = self.checkpoint.begin()
        return WorkerIterator(self, config, epoch, progress, slots)
