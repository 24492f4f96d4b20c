"""fusionflow/accel/config.py: `DaliAccelerator`, DALI's settings as one object, checked when built; and
its resolution (fusionflow/loader/host.py resolve_dali): a loader given the object has the same
`loader.config` as one given the string form it stands for, with a stand-in Host for the GPU rows (as
tests/test_loader_config.py does) and a real loader on DALI's CPU backend."""

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch
from test_loader_config import DALI, DATA, DEFAULTS, GPU, resolve

from fusionflow import DaliAccelerator, ImageFolder
from fusionflow.accel.config import ARGUMENT_OF, OBJECT_ONLY
from fusionflow.loader import FusionFlowLoader
from fusionflow.loader.host import LOOSE_DEFAULTS
from fusionflow.tools.synthetic import make_image_folder

CUDA = dict(device="cuda", num_workers=1)  # the stand-in GPU host's current device is cuda:1
ABLATED = dict(aot=False, taas=False, taas_last_k=False)
BICUBIC = {"output": {"size": 24}, "crop": {"interpolation": "bicubic"}, "augment": {"type": "none"}}  # DALI declines


# ---------------------------------------------------------------- the object


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        (dict(device="tpu"), ValueError, "device='tpu' must be one of ('gpu', 'cpu', 'auto') ('gpu': DALI on"),
        (dict(device="dali-gpu"), ValueError, "device='dali-gpu' must be one of ('gpu', 'cpu', 'auto'): write dev"),
        (dict(device="cuda:0"), ValueError, "pass device='cuda[:N]' to FusionFlowLoader and device='gpu' here"),
        (dict(device=None), ValueError, "device=None must be one of"),
        (dict(sharing="sometimes"), ValueError, "sharing='sometimes' must be one of ('auto', 'temporal', 'spatial'"),
        (dict(memory_bridge=True), ValueError, "memory_bridge=True must be one of ('auto', 'on', 'off')"),
        (dict(aot="yes"), TypeError, "aot='yes' must be True or False"),
        (dict(taas=1), TypeError, "taas=1 must be True or False"),
        (dict(taas_last_k=None), TypeError, "taas_last_k=None must be True or False"),
        (dict(device="cpu", memory_bridge="on"), ValueError, "device='cpu' runs DALI's CPU backend: use device='gpu'"),
        (dict(sharing="off", memory_bridge="on"), ValueError, "sharing='off' turns the accelerator off"),
    ],
)
def test_wrong_settings_are_refused_when_built_naming_the_value_and_the_fix(kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        DaliAccelerator(**kwargs)
    assert type(info.value) is exc and fragment in str(info.value)


def test_only_the_device_is_positional():
    assert DaliAccelerator("cpu") == DaliAccelerator(device="cpu")
    with pytest.raises(TypeError):
        DaliAccelerator("gpu", "spatial")


def test_it_is_frozen_and_a_derived_one_is_checked_again():
    acc = DaliAccelerator()
    with pytest.raises(dataclasses.FrozenInstanceError):
        acc.sharing = "spatial"
    assert dataclasses.replace(acc, sharing="spatial").sharing == "spatial"
    with pytest.raises(ValueError, match="sharing='off' turns the accelerator off"):
        dataclasses.replace(acc, sharing="off", memory_bridge="on")
    assert dataclasses.replace(acc, sharing="spatial", memory_bridge="on").memory_bridge == "on"  # either mode


def test_repr_names_the_device_and_what_differs_from_the_defaults_and_reads_back():
    assert repr(DaliAccelerator()) == "DaliAccelerator(device='gpu')"
    acc = DaliAccelerator("cpu", sharing="temporal", aot=False, taas_last_k=False)
    assert repr(acc) == "DaliAccelerator(device='cpu', sharing='temporal', aot=False, taas_last_k=False)"
    assert eval(repr(acc), {"DaliAccelerator": DaliAccelerator}) == acc


def test_it_pickles_and_hashes_by_value():
    acc = DaliAccelerator("auto", memory_bridge="off", taas=False)
    again = pickle.loads(pickle.dumps(acc))
    assert again == acc and hash(again) == hash(acc) and again is not acc
    assert len({acc, again, DaliAccelerator("auto")}) == 2


def test_it_stands_for_the_string_form():
    assert DaliAccelerator().loader_arguments() == dict(accelerator="dali-gpu", **LOOSE_DEFAULTS)
    acc = DaliAccelerator("cpu", sharing="spatial", memory_bridge="off", aot=False, taas=False, taas_last_k=False)
    assert acc.loader_arguments() == dict(
        accelerator="dali-cpu", gpu_sharing="spatial", memory_bridge="off", aot=False, taas=False, taas_last_k=False
    )
    assert DaliAccelerator("auto").loader_arguments()["accelerator"] == "auto"


def test_its_defaults_are_the_loaders_loose_defaults():
    """The loose arguments' defaults (what may stand beside the object) are FusionFlowLoader's own, and
    each field but the device has the default of the loose argument it stands for."""
    assert LOOSE_DEFAULTS == {name: DEFAULTS[name] for name in LOOSE_DEFAULTS}
    fields = {f.name: f.default for f in dataclasses.fields(DaliAccelerator) if f.name not in OBJECT_ONLY}
    assert set(ARGUMENT_OF) == set(fields) and set(ARGUMENT_OF.values()) == {"accelerator", *LOOSE_DEFAULTS}
    assert {ARGUMENT_OF[name]: default for name, default in fields.items() if name != "device"} == LOOSE_DEFAULTS


def test_threads_is_set_on_the_object_only_and_reaches_the_loaders_config():
    assert DaliAccelerator("cpu").threads == "auto" and "threads" not in DaliAccelerator("cpu").loader_arguments()
    for bad in (0, -1, 1.5, True, "2", "Auto"):
        with pytest.raises(ValueError, match="threads"):
            DaliAccelerator("cpu", threads=bad)
    assert repr(DaliAccelerator("cpu", threads=3)) == "DaliAccelerator(device='cpu', threads=3)"


def test_run_samples_is_set_on_the_object_only_and_reaches_the_loaders_config():
    from fusionflow.accel.config import RUN_SAMPLES

    acc = DaliAccelerator("cpu")
    assert acc.run_samples == RUN_SAMPLES == 256 and "run_samples" not in acc.loader_arguments()
    for bad in (0, -4, 2.0, True, "64", None):
        with pytest.raises(ValueError, match=r"run_samples=.* must be an int >= 1 \(the most samples in one DALI run"):
            DaliAccelerator("cpu", run_samples=bad)
    assert repr(DaliAccelerator("cpu", run_samples=64)) == "DaliAccelerator(device='cpu', run_samples=64)"
    by_object, _ = resolve(dict(num_workers=1, accelerator=DaliAccelerator("cpu", run_samples=64)), DALI)
    by_strings, _ = resolve(dict(num_workers=1, accelerator="dali-cpu"), DALI)
    assert (by_object.dali_run_samples, by_strings.dali_run_samples) == (64, RUN_SAMPLES)


def test_runs_in_flight_is_set_on_the_object_only_auto_by_backend_and_reaches_the_loaders_config():
    from fusionflow.accel.config import RUNS_IN_FLIGHT_CPU, RUNS_IN_FLIGHT_GPU, auto_runs_in_flight

    acc = DaliAccelerator("cpu")
    assert acc.runs_in_flight == "auto" and "runs_in_flight" not in acc.loader_arguments()
    for bad in (0, -1, 2.0, True, "3", None, "Auto"):
        with pytest.raises(ValueError, match=r"runs_in_flight=.* must be an int >= 1 \(DALI runs in flight at most\)"):
            DaliAccelerator("cpu", runs_in_flight=bad)
    assert repr(DaliAccelerator("cpu", runs_in_flight=4)) == "DaliAccelerator(device='cpu', runs_in_flight=4)"
    assert (auto_runs_in_flight("dali-gpu"), auto_runs_in_flight("dali-cpu")) == (
        RUNS_IN_FLIGHT_GPU,
        RUNS_IN_FLIGHT_CPU,
    )
    assert RUNS_IN_FLIGHT_GPU > RUNS_IN_FLIGHT_CPU == 2
    by_object, _ = resolve(dict(num_workers=1, accelerator=DaliAccelerator("cpu", runs_in_flight=4)), DALI)
    by_strings, _ = resolve(dict(num_workers=1, accelerator="dali-cpu"), DALI)
    assert (by_object.dali_runs_in_flight, by_strings.dali_runs_in_flight) == (4, RUNS_IN_FLIGHT_CPU)


def test_auto_threads_take_the_cores_the_cpu_workers_leave_on_the_gpu_only():
    from fusionflow.accel.config import AUTO_THREADS, auto_threads

    assert auto_threads("dali-gpu", 16, 4) == AUTO_THREADS == 4  # 11 cores left: at most 4
    assert auto_threads("dali-gpu", 16, 13) == 2 and auto_threads("dali-gpu", 16, 15) == 1
    assert auto_threads("dali-gpu", 2, 1) == 1  # never below one
    assert auto_threads("dali-cpu", 16, 1) == 1  # the CPU backend's threads are its compute: asked for, not taken


def test_importing_and_building_it_loads_neither_torch_nor_dali():
    code = (
        "import sys, fusionflow\n"
        "fusionflow.DaliAccelerator('gpu', sharing='spatial')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('nvidia.dali')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- resolved as the strings are


def comparable(cfg) -> dict:
    """A LoaderConfig's fields but the samplers and the generator (built anew, and compared by identity)."""
    drop = ("batch_sampler", "sampler", "generator")
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in drop}


SAME = [
    # (the object, the string form it stands for, host, the loader arguments both share, resolved values)
    (DaliAccelerator(), dict(accelerator="dali-gpu"), DALI, CUDA, dict(accelerator="dali-gpu", bridge_why_off=None)),
    (
        DaliAccelerator("gpu", sharing="spatial"),
        dict(accelerator="dali-gpu", gpu_sharing="spatial"),
        DALI,
        CUDA,
        dict(gpu_sharing="spatial", bridge_why_off=None),  # the arena serves either sharing mode
    ),
    (
        DaliAccelerator("gpu", memory_bridge="on"),
        dict(accelerator="dali-gpu", memory_bridge="on"),
        DALI,
        CUDA,
        dict(gpu_sharing="auto", memory_bridge="on", bridge_why_off=None),  # 'on' no longer fixes the sharing
    ),
    (
        DaliAccelerator("gpu", sharing="temporal", memory_bridge="off", **ABLATED),
        dict(accelerator="dali-gpu", gpu_sharing="temporal", memory_bridge="off", **ABLATED),
        DALI,
        CUDA,
        dict(ABLATED, bridge_why_off="memory_bridge='off'"),
    ),
    (
        DaliAccelerator("gpu", sharing="off"),
        dict(accelerator="dali-gpu", gpu_sharing="off"),
        DALI,
        CUDA,
        {"accelerator": None},
    ),
    (DaliAccelerator("gpu"), dict(accelerator="dali-gpu"), DALI, dict(CUDA, policy=BICUBIC), dict(accelerator=None)),
    (DaliAccelerator("auto"), dict(accelerator="auto"), DALI, CUDA, dict(accelerator="dali-gpu")),
    (DaliAccelerator("auto"), dict(accelerator="auto"), GPU, CUDA, dict(accelerator=None)),  # no DALI
    (DaliAccelerator("auto"), dict(accelerator="auto"), DALI, dict(num_workers=1), dict(accelerator=None)),  # CPU
    (
        DaliAccelerator("cpu"),
        dict(accelerator="dali-cpu"),
        DALI,
        dict(num_workers=1),
        dict(accelerator="dali-cpu", bridge_why_off="no DALI GPU accelerator"),
    ),
    (
        DaliAccelerator("cpu", sharing="spatial", taas=False),
        dict(accelerator="dali-cpu", gpu_sharing="spatial", taas=False),
        DALI,
        dict(num_workers=2, batch_size=8),
        dict(accelerator="dali-cpu", gpu_sharing="spatial", taas=False),
    ),
]


@pytest.mark.parametrize("acc,strings,host,shared,expected", SAME)
def test_the_object_resolves_to_the_config_of_its_string_form(acc, strings, host, shared, expected):
    from_object, notes = resolve(dict(shared, accelerator=acc), host)
    from_strings, _ = resolve(dict(shared, **strings), host)
    assert comparable(from_object) == comparable(from_strings)
    assert {k: getattr(from_object, k) for k in expected} == expected
    assert notes == []


REFUSED_ALIKE = [
    # (the object, its string form, host, the loader arguments both share, what both messages say)
    (DaliAccelerator("gpu"), dict(accelerator="dali-gpu"), DALI, dict(num_workers=1), "needs a CUDA device"),
    (DaliAccelerator("cpu"), dict(accelerator="dali-cpu"), None, dict(num_workers=1), "needs NVIDIA DALI"),
    (DaliAccelerator("cpu"), dict(accelerator="dali-cpu"), DALI, {}, "use num_workers >= 1"),
    (
        DaliAccelerator("auto", memory_bridge="on"),
        dict(accelerator="auto", memory_bridge="on"),
        DALI,
        dict(num_workers=1),
        "memory_bridge='on' lends DALI GPU memory carved from PyTorch's allocator",
    ),
]


@pytest.mark.parametrize("acc,strings,host,shared,fragment", REFUSED_ALIKE)
def test_what_the_string_form_refuses_the_object_refuses_naming_the_object(acc, strings, host, shared, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve(dict(shared, **strings), host)
    with pytest.raises(ValueError, match=fragment) as info:
        resolve(dict(shared, accelerator=acc), host)
    assert f"accelerator={acc!r}" in str(info.value) and "'dali-" not in str(info.value)  # the object, not strings


def test_the_gpu_one_on_a_cpu_device_says_how_to_fix_it_with_the_object():
    with pytest.raises(ValueError) as info:
        resolve(dict(num_workers=1, accelerator=DaliAccelerator()), DALI)
    assert str(info.value) == (
        "accelerator=DaliAccelerator(device='gpu') needs a CUDA device, got device='cpu'; pass "
        "device='cuda[:N]', or use DaliAccelerator('cpu') (DALI's CPU backend) or accelerator=None"
    )


@pytest.mark.parametrize(
    "name,value,field",
    [
        ("gpu_sharing", "spatial", "sharing"),
        ("gpu_sharing", "off", "sharing"),
        ("memory_bridge", "off", "memory_bridge"),
        ("aot", False, "aot"),
        ("taas", False, "taas"),
        ("taas_last_k", False, "taas_last_k"),
    ],
)
def test_a_loose_argument_beside_the_object_is_refused(name, value, field):
    acc = DaliAccelerator("cpu")
    with pytest.raises(ValueError) as info:
        resolve(dict(num_workers=1, accelerator=acc, **{name: value}), DALI)
    assert str(info.value) == (
        f"{name}={value!r} beside accelerator=DaliAccelerator(device='cpu'): a DaliAccelerator holds the "
        f"accelerator's settings, so set it there -- DaliAccelerator(..., {field}={value!r}) -- and leave {name} unset"
    )


def test_loose_arguments_at_their_defaults_stand_beside_the_object():
    cfg, _ = resolve(dict(num_workers=1, accelerator=DaliAccelerator("cpu", sharing="spatial"), **LOOSE_DEFAULTS), DALI)
    assert (cfg.accelerator, cfg.gpu_sharing) == ("dali-cpu", "spatial")


def test_the_class_itself_is_refused_with_how_to_build_one():
    with pytest.raises(TypeError, match=r"accelerator=DaliAccelerator is the class: build one"):
        resolve(dict(num_workers=1, accelerator=DaliAccelerator), DALI)


def test_the_loader_refuses_a_conflict_before_building_anything():
    with pytest.raises(ValueError, match="gpu_sharing='spatial' beside accelerator=DaliAccelerator"):
        FusionFlowLoader(DATA, num_workers=1, accelerator=DaliAccelerator("cpu"), gpu_sharing="spatial")


# ---------------------------------------------------------------- a real loader, DALI's CPU backend

POLICY = {"output": {"size": 24}, "flip": 0.5, "crop": {"scale": [0.3, 1.0]}, "augment": {"type": "none"}}


class IndexedFolder(ImageFolder):
    """An ImageFolder whose target is the sample's index, so a batch says which samples it holds."""

    def __getitem__(self, index):
        return super().__getitem__(index)[0], index


def one_epoch(ds, accelerator):
    with FusionFlowLoader(
        ds,
        batch_size=6,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        num_workers=1,
        tiny_batch_size=2,
        policy=POLICY,
        seed=4,
        global_manager=None,
        accelerator=accelerator,
    ) as ld:
        order = [i for _, y in ld for i in y.tolist()]
        return ld, order, ld.stats.accelerator_builds


def test_a_loader_with_the_object_delivers_what_the_string_form_delivers(tmp_path):
    pytest.importorskip("nvidia.dali")
    ds = IndexedFolder(make_image_folder(str(tmp_path), num_classes=2, per_class=9, min_side=30, max_side=90, seed=3))
    by_object, order, builds = one_epoch(ds, DaliAccelerator("cpu"))
    by_strings, expected, _ = one_epoch(ds, "dali-cpu")
    assert order == expected and sorted(order) == list(range(len(ds)))  # each sample once, in the sampler's order
    assert comparable(by_object.config) == comparable(by_strings.config)
    assert (by_object.accelerator, by_object.gpu_sharing, by_object.memory_bridge) == ("dali-cpu", "auto", "auto")
    assert builds == 1  # the accelerator ran: its one pipeline built ahead of time
