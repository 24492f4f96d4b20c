"""The decoded-image cache (`FusionFlowLoader(cache=...)`): decoded samples kept at a bounded resolution
in memory shared by every loader on the node over the same dataset, so later epochs skip the decode.

  config.py  `cache=` and `DecodedCache`, checked when the loader is built
  store.py   the shared segment: entries, admission, per-worker counters, the record lock
  keeper.py  the process that owns a node's cache, and how loaders find it
  attach.py  a loader's attachment (opened at its runtime's start, closed with the loader)
  reader.py  a process's lookups and fills (`CacheReader`, the CpuPipeline's `cache=`)
  crops.py   refurbishing (`reuse_crop_epochs`): each sample's crop kept for the epochs that reuse it
The pipeline's side (read, fill, crop from the cached image) is fusionflow/ops/cached.py.
"""

from fusionflow.cache.config import DecodedCache

__all__ = ["DecodedCache"]
