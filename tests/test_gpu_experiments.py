"""The experiments' bookkeeping, checked without a GPU: the GPU scripts' warm-ups, trials and imports
(experiments/gpu_bench.py, gpu_memory.py), the shared harness (experiments/harness.py), paired runs
across trees of any age (paired_trees.py), and the package's rules: every script runs as
`python -m experiments.<name>`, touches no sys.path and uses no private name of fusionflow."""

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

from experiments import gpu_bench, gpu_memory, harness, paired_trees
from fusionflow.accel.sharing_profiler import PROFILE_BATCHES, SharingProfiler

EXPERIMENTS = Path(harness.__file__).resolve().parent


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
    import inspect

    tree = ast.parse(inspect.getsource(gpu_memory))
    names = [
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "experiments.gpu_bench"
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


def test_rounds_warm_up_then_interleave_and_rotation_alternates_two():
    calls = []
    values = harness.rounds({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, 2)
    assert calls == ["a", "b", "a", "b", "a", "b"] and values == {"a": [1, 1], "b": [2, 2]}
    calls.clear()
    harness.rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, warmup=False, rotate=True)
    assert calls == ["a", "b", "b", "a"]
    assert [harness.rotation("xyz", r) for r in range(4)] == [list("xyz"), list("yzx"), list("zxy"), list("xyz")]


def test_provenance_names_the_module_command_and_the_commit(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXPERIMENTS / "bench_loader.py"), "--images", "8", "--out", "a b.json"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", types.SimpleNamespace(name="experiments.bench_loader"))
    p = harness.provenance()
    assert p["command"] == "python -m experiments.bench_loader --images 8 --out 'a b.json'"
    assert set(p) == {"command", "date", "machine", "git_commit"} and p["machine"]["cores"]


def test_paired_trees_runs_each_tree_its_own_way(tmp_path):
    """A tree whose experiments/ is a package runs its bench as a module; an older tree, whose scripts
    put their tree on sys.path, runs the script file (each with cwd = its tree)."""
    old, new = tmp_path / "old", tmp_path / "new"
    for tree in (old, new):
        (tree / "experiments").mkdir(parents=True)
        (tree / "experiments" / "bench_loader.py").write_text("")
    (new / "experiments" / "__init__.py").write_text("")
    assert paired_trees.bench_command(str(old), "bench_loader") == [
        sys.executable,
        str(old / "experiments" / "bench_loader.py"),
    ]
    assert paired_trees.bench_command(str(new), "bench_loader") == [sys.executable, "-m", "experiments.bench_loader"]
    assert all((EXPERIMENTS / f"{bench}.py").is_file() for bench, _ in paired_trees.BENCHES.values())


def test_the_loader_summary_has_one_owner():
    from experiments import bench_loader
    from fusionflow.tools import bench

    assert bench_loader.summarize is bench.summarize
    row = bench.summarize({"x": [3.0, 1.0, 2.0]}, {"x": [0.01, 0.03]}, unit="img_per_s")["x"]
    assert row["img_per_s_median"] == 2.0 and row["img_per_s"] == [3.0, 1.0, 2.0]
    assert abs(row["wait_mean_ms"] - 20.0) < 1e-9 and 20.0 < row["wait_p95_ms"] <= 30.0


def test_bench_graph_times_both_graphs_at_each_run_size(tmp_path):
    """experiments/bench_graph.py, the step `gpu_run.sh graph` runs on a GPU, here on DALI's CPU backend: both
    graphs timed at the run size asked, ours with its node count, and with --classic ours on DALI's classic
    executor too (refused on a GPU)."""
    import json

    import pytest

    pytest.importorskip("nvidia.dali")
    out = tmp_path / "graph.json"
    args = ["--tiny", "--batch-sizes", "4", "--rounds", "1", "--images", "8", "--out", str(out), "--classic"]
    subprocess.run([sys.executable, "-m", "experiments.bench_graph", *args], cwd=EXPERIMENTS.parent, check=True)
    med = json.loads(out.read_text())["batch_sizes"]["4"]["medians"]
    assert med["dali"]["img_per_s"] > 0 and med["ours"]["img_per_s"] > 0 and med["ours_classic"]["img_per_s"] > 0
    assert med["classic_over_ours_thread_cpu"] > 0
    refused = subprocess.run(
        [sys.executable, "-m", "experiments.bench_graph", "--classic", "--device", "cuda"],
        cwd=EXPERIMENTS.parent,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "classic executor" in refused.stderr
    from fusionflow import load_policy
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    with DaliPolicyPipeline(load_policy("randaugment", size=16), batch_size=4) as pipe:
        assert med["ours"]["graph_nodes"] == pipe.graph_nodes


def test_dali_memory_fits_the_growth_per_sample_and_measures_one_run_size_in_a_process():
    """experiments/dali_memory.py (the arena's calibration): its least-squares line is exact on a line, and one
    run size on DALI's CPU backend, in a process of its own (a peak's growth means nothing in the suite's), reports
    what the build and the runs took."""
    import json

    import pytest

    from experiments import dali_memory

    assert dali_memory.slope([32, 64, 128], [100 + 3 * x for x in (32, 64, 128)]) == pytest.approx((3.0, 100.0))
    pytest.importorskip("nvidia.dali")
    # its own process, and 32 samples: a peak's growth is measured past what the imports already reached
    one = [sys.executable, "-m", "experiments.dali_memory", "--one", "32", "--runs", "2"]
    out = subprocess.run(one, cwd=EXPERIMENTS.parent, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert row["run"] == 32 and row["build_bytes"] >= 0 and row["run_growth_bytes"] > 0  # DALI took memory to run


def test_ours_batches_are_the_runs_in_order_each_as_the_pipeline_makes_it():
    """gpu_bench's `ours` variant trains on ours_batches: run b of the cyclic order, labels its indices, pixels
    those of the same run submitted alone (runs in flight change no sample), the last run collected too; while
    the consumer holds a batch, the pipeline's depth of runs is in flight (DALI alone's prefetch queue)."""
    import pytest

    pytest.importorskip("nvidia.dali")
    import torch

    from fusionflow import load_policy
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.tools.synthetic import make_jpegs

    data = make_jpegs(5, 24, 40, seed=3)
    with DaliPolicyPipeline(load_policy("randaugment", size=16), batch_size=3) as pipe:
        host = gpu_bench.host_columns(pipe, data, 3)
        assert len(host) == 5  # the cycle: 5 runs of 3 cover the 5 samples 3 times
        got, held = [], []
        for batch in gpu_bench.ours_batches(pipe, data, host, 3, 7, torch.device("cpu")):
            got.append(batch)
            held.append(pipe.in_flight)  # the consumer trains on batch b now
        assert len(got) == 7 and held == [2, 2, 2, 2, 2, 1, 0] and pipe.depth == 2
        for b, (x, y) in enumerate(got):
            idx = [(3 * b + j) % 5 for j in range(3)]
            assert y.tolist() == idx and x.shape == (3, 3, 16, 16)
            pipe.submit([data[i] for i in idx], idx, columns=host[b % 5])
            alone, _ = gpu_bench.land_batch(pipe.collect(), idx, torch.device("cpu"))
            assert torch.equal(x, alone), b


def _scripts():
    return [p for p in sorted(EXPERIMENTS.glob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]


def test_every_script_says_how_to_run_it_as_a_module():
    scripts = _scripts()
    assert len(scripts) >= 15
    wrong = [
        p.name for p in scripts if f"python -m experiments.{p.stem}" not in ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not wrong, f"their docstrings do not say `python -m experiments.<name>`: {wrong}"


def test_no_experiment_touches_sys_path_or_a_private_fusionflow_name():
    """Scripts run as modules of the package (no sys.path edits), and use fusionflow's public names only:
    nothing imported from it starts with _, nor any attribute read off anything but `self` (a module of
    fusionflow, a loader, ...)."""
    offenders = []
    for path in sorted(EXPERIMENTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fusionflow":
                offenders += [f"{where} imports {a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "sys" and node.attr == "path":
                    offenders.append(f"{where} sys.path")
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                if private and node.value.id != "self":  # a fusionflow module's or object's private name
                    if f"{node.value.id}.{node.attr}" not in NOT_FUSIONFLOWS.get(path.name, ()):
                        offenders.append(f"{where} {node.value.id}.{node.attr}")
    assert not offenders, offenders


# private names of other packages an experiment needs, by script: dali_tv_api.py works around DALI 2.4 asking
# torch.cuda for a stream when fed a CPU tensor (raises where torch is a CUDA build without a GPU)
NOT_FUSIONFLOWS = {"dali_tv_api.py": ("types._get_default_stream_for_array",)}


def test_the_twins_device_clock_fills_gaps_with_later_work_keeps_a_streams_order_and_forgets_the_past(monkeypatch):
    """twin_gpu.DeviceClock: work that may not start yet leaves the time before it to work issued later; work
    that names its stream's last end as not_before comes after it even where an earlier gap would fit."""
    from experiments import twin_gpu

    now = [100.0]
    monkeypatch.setattr(twin_gpu.time, "monotonic", lambda: now[0])
    clock = twin_gpu.DeviceClock()
    dali = clock.occupy(1.0, not_before=105.0)  # a DALI run whose host stages end at 105: [105, 106]
    step = clock.occupy(2.0)  # a training step issued after it fits before it: [100, 102]
    long = clock.occupy(4.0)  # no room before 105 for 4 s: after the run, [106, 110]
    assert (dali, step, long) == (106.0, 102.0, 110.0)
    assert clock.occupy(0.5, not_before=dali) == 110.5  # the same stream's next run: not in [102, 105]
    assert clock.occupy(0.5) == 102.5  # anyone else's half second: the gap
    now[0] = 200.0  # everything ended: the past is forgotten, work starts now
    assert clock.occupy(1.0) == 201.0 and clock.busy == 9.0


def test_a_run_beside_training_delays_it_only_by_its_part_in_the_way_and_completes_after_its_whole_time(monkeypatch):
    """twin_gpu.DeviceClock.run with overlap: of a DALI run's device time only (1 - overlap) occupies the timeline
    (training's steps queue behind that part), while the run itself completes after all of it."""
    from experiments import twin_gpu

    now = [100.0]
    monkeypatch.setattr(twin_gpu.time, "monotonic", lambda: now[0])
    clock = twin_gpu.DeviceClock()
    assert clock.run(4.0, not_before=0.0, overlap=0.75) == 104.0  # in the way for 1 s, done after 4
    assert clock.occupy(2.0) == 103.0  # training's step waits for the 1 s in its way only
    assert clock.run(2.0, not_before=0.0) == 105.0  # no overlap: all of it in the way, after the step


def test_the_twins_pipeline_takes_what_the_accelerator_passes_the_real_one():
    """The twin's stand-in for DaliPolicyPipeline has the real one's submit and collect parameters: a parameter
    added to the real one (session 32's `keep`) once failed every twin run, which then measured the CPU
    workers alone as "FF CPU + twin"."""
    import inspect

    pytest.importorskip("nvidia.dali")
    from experiments import twin_gpu
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    twin = twin_gpu.timed_pipeline(twin_gpu.DeviceClock(), 0.0, 0.0, [])
    for name in ("submit", "collect"):
        real_params = list(inspect.signature(getattr(DaliPolicyPipeline, name)).parameters)
        assert list(inspect.signature(getattr(twin, name)).parameters) == real_params, name
