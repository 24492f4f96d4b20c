"""Pure scheduling logic: no processes, no clocks, no I/O. Unit-tested exhaustively."""

from fusionflow.scheduling.tiny_batches import TinyBatch, split_sorted

__all__ = ["TinyBatch", "split_sorted"]
