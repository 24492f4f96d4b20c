"""fusionflow/loader/config.py: FusionFlowLoader's arguments -> a frozen LoaderConfig, as tables.

Each row: the arguments that differ from FusionFlowLoader's defaults, what the machine looks like
(a stand-in Host: no CUDA, no DALI, 4 cores unless the row says otherwise), and the resolved values
or the exact error type and a fragment of its message.
"""

import dataclasses
import inspect
import os

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, default_collate

from fusionflow.loader import FusionFlowLoader
from fusionflow.loader.config import LoaderConfig, resolve_config
from fusionflow.runtime.host import Host

DATA = [(b"\xff\xd8 not decoded at construction", i % 3) for i in range(10)]
DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(FusionFlowLoader.__init__).parameters.items()
    if name not in ("self", "dataset")
}
CPU_HOST = dict(
    cores=lambda: 4,
    cuda_available=lambda: False,
    current_device=lambda: 0,
    device_count=lambda: 0,
    has_dali=lambda: False,
    job_key=lambda: None,
)
GPU = dict(cuda_available=lambda: True, current_device=lambda: 1, device_count=lambda: 2)
DALI = dict(GPU, has_dali=lambda: True)


def resolve(kwargs, host=None, dataset=DATA):
    notes = []
    cfg = resolve_config(dataset, **{**DEFAULTS, **kwargs}, host=Host(**{**CPU_HOST, **(host or {})}), notes=notes)
    return cfg, notes


def collate_list(batch):
    return batch


RESOLVED = [
    # (arguments, host, expected values)
    (
        {},
        None,
        dict(
            capacity=1,
            tiny_batch_size=1,
            prefetch_factor=2,
            seed=None,
            seed_given=False,
            device=torch.device("cpu"),
            accelerator=None,
            gpu_sharing="auto",
            job=None,
            bridge_why_off="no DALI GPU accelerator",
            collate=None,
            pin_memory=False,
            stage_names=None,
            trace_path=None,
        ),
    ),
    (dict(batch_size=8), None, dict(capacity=8, tiny_batch_size=4, batch_size=8)),
    # a batch_size above what torch's sampler yields (10 samples): shared memory for those, batch_size as given
    (dict(batch_size=32), None, dict(capacity=10, tiny_batch_size=4, batch_size=32)),
    (dict(batch_size=10**12, shuffle=True), None, dict(capacity=10, batch_size=10**12)),
    (dict(batch_size=32, sampler=[0, 1, 2]), None, dict(capacity=32)),  # a sampler of its own: its len() unknown
    # a tiny-batch size is checked against the batch size given, then held within the rows
    (dict(batch_size=32, tiny_batch_size=8), None, dict(capacity=10, tiny_batch_size=8)),
    (dict(batch_size=32, tiny_batch_size=16), None, dict(capacity=10, tiny_batch_size=10)),
    # beside a batch_sampler its batch_size (a state's shape and a shared producer's batch size keep it)
    (dict(batch_sampler=BatchSampler(SequentialSampler(range(10)), 4096, False)), None, dict(capacity=4096)),
    (dict(batch_size=32, tiny_batch_size=8), None, dict(tiny_batch_size=8)),
    (
        dict(batch_sampler=BatchSampler(SequentialSampler(range(10)), 5, False)),
        None,
        dict(capacity=5, tiny_batch_size=4, batch_size=None),
    ),  # batch_size None beside a batch_sampler, as DataLoader's
    (dict(num_workers=2, prefetch_factor=3), None, dict(prefetch_factor=3)),
    (dict(seed=7), None, dict(seed=7, seed_given=True)),
    (dict(generator=torch.Generator().manual_seed(5)), None, dict(seed=None, seed_given=False)),
    (dict(num_workers=2), dict(job_key=lambda: "torchrun:x"), dict(job="torchrun:x")),
    (dict(num_workers=2, global_manager="train"), None, dict(job="train")),
    (dict(num_workers=0, global_manager="train"), None, dict(job=None)),  # no workers: nothing to lend
    (dict(num_workers=2, global_manager=None), dict(job_key=lambda: "torchrun:x"), dict(job=None)),
    (dict(device="cuda"), GPU, dict(device=torch.device("cuda", 1))),  # the current device, fixed now
    (dict(device="cuda:0"), GPU, dict(device=torch.device("cuda", 0))),
    (dict(device="cuda", accelerator="auto", num_workers=1), DALI, dict(accelerator="dali-gpu", bridge_why_off=None)),
    (dict(device="cuda", accelerator="auto", num_workers=1), GPU, dict(accelerator=None)),  # no DALI
    (dict(accelerator="auto"), dict(has_dali=lambda: True), dict(accelerator=None)),  # on the CPU: none
    (dict(device="cuda", accelerator="auto", gpu_sharing="off", num_workers=1), DALI, dict(accelerator=None)),
    (dict(device="cuda", accelerator="dali-gpu", gpu_sharing="off", num_workers=1), DALI, dict(accelerator=None)),
    (
        dict(accelerator="dali-cpu", num_workers=1),
        DALI,
        dict(accelerator="dali-cpu", bridge_why_off="no DALI GPU accelerator"),
    ),
    (
        dict(device="cuda", accelerator="dali-gpu", num_workers=1, memory_bridge="on"),
        DALI,
        dict(gpu_sharing="auto", bridge_why_off=None, memory_bridge="on"),  # either sharing mode: left as given
    ),
    (
        dict(device="cuda", accelerator="dali-gpu", num_workers=1, gpu_sharing="spatial"),
        DALI,
        dict(gpu_sharing="spatial", bridge_why_off=None),  # the arena serves spatial sharing too
    ),
    (
        dict(device="cuda", accelerator="dali-gpu", num_workers=1, memory_bridge="off"),
        DALI,
        dict(gpu_sharing="auto", bridge_why_off="memory_bridge='off'"),
    ),
    (dict(collate_fn=default_collate), None, dict(collate=None, collate_fn=default_collate)),
    (dict(collate_fn=collate_list), None, dict(collate=collate_list)),
    (dict(pin_memory=True), GPU, dict(pin_memory=True)),
    (dict(pin_memory=True, device="cuda"), GPU, dict(pin_memory=False)),  # delivered on the GPU: nothing to pin
    (dict(stage_times=True), None, dict(stage_names=("read", "decode+crop+resize", "flip", "write"))),
    (dict(timeout=np.int64(30)), None, dict(timeout=30)),  # NumPy numbers, as DataLoader takes them
    (dict(timeout=np.float32(2.5)), None, dict(timeout=2.5)),
    # numpy's integers as counts and seeds, held as ints (num_workers=np.int64(2) was refused: DataLoader takes it)
    (
        dict(num_workers=np.int64(1), batch_size=np.int32(4), seed=np.uint32(7), prefetch_factor=np.int64(3)),
        None,
        dict(num_workers=1, batch_size=4, seed=7, prefetch_factor=3),
    ),
    (
        dict(batch_size=4, tiny_batch_size=np.int64(2), max_retries=np.int16(1)),
        None,
        dict(tiny_batch_size=2, max_retries=1),
    ),
]


@pytest.mark.parametrize("kwargs,host,expected", RESOLVED)
def test_resolved_values(kwargs, host, expected):
    cfg, notes = resolve(kwargs, host)
    assert isinstance(cfg, LoaderConfig)
    assert {k: getattr(cfg, k) for k in expected} == expected
    counts = ("num_workers", "batch_size", "seed", "prefetch_factor", "tiny_batch_size", "max_retries")
    assert all(type(getattr(cfg, k)) is int for k in counts if expected.get(k) is not None)  # not numpy's
    assert notes == []


ERRORS = [
    # (arguments, host, error type, message fragment)
    (dict(collate_fn=3), None, TypeError, "collate_fn=3 must be callable"),
    (dict(num_workers=-1), None, ValueError, "num_workers=-1 must be an integer >= 0"),
    (dict(num_workers=True), None, ValueError, "num_workers=True must be an integer >= 0"),
    (
        dict(batch_size=4, batch_sampler=BatchSampler(SequentialSampler(range(10)), 5, False)),
        None,
        ValueError,
        "batch_sampler is mutually exclusive with batch_size",
    ),
    (dict(batch_sampler=iter([[0, 1]])), None, ValueError, "a one-pass iterator"),
    (dict(batch_sampler=[[]]), None, ValueError, "yields no non-empty batch"),
    (dict(batch_size=0), None, ValueError, "batch_size=0 must be an integer >= 1"),
    (dict(batch_size=None), None, ValueError, "batch_size=None must be an integer >= 1"),
    (
        dict(sampler=SequentialSampler(range(10)), shuffle=True),
        None,
        ValueError,
        "sampler is mutually exclusive with shuffle=True",
    ),
    (dict(tiny_batch_size=0), None, ValueError, "tiny_batch_size=0 must be an integer >= 1"),
    (dict(batch_size=4, tiny_batch_size=5), None, ValueError, "tiny_batch_size=5 is larger than batch_size=4"),
    (dict(prefetch_factor=2), None, ValueError, "prefetch_factor needs num_workers > 0"),
    (dict(num_workers=1, prefetch_factor=0), None, ValueError, "prefetch_factor=0 must be an integer >= 1"),
    (dict(persistent_workers=True), None, ValueError, "persistent_workers=True needs num_workers > 0"),
    (dict(timeout=-1), None, ValueError, "timeout=-1 must be a number of seconds >= 0"),
    (dict(timeout="5"), None, ValueError, "timeout='5' must be a number of seconds >= 0"),
    (dict(timeout=None), None, ValueError, "timeout=None must be a number"),
    (dict(timeout=float("nan")), None, ValueError, "timeout=nan must be a number"),
    (dict(timeout=True), None, ValueError, "timeout=True must be a number"),
    (dict(batch_size=4, tiny_batch_size=True), None, ValueError, "tiny_batch_size=True must be an integer >= 1"),
    (dict(num_workers=1, prefetch_factor=True), None, ValueError, "prefetch_factor=True must be an integer >= 1"),
    (dict(max_retries=True), None, ValueError, "max_retries=True must be an integer >= 0"),
    (dict(num_workers=1, multiprocessing_context="bogus"), None, ValueError, "'bogus' is not a start method here"),
    (dict(num_workers=1, multiprocessing_context=3), None, TypeError, "must be a start method's name or a multipro"),
    (dict(multiprocessing_context="spawn"), None, ValueError, "starts worker processes, but num_workers=0 loads"),
    (dict(on_error="ignore"), None, ValueError, "on_error='ignore' must be one of ('raise', 'skip')"),
    (dict(max_retries=-1), None, ValueError, "max_retries=-1 must be an integer >= 0"),
    (dict(pin_workers="yes"), None, ValueError, "pin_workers='yes' must be 'auto', True or False"),
    (dict(seed=-1), None, ValueError, "seed=-1 must be a non-negative integer"),
    (dict(seed=True), None, ValueError, "seed=True must be a non-negative integer"),
    (dict(generator=5), None, TypeError, "generator=5 must be a torch.Generator or None"),
    (dict(device="cuda"), None, ValueError, "device='cuda' but CUDA is not available here"),
    (dict(device="meta"), None, ValueError, "device='meta': FusionFlowLoader delivers to 'cpu' or 'cuda[:N]'"),
    (dict(device="tpu"), None, ValueError, "device='tpu': FusionFlowLoader delivers to 'cpu' or 'cuda[:N]'"),
    (dict(device=3.5), None, ValueError, "device=3.5: FusionFlowLoader delivers to 'cpu' or 'cuda[:N]'"),
    (dict(device="cuda:2"), GPU, ValueError, "device='cuda:2': this process sees 2 CUDA device(s)"),
    (dict(policy="no-such-policy"), None, ValueError, "policy file 'no-such-policy' does not exist"),
    (dict(gpu_sharing="sometimes"), None, ValueError, "gpu_sharing='sometimes' must be one of"),
    (dict(accelerator="tpu"), None, ValueError, "accelerator='tpu' must be one of"),
    (dict(accelerator="dali-gpu", num_workers=1), DALI, ValueError, "accelerator='dali-gpu' needs a CUDA device"),
    (dict(accelerator="dali-cpu", num_workers=1), None, ValueError, "accelerator='dali-cpu' needs NVIDIA DALI"),
    (dict(accelerator="dali-cpu"), DALI, ValueError, "shares mini-batches with CPU workers: use num_workers >= 1"),
    (dict(memory_bridge="sometimes"), None, ValueError, "memory_bridge='sometimes' must be one of"),
    (dict(memory_bridge="on"), None, ValueError, "memory_bridge='on' lends DALI GPU memory carved from PyTorch"),
    (dict(global_manager=3), None, ValueError, "global_manager=3 must be 'auto', a job name (str) or None"),
    (dict(global_manager=""), None, ValueError, "global_manager='' : name the job"),
    (dict(trace=3), None, TypeError, "trace=3 must be a file path"),
    (dict(trace="/no/such/dir/run.json"), None, ValueError, "directory '/no/such/dir' does not exist"),
    (dict(stage_times="yes"), None, TypeError, "stage_times='yes' must be True or False"),
]


@pytest.mark.parametrize("kwargs,host,exc,fragment", ERRORS)
def test_refused_arguments(kwargs, host, exc, fragment):
    with pytest.raises(exc) as info:
        resolve(kwargs, host)
    assert type(info.value) is exc and fragment in str(info.value)


def test_the_first_wrong_argument_is_the_one_reported():
    """Resolution keeps the loader's order: workers, then batching, then the per-run options, ..."""
    with pytest.raises(ValueError, match="num_workers=-1"):
        resolve(dict(num_workers=-1, batch_size=0, on_error="x"))
    with pytest.raises(ValueError, match="batch_size=0"):
        resolve(dict(batch_size=0, on_error="x", device="meta"))
    with pytest.raises(ValueError, match="on_error='x'"):
        resolve(dict(on_error="x", device="meta"))


def test_warnings_are_notes_for_the_caller_even_when_a_later_argument_is_refused():
    _, notes = resolve(dict(num_workers=8))
    assert notes == [
        "num_workers=8 exceeds the 4 CPU cores this process may use; FusionFlow runs best with "
        "one worker per core: use num_workers<=4"
    ]
    _, notes = resolve(dict(pin_memory=True))
    assert notes == ["pin_memory=True but CUDA is not available: batches are returned unpinned"]
    notes = []
    with pytest.raises(ValueError, match="on_error"):
        resolve_config(DATA, **{**DEFAULTS, "num_workers": 8, "on_error": "x"}, host=Host(**CPU_HOST), notes=notes)
    assert len(notes) == 1 and "exceeds the 4 CPU cores" in notes[0]


def test_workers_past_this_ranks_share_of_the_cores_are_a_note_under_torchrun(monkeypatch):
    """Two ranks of 3 workers each on 4 cores: each rank's count was weighed against all 4 cores (no note) while the
    node ran 6 workers. The note now weighs it against the rank's share and says why."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # the node's: the process may use all of them
    _, notes = resolve(dict(num_workers=3))
    assert notes == [
        "num_workers=3 exceeds this rank's 2 of the 4 CPU cores this process may use (2 ranks share them); "
        "FusionFlow runs best with one worker per core: use num_workers<=2"
    ]
    assert resolve(dict(num_workers=2))[1] == []
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # the launcher bound each rank to 4 of the node's 8: its part
    assert resolve(dict(num_workers=3))[1] == []


def test_the_accelerators_knobs_without_an_accelerator_say_so():
    """gpu_sharing= and the ablations do nothing with accelerator=None: a note names them and what to pass."""
    _, notes = resolve(dict(gpu_sharing="spatial", taas=False))
    assert len(notes) == 1 and notes[0].startswith("gpu_sharing='spatial', taas=False set without an accelerator")
    assert "accelerator='dali-gpu'" in notes[0]
    assert resolve({})[1] == []  # the defaults: no note
    import inspect

    from fusionflow.accel.config import loose_defaults
    from fusionflow.loader import FusionFlowLoader

    signature = inspect.signature(FusionFlowLoader.__init__).parameters
    assert loose_defaults() == {k: signature[k].default for k in loose_defaults()}  # the loader's, read off one place


def test_dali_threads_past_this_ranks_cores_are_a_note():
    """DaliAccelerator(threads=64) on 4 cores was taken without a word (73 threads on a 2-core machine) while
    num_workers past the cores is a note: so is it now; 'auto' and a count within the cores say nothing."""
    from fusionflow.accel.config import DaliAccelerator

    dali = dict(has_dali=lambda: True)
    _, notes = resolve(dict(accelerator=DaliAccelerator("cpu", threads=64), num_workers=1), dali)
    assert notes == [
        "DaliAccelerator(device='cpu', threads=64): threads=64 exceeds this rank's 4 CPU cores; DALI's threads then "
        "share cores (with the CPU workers too): use threads<=4, or threads='auto'"
    ]
    assert resolve(dict(accelerator=DaliAccelerator("cpu", threads=4), num_workers=1), dali)[1] == []
    assert resolve(dict(accelerator=DaliAccelerator("cpu"), num_workers=1), dali)[1] == []


def test_an_accelerator_shared_off_needs_no_workers():
    """sharing='off' is no accelerator (as the README says): it was refused with num_workers=0 as one needing CPU
    workers to share with, while DaliAccelerator('auto', sharing='off') was taken."""
    from fusionflow.accel.config import DaliAccelerator

    for accelerator in (DaliAccelerator("cpu", sharing="off"), DaliAccelerator("auto", sharing="off")):
        cfg, _ = resolve(dict(accelerator=accelerator), dict(has_dali=lambda: True))
        assert cfg.accelerator is None and cfg.num_workers == 0


def test_an_already_transformed_dataset_is_refused():
    floats = [(np.zeros((3, 4, 4), np.float32), 0)]
    with pytest.raises(ValueError, match="dataset\\[0\\] returns an already-transformed ndarray of dtype float32"):
        resolve({}, dataset=floats)


def test_the_sampler_is_built_as_dataloader_builds_it():
    cfg, _ = resolve(dict(batch_size=4, shuffle=True, drop_last=True))
    assert isinstance(cfg.sampler, RandomSampler) and cfg.batch_sampler.sampler is cfg.sampler
    assert cfg.batch_sampler.batch_size == 4 and cfg.batch_sampler.drop_last
    assert len(list(cfg.batch_sampler)) == 2


def test_host_facts_are_asked_only_when_an_argument_needs_them():
    """A CPU loader never asks about CUDA devices or DALI (importing DALI takes seconds)."""

    def never():
        raise AssertionError("asked")

    resolve(
        dict(num_workers=2, global_manager="train", seed=1),
        dict(
            current_device=never,
            device_count=never,
            has_dali=never,
            job_key=never,
        ),
    )


def test_resolution_builds_nothing(monkeypatch):
    """memory_bridge='on' used to compile the bridge's native part in the constructor: now it is built
    when the accelerator starts (the first iteration)."""
    from fusionflow import native

    def no_build(*a, **k):
        raise AssertionError("native code built at construction")

    monkeypatch.setattr(native, "build_bridge", no_build)
    monkeypatch.setattr(native, "build", no_build)
    cfg, _ = resolve(dict(device="cuda", accelerator="dali-gpu", num_workers=1, memory_bridge="on"), DALI)
    assert cfg.bridge_why_off is None


def test_the_loader_keeps_its_configuration_frozen():
    ld = FusionFlowLoader(DATA, batch_size=4, seed=3, global_manager=None)
    assert ld.config.seed == ld.seed == 3 and ld.config.capacity == ld.capacity == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        ld.config.seed = 4
    ld.close()


def test_a_loader_without_policy_says_once_which_it_applies(caplog, monkeypatch):
    import logging

    from fusionflow.loader import config

    monkeypatch.setattr(config, "_SAID_DEFAULT_POLICY", False)
    with caplog.at_level(logging.WARNING, logger="fusionflow.loader"):
        first = FusionFlowLoader(range(4))
        FusionFlowLoader(range(4))
        FusionFlowLoader(range(4), policy="eval")
    said = [r.getMessage() for r in caplog.records if "no policy= given" in r.getMessage()]
    assert len(said) == 1 and 'policy="eval"' in said[0] and "224x224" in said[0]
    assert first.policy == config.load_policy("default")


@pytest.mark.parametrize("value", ["abc", "", "2.5"])
def test_a_bad_launcher_variable_is_refused_naming_it(monkeypatch, value):
    """LOCAL_WORLD_SIZE='abc' (or empty) failed the constructor with int()'s "invalid literal for int() with base
    10", naming neither the variable nor its fix."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE={value!r} must be an integer .*torchrun"):
        FusionFlowLoader(DATA, batch_size=2, num_workers=1)


def test_a_bad_linger_variable_is_refused_naming_it():
    import subprocess
    import sys

    env = {**os.environ, "FUSIONFLOW_GM_LINGER_S": "abc"}
    run = subprocess.run(
        [sys.executable, "-c", "import fusionflow.runtime.gm.timing"], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0 and "FUSIONFLOW_GM_LINGER_S='abc' must be a number" in run.stderr
