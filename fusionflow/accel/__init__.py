"""The GPU path, one wing: everything that runs DALI or touches the device for the accelerator.

  config.py       DaliAccelerator: the accelerator's settings as one frozen, checked object (no torch, no DALI)
  session.py      GpuSession: the loader's side of the accelerator (start, TAAS's K, prep windows,
                  delivery of mini-batches made partly on the GPU)
  accelerator.py  AcceleratorWorker: the DALI worker kind on the loader's board (its pipeline thread)
  host_inputs.py  the runs' draws as dense columns
  input_helpers.py  the helper processes that make them (and read the runs: helper_reads.py; run_read.py where
                  they cannot), given up when dead, stopped or silent, never waited for past the run's stall bound
  device_ring.py  the accelerator's half of the batch ring in device memory; streams and events
  dali_graph.py   a policy as one prebuilt DALI pipeline (decode+crop, resize, flip, op slots)
  dali_ops.py     each registered op as a DALI graph fragment
  declines.py     which policies the DALI graph cannot run (importable without DALI)
  bridge/         the allocator bridge: one arena of PyTorch's GPU memory lent to DALI

It builds on `runtime/` (the board a worker kind joins) and `ops/`/`policy/`; the loader imports it,
never the reverse.
"""

from fusionflow.accel.config import DaliAccelerator  # no torch, no DALI: the settings object only

__all__ = ["DaliAccelerator"]
