"""The GPU experiments' bookkeeping, checked without a GPU (experiments/gpu_bench.py, gpu_memory.py)."""

import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import gpu_bench  # noqa: E402
import gpu_memory  # noqa: E402

from fusionflow.accel.accelerator import PROFILE_BATCHES, SharingProfiler  # noqa: E402


def test_auto_sharing_profiles_inside_the_warm_up(monkeypatch):
    """gpu_sharing='auto' chooses after timing PROFILE_BATCHES iterations per mode; the benchmark's
    warm-up covers them, so no profiling iteration is timed."""
    accel = types.SimpleNamespace(sharing="temporal", device_ring=types.SimpleNamespace(index=0))
    prof = SharingProfiler(accel)
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    ticks = 0
    while prof.chosen is None:
        prof.tick()
        ticks += 1
    assert ticks <= gpu_bench.ff_warmup(0, profiling=True) == 2 * PROFILE_BATCHES + 2
    assert gpu_bench.ff_warmup(8, profiling=False) == 8


def test_a_trial_whose_dali_fell_back_is_not_comparable():
    ok = dict(accelerator_tiny_batches=40, accelerator_out_of_memory=0, accelerator_retired=None)
    assert gpu_memory.ff_outcome(ok) == {"ok": True}
    oom = gpu_memory.ff_outcome({**ok, "accelerator_out_of_memory": 4, "accelerator_retired": "4 in a row failed"})
    assert oom["ok"] is False and oom["oom"] is True and oom["fell_back"]
    never = gpu_memory.ff_outcome({**ok, "accelerator_tiny_batches": 0})
    assert never["ok"] is False and never["oom"] is False and "fell back" in never["error"]


def test_a_hung_trial_is_recorded_not_raised(monkeypatch):
    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], stderr=b"still decoding")

    monkeypatch.setattr(gpu_memory.subprocess, "run", hang)
    args = types.SimpleNamespace(data="/nowhere", workers=1, gpu_gb=0.0, cpu_smoke=True, trial_timeout=7)
    res = gpu_memory.spawn(args, "ff_bridge_on", 64, 2, 1)
    assert res["ok"] is False and res["timeout"] and not res["oom"]
    assert "--trial-timeout=7" in res["error"] and "still decoding" in res["error"]


def test_every_name_the_gpu_scripts_import_from_each_other_exists():
    """gpu_memory.py imports its trial's helpers from gpu_bench.py inside a function (a trial runs in
    its own process): a helper renamed in gpu_bench once broke every trial on the first GPU run,
    unnoticed on CPUs. Read the imports from the source and check each name."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(gpu_memory))
    names = [
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "gpu_bench"
        for a in node.names
    ]
    assert "train_rate" in names and "dali_batches" in names
    assert [n for n in names if not hasattr(gpu_bench, n)] == []


def test_timed_window_helpers():
    """The warm-up drains a loader's buffer (twice its depth); a repeated dataset holds references,
    not copies, and at least the batches asked for."""
    assert gpu_bench.drain_warmup(5, 8) == 21
    data = [b"a" * 10, b"b" * 20, b"c" * 30]
    ep = gpu_bench.epoch_of(data, batches=5, batch_size=4)
    assert len(ep) >= 20 and len(ep) % 3 == 0 and all(x is data[i % 3] for i, x in enumerate(ep))
    assert gpu_bench.epoch_of(data, batches=1, batch_size=2) == data
