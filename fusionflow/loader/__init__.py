"""The loader: FusionFlowLoader, the DataLoader-compatible front, and the parts it holds.

  front.py       FusionFlowLoader: arguments, attributes, iteration, close; holds the parts below
  config.py      its arguments resolved once into a frozen LoaderConfig (errors name the value and fix)
  host.py        the accelerator, bridge, job and remote-worker arguments checked against the machine
                 (the machine itself, `Host`, and the device: runtime/host.py)
  dataset.py     the dataset as the loader reads it (streams refused, dict samples, read-ahead, adoption)
  lifecycle.py   the loader's runtime started at the first iteration, stopped by one procedure
  epoch.py       the per-epoch iterators (worker processes, or inline with num_workers=0)
  next_epoch.py  the next epoch's first mini-batches speculated at an epoch's end (persistent workers)
  delivery.py    a filled batch as the tensors an iteration yields (on_error, pinning, the device)
  checkpoint.py  epoch bookkeeping, state_dict / load_state_dict
  stats.py       LoaderStats (`loader.stats`)
  trace.py       the Chrome / Perfetto timeline (`trace=`, `loader.trace(path)`)

The loader drives `runtime/` (processes and IPC), `accel/` (the GPU path) and `remote/` (Ray
workers); none of them imports it back.
"""

from fusionflow.loader.front import FusionFlowLoader
from fusionflow.loader.parts import LoaderParts
from fusionflow.loader.stats import LoaderStats  # `loader.stats`'s type, importable from here as before

__all__ = ["FusionFlowLoader", "LoaderParts", "LoaderStats"]
