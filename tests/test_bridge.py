"""The allocator bridge end to end: the arena (its size, carved once from PyTorch's allocator, lent to the
native DALI resource until the accelerator's pipelines are gone -- against stand-ins of both here), the native
resource (builds and loads against the stock DALI wheel here; serves DALI on a GPU), and the loader's
`memory_bridge` argument. GPU tests are marked and skipped without one."""

import os
import types

import numpy as np
import pytest
import torch
from dali_numpy import run_numpy
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401

from fusionflow import native
from fusionflow.loader import FusionFlowLoader

MIB = 1 << 20


def test_the_arena_is_the_runs_in_flight_at_their_most_samples():
    from fusionflow.accel.bridge.memory_bridge import WORKING_IMAGES, arena_bytes

    sample = 3 * 224 * 224
    assert arena_bytes(256, 3, (3, 224, 224), 1) == 3 * 256 * sample * (WORKING_IMAGES + 1)
    assert arena_bytes(256, 3, (3, 224, 224), 4) - arena_bytes(256, 3, (3, 224, 224), 1) == 3 * 256 * sample * 3
    assert arena_bytes(64, 1, (3, 32, 32), 1) * 12 == arena_bytes(256, 3, (3, 32, 32), 1)


class NativeStandIn:
    """The native resource's C entry points as the bridge calls them (through native.call): regions lent,
    windows opened (with their stream), regions DALI still holds (not returned at close), its counters."""

    def __init__(self):
        self.lent, self.opened, self.closed_on, self.held = {}, [], [], set()
        self.peak, self.fallback = 0, 0

        def ff_bridge_install(device, err, errlen):
            return 0

        def ff_bridge_lend(device, base, size, err, errlen):
            self.lent[base] = size
            return 0

        def ff_bridge_open(device, stream, err, errlen):
            self.opened.append(stream)
            return 0

        def ff_bridge_close(device, stream, bases, sizes, cap, err, errlen):
            self.closed_on.append(stream)
            back = [(b, z) for b, z in self.lent.items() if b not in self.held]
            for k, (b, z) in enumerate(back):
                bases[k], sizes[k] = b, z
                del self.lent[b]
            return len(back)

        def ff_bridge_stats(device, out, err, errlen):
            out[2], out[6] = self.peak, self.fallback
            return 0

        def ff_bridge_pause(device, paused, err, errlen):
            self.pauses.append(paused)
            return 0

        self.pauses = []
        for fn in (
            ff_bridge_install,
            ff_bridge_lend,
            ff_bridge_open,
            ff_bridge_close,
            ff_bridge_stats,
            ff_bridge_pause,
        ):
            setattr(self, fn.__name__, fn)


class AllocatorStandIn:
    """torch.cuda's caching_allocator_alloc/delete: addresses handed out, requests above `limit` bytes out of memory."""

    def __init__(self, limit):
        self.limit, self.next, self.live, self.asked = limit, 0x10000000, {}, []

    def alloc(self, size, device=None, stream=None):
        self.asked.append((size, stream))
        if size > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        self.live[self.next], self.next = size, self.next + size
        return self.next - size

    def delete(self, ptr):
        del self.live[ptr]


def stand_ins(monkeypatch):
    """(the bridge module, the native stand-in, the allocator stand-in: 300 MiB at most a request) installed,
    the device showing 1.5 GiB free, nothing held from an earlier bridge."""
    from fusionflow.accel.bridge import memory_bridge as mb

    lib, alloc = NativeStandIn(), AllocatorStandIn(limit=300 * MIB)
    monkeypatch.setattr(native, "load_bridge", lambda: lib)
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc", alloc.alloc)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", alloc.delete)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1536 * MIB, 80 << 30))
    monkeypatch.setattr(mb, "_HELD", {})
    monkeypatch.setattr(mb, "_HELD_STREAM", {})
    return mb, lib, alloc


def test_the_arena_is_carved_once_lent_until_close_and_halved_when_pytorch_runs_out(monkeypatch):
    """MemoryBridge against stand-ins of the native resource and PyTorch's allocator: nothing before the
    loader armed it or before the warm-up; then one arena on the armed stream (at most half the device's free
    memory, halved while PyTorch is out of memory), lent and opened once however often it is asked, each later
    ask reading DALI's counters; close gives back what DALI no longer holds, ordered on the arena's stream; a
    region still held is lent again by the next start (on its own stream, no new arena) and goes back later;
    a later start after a refusal asks for what PyTorch gave."""
    mb, lib, alloc = stand_ins(monkeypatch)
    s1, s2 = types.SimpleNamespace(cuda_stream=11), types.SimpleNamespace(cuda_stream=22)
    bridge = mb.MemoryBridge("cuda:0", 1024 * MIB, warmup=2)
    try:
        bridge.lend(tiny_batches_done=5)  # not armed yet: no training stream to carve on
        bridge.arm(s1)
        bridge.lend(tiny_batches_done=1)  # the warm-up
        assert alloc.asked == [] and lib.opened == []
        bridge.lend(tiny_batches_done=2)  # 1024 MiB wanted, 768 (half the free memory) asked, then halved
        assert alloc.asked == [(768 * MIB, s1), (384 * MIB, s1), (192 * MIB, s1)]
        (base,) = alloc.live
        assert lib.lent == {base: 192 * MIB} and lib.opened == [11]
        bridge.arm(s2)  # lent: the arena stays where it was carved
        st = bridge.stats
        assert (st.lends, st.lent_bytes, st.refused, st.borrowed_bytes) == (1, 192 * MIB, 2, 0)
        lib.peak, lib.fallback = 90 * MIB, 5 * MIB
        for done in (3, 4, 50):
            bridge.lend(tiny_batches_done=done)  # each reads DALI's counters, none lends again
        assert len(alloc.asked) == 3 and lib.opened == [11]
        assert (st.borrowed_bytes, st.fallback_bytes) == (90 * MIB, 5 * MIB)
        lib.held.add(base)  # DALI still holds part of it: pinned, not given back
        bridge.close()
        assert lib.closed_on == [11] and alloc.live == {base: 192 * MIB} and st.pinned_bytes == 192 * MIB
        bridge.arm(s2)
        bridge.lend(tiny_batches_done=99)  # the next start: the pinned arena again, on its stream, nothing new
        assert len(alloc.asked) == 3 and lib.opened == [11, 11] and st.lends == 2
        lib.held.clear()
        bridge.close()
        assert lib.closed_on == [11, 11] and alloc.live == {} and lib.lent == {} and st.pinned_bytes == 0
        bridge.arm(s2)
        bridge.lend(tiny_batches_done=99)  # nothing pinned now: a new arena, as big as PyTorch gave last time
        assert alloc.asked[-1] == (192 * MIB, s2) and len(alloc.asked) == 4 and lib.opened[-1] == 22
        bridge.close()
        assert lib.closed_on[-1] == 22 and alloc.live == {}
    finally:
        bridge.shutdown()
    assert 0 not in mb._IN_USE and bridge.ledger is None


def test_a_failing_close_at_shutdown_still_frees_the_device_and_unlinks_the_ledger(monkeypatch, caplog):
    """A native close that fails as the loader shuts down (a CUDA fault) is logged; the ledger's shared memory
    is still unlinked and the device is free for the next loader's bridge (not 'another loader lends')."""
    mb, lib, alloc = stand_ins(monkeypatch)
    bridge = mb.MemoryBridge("cuda:0", 64 * MIB, warmup=0)
    bridge.arm(types.SimpleNamespace(cuda_stream=11))
    bridge.lend(tiny_batches_done=1)
    assert lib.lent and 0 in mb._IN_USE
    ledger = bridge.ledger.name
    lib.ff_bridge_close = lambda *args: -1  # native.call raises BridgeError
    with caplog.at_level("ERROR", logger=mb.__name__):
        bridge.shutdown()
    assert "giving the arena back failed at shutdown" in caplog.text
    assert 0 not in mb._IN_USE and bridge.ledger is None
    assert not os.path.exists("/dev/shm/" + ledger.lstrip("/"))
    mb.MemoryBridge("cuda:0", 64 * MIB, warmup=0).shutdown()  # the device is free for the next loader


def test_no_arena_when_pytorch_cannot_give_the_smallest():
    from fusionflow.accel.bridge.torch_side import MIN_ARENA, TorchLender

    lender = TorchLender.__new__(TorchLender)  # the CUDA-free part: carve's sizes
    alloc = AllocatorStandIn(limit=MIN_ARENA - 1)
    cuda = types.SimpleNamespace(caching_allocator_alloc=alloc.alloc, mem_get_info=lambda i: (64 * MIN_ARENA, 0))
    lender.torch = types.SimpleNamespace(cuda=cuda, OutOfMemoryError=torch.OutOfMemoryError)
    lender.index, lender.min_arena, lender.refused = 0, MIN_ARENA, 0
    assert lender.carve(4 * MIN_ARENA, None) == [] and lender.refused == 3
    assert [size for size, _ in alloc.asked] == [4 * MIN_ARENA, 2 * MIN_ARENA, MIN_ARENA]
    alloc.limit = MIN_ARENA // 4
    assert lender.carve(MIN_ARENA // 2, None) == [] and len(alloc.asked) == 4  # under the floor: asked once, not halved
    (arena,) = lender.carve(MIN_ARENA // 4, None)  # an arena under the floor is fine when it is all that is wanted
    assert arena.size == MIN_ARENA // 4
    alloc.limit, cuda.mem_get_info = 1 << 40, lambda i: (MIN_ARENA, 0)
    (arena,) = lender.carve(4 * MIN_ARENA, None)  # never more than half the free memory
    assert arena.size == MIN_ARENA // 2


def test_bridge_library_builds_against_the_stock_dali_wheel():
    """The native resource compiles and links against libdali_core's SetDefaultDeviceResource; without
    a GPU, installing it fails with CUDA's reason instead of crashing."""
    lib = native.load_bridge()
    assert native.build_bridge().exists()
    if not torch.cuda.is_available():
        with pytest.raises(native.BridgeError, match="ff_bridge_install: cuda"):
            native.call(lib.ff_bridge_install, 0)
    with pytest.raises(native.BridgeError, match="not installed on device 7"):
        native.call(lib.ff_bridge_open, 7, 0)


def test_build_failure_names_the_missing_piece(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FUSIONFLOW_CACHE", str(tmp_path))
    with pytest.raises(native.NativeBuildError, match="no-such-compiler could not run"):
        native.build_arena()
    monkeypatch.setattr(native, "KERNELS", tmp_path / "nowhere")
    with pytest.raises(native.NativeBuildError, match=r"native sources not found .*ship inside the package"):
        native.build_arena()


def test_one_bridge_per_device_and_process():
    from fusionflow.accel.bridge import memory_bridge

    memory_bridge._IN_USE.add(0)  # as a live MemoryBridge on cuda:0 leaves it
    try:
        with pytest.raises(native.BridgeError, match=r"another loader in this process already lends .* cuda:0"):
            memory_bridge.MemoryBridge("cuda:0", 1 << 30)
    finally:
        memory_bridge._IN_USE.discard(0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"memory_bridge": "sometimes"}, r"memory_bridge='sometimes' must be one of"),
        (
            {"memory_bridge": "on"},
            r"memory_bridge='on' lends DALI GPU memory carved from PyTorch's allocator, but "
            r"accelerator=None",
        ),
        ({"memory_bridge": "on", "accelerator": "dali-cpu"}, r"accelerator='dali-cpu'.*use accelerator='dali-gpu'"),
    ],
)
def test_invalid_bridge_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, **kwargs)


def test_auto_is_off_with_its_reason_and_training_is_unchanged():
    ld = FusionFlowLoader(
        Bytes(16), batch_size=4, num_workers=1, policy=SMALL, tiny_batch_size=2, accelerator="dali-cpu"
    )
    _, labels = collect(ld)
    assert sorted(i for y in labels for i in y.tolist()) == list(range(16))
    assert ld.stats.memory_bridge == "off: no DALI GPU accelerator"
    assert ld.stats.summary()["bridge_lent_bytes"] == 0
    ld.close()


class RecordingBridge:
    """Stands in for MemoryBridge's CUDA side, recording what the loader and the accelerator ask of it."""

    def __init__(self):
        import threading

        self.armed, self.lends, self.closes, self.lent_outside, self.shutdowns, self.early = False, 0, 0, 0, 0, 0
        self.session = None  # the GpuSession it serves, when a test wants close() checked against it
        self.stats = type(
            "S", (), dict(lends=0, lent_bytes=0, borrowed_bytes=0, fallback_bytes=0, pinned_bytes=0, seconds=0.0)
        )()
        self.main = threading.get_ident()

    def arm(self, stream):
        import inspect

        assert threading_ident() == self.main  # the training thread, at next()
        if not self.armed:  # who armed it first (GpuSession.start, as it starts the accelerator, before any run)
            self.first_armed_by = inspect.stack()[1].function
        self.armed = True

    def paused(self):  # around a rebuild (none in these tests)
        import contextlib

        return contextlib.nullcontext()

    def lend(self, tiny_batches_done):
        assert threading_ident() != self.main  # the accelerator thread asks, before each run
        self.lends += 1
        self.lent_outside += not self.armed

    def close(self):
        self.closes += 1
        accel = self.session.accel if self.session is not None else None
        if accel is not None and (accel._thread.is_alive() or accel.pipeline is not None):
            self.early += 1  # DALI's pipelines still there: what they hold in the arena would stay pinned

    def shutdown(self):
        self.shutdowns += 1
        if self.session is not None and self.session._spares:
            self.early += 1  # a DALI pipeline kept for the next epoch still there


def threading_ident():
    import threading

    return threading.get_ident()


@pytest.mark.parametrize("sharing", ["temporal", "spatial"])
def test_the_bridge_is_armed_at_next_asked_before_each_run_and_closed_once_the_pipelines_are_gone(monkeypatch, sharing):
    """The arena's protocol in either sharing mode: the training thread arms the bridge at next() (the stream to
    carve on; first as it starts the accelerator), the accelerator thread asks it to lend before every DALI run
    (MemoryBridge lends once, later asks read its counters), and it is closed only when the accelerator's
    pipelines are gone (its thread ended, its pipeline closed or kept idle for the next epoch: what that one holds of
    the arena stays pinned, DALI allocating meanwhile uses its own pool) -- never per mini-batch. Temporal sharing stays
    strict: the accelerator works only between the start of next() and the batch being ready. Real loader, real
    DALI (CPU backend); the CUDA calls are what the stand-in replaces."""
    rec = RecordingBridge()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ld = FusionFlowLoader(
        Bytes(40),
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        accelerator="dali-cpu",
        gpu_sharing=sharing,
        seed=4,
    )
    ld.parts.gpu.bridge, rec.session = rec, ld.parts.gpu  # what GpuSession._start_bridge sets up on a GPU
    seen = []
    for _, y in ld:
        accel = ld.parts.gpu.accel
        assert rec.armed and rec.closes == 0
        if sharing == "temporal":
            assert accel.gated and not accel.window_open and accel.in_flight == 0
        seen += y.tolist()
    assert sorted(seen) == list(range(40))
    assert ld.stats.accelerator_tiny_batches > 0 and rec.lends == ld.stats.accelerator_runs
    assert rec.lent_outside == 0 and rec.first_armed_by == "start"  # armed as the accelerator started
    assert rec.closes == 1 and rec.early == 0  # the epoch ended: its workers and the accelerator stopped
    assert ld.parts.gpu._spares  # its pipeline kept for the next epoch (its buffers' part of the arena pinned)
    ld.close()
    assert rec.closes == 1 and rec.shutdowns == 1 and rec.early == 0  # the kept pipeline closed before the shutdown


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_the_arena_is_one_allocation_of_pytorchs_that_nothing_else_is_handed():
    from fusionflow.accel.bridge.torch_side import MIN_ARENA, TorchLender

    dev = torch.device("cuda:0")
    lender, stream = TorchLender(dev), torch.cuda.current_stream(dev)
    allocated = torch.cuda.memory_allocated(dev)
    (arena,) = lender.carve(128 * MIB, stream)
    assert arena.size == 128 * MIB and torch.cuda.memory_allocated(dev) == allocated + 128 * MIB
    y = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)  # PyTorch cannot be handed the arena
    assert not arena.address <= y.data_ptr() < arena.address + arena.size
    del y
    lender.take_back([arena])
    assert torch.cuda.memory_allocated(dev) == allocated
    (small,) = lender.carve(MIN_ARENA // 4, stream)  # under the halving floor: carved whole when that is all asked
    assert small.size == MIN_ARENA // 4
    lender.take_back([small])


@pytest.mark.gpu
def test_dali_runs_in_the_arena_and_gives_it_back_once_its_pipeline_is_gone():
    from fusionflow.accel.bridge.memory_bridge import MemoryBridge
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    dev = torch.device("cuda:0")
    bridge = MemoryBridge(dev, 512 * MIB, warmup=0)  # installed before the pipeline exists
    ds = Bytes(16)
    pipe = DaliPolicyPipeline(SMALL, 8, device="gpu", device_id=0)
    ref = [np.asarray(run_numpy(pipe, ds.data[i : i + 8], list(range(i, i + 8)), seed=3)) for i in (0, 8)]
    allocated = torch.cuda.memory_allocated(dev)
    bridge.arm(torch.cuda.current_stream(dev))
    for i, want in zip((0, 8), ref):
        bridge.lend(tiny_batches_done=99)  # the first lends, the second reads DALI's counters
        got = run_numpy(pipe, ds.data[i : i + 8], list(range(i, i + 8)), seed=3)
        assert np.array_equal(got, want)  # same output from the arena
    assert torch.cuda.memory_allocated(dev) == allocated + 512 * MIB  # the arena is PyTorch's allocation
    bridge.lend(tiny_batches_done=99)  # reads DALI's counters
    assert bridge.stats.lends == 1 and bridge.stats.lent_bytes == 512 * MIB
    assert bridge.stats.borrowed_bytes > 0  # DALI really allocated from the arena
    pipe.close()
    del pipe
    bridge.close()
    assert bridge.stats.pinned_bytes == 0 and torch.cuda.memory_allocated(dev) == allocated
    ledger_name = bridge.ledger.name  # shutdown() drops the ledger
    bridge.shutdown()
    assert not os.path.exists("/dev/shm" + ledger_name)


@pytest.mark.gpu
@pytest.mark.parametrize("sharing", ["temporal", "spatial"])
def test_loader_with_bridge_delivers_every_sample_once(sharing):
    ds = Bytes(48)
    ld = FusionFlowLoader(
        ds,
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        device="cuda:0",
        accelerator="dali-gpu",
        gpu_sharing=sharing,
        memory_bridge="on",
        seed=4,
        persistent_workers=True,
    )
    for epoch in (0, 1):
        ld.set_epoch(epoch)
        _, labels = collect(ld)
        assert sorted(i for y in labels for i in y.tolist()) == list(range(48))
    s = ld.stats
    assert s.memory_bridge == "on" and s.accelerator_tiny_batches > 0
    assert s.bridge_lends >= 1 and s.bridge_max_lent_bytes > 0 and s.bridge_max_borrowed_bytes > 0
    ld.close()
    assert ld.stats.bridge_pinned_bytes == 0


EXPECTED_PROTOCOL = """\
upstream reachable: yes
-- before any window
upstream allocates 1048576 on S1
upstream frees 1048576 on S1
-- window 1
record E0 on T
wait S1 for E0
p1 0x10000000
p2 0x10100000
record E1 on S1
wait S2 for E0
wait S2 for E1
p3 0x10000000
upstream allocates 8388608 on S1
host waits for E0
the resource's lock is free meanwhile
q 0x10200000
record E2 on S2
fallback 8388608 live 1572864
wait T for E1
wait T for E2
close returned 0
-- between windows
record E1 on S1
upstream allocates 1048576 on S1
-- window 2
record E3 on T
wait T for E1
close returned 1 0x10000000
close refused: cap
-- a free whose event record fails
record E4 on T
wait S2 for E4
r 0x20000000
record E2 on S2 fails
host syncs S2
close returned 1 0x20000000
-- paused (a rebuild): DALI's own pool while the window is open, lent memory again after
record E5 on T
upstream allocates 1048576 on S1
wait S1 for E5
u 0x30000000
record E1 on S1
wait T for E1
close returned 1 0x30000000
-- a destroyed stream's handle reused by a new stream: waits as any other stream
record E6 on T
wait S2 for E6
v 0x40000000
record E2 on S2
wait S2 for E6
wait S2 for E2
w 0x40000000
record E1 on S2
wait T for E2
wait T for E1
close returned 1 0x40000000
"""


def test_dali_resource_orders_streams_by_events(tmp_path):
    """The real BridgeResource class, compiled against the DALI wheel's headers with the CUDA
    calls it makes replaced by logging fakes (tests/native/bridge_resource_harness.cc): outside a
    window everything goes to DALI's pool; inside, the first use of lent memory on a stream waits
    for the lender's event, reuse of a range freed on another stream waits for that free's event, a
    host-synchronous allocation waits on the host (outside the resource's lock: another thread reads
    the counters meanwhile), each window has an event of its own (E0, E3, E4), a free records its
    stream's event at the free, and close makes the lender's stream wait for exactly the frees since
    the last close, returning only blocks nothing holds. A free whose event record fails
    (cudaErrorCudartUnloading at exit) never throws into DALI's deleter (that would be
    std::terminate): the host waits for the stream instead. Streams are told by CUDA's id, not their handle:
    a new stream given a destroyed one's handle waits for the window's event and the old stream's free. A close
    forgets the streams that freed lent memory (no range names them after it) and keeps their events for the
    next ones (E1, E2 reused): streams come and go with rebuilt pipelines, entries do not pile up."""
    import subprocess

    dali_inc, dali_lib = native.dali_paths()
    cuda_inc, _ = native.cuda_paths()
    exe = tmp_path / "harness"
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        [
            native.compiler(),
            "-std=c++17",
            "-O1",
            "-I",
            str(native.KERNELS),
            "-I",
            str(dali_inc),
            "-I",
            str(cuda_inc),
            os.path.join(here, "native", "bridge_resource_harness.cc"),
            "-o",
            str(exe),
            "-L",
            str(dali_lib),
            "-ldali_core",
            f"-Wl,-rpath,{dali_lib}",
        ],
        check=True,
        capture_output=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr  # an exception out of a free would abort the harness
    assert run.stdout == EXPECTED_PROTOCOL
    assert "waited on the host instead of an event" in run.stderr


def test_auto_bridge_falls_back_on_any_start_failure_and_a_failing_close_is_contained(monkeypatch, caplog):
    """memory_bridge='auto': a bridge that cannot start for any reason (here posix_ipc missing, an
    ImportError, not a BridgeError) leaves it off with the reason; a bridge whose close() fails is
    logged and training goes on. Real loader on a fake torch.cuda (tests/fake_cuda.py)."""
    pytest.importorskip("nvidia.dali")
    from fake_cuda import FakeCuda
    from test_device_ring import CpuStandIn

    from fusionflow.accel import dali_graph, device_ring
    from fusionflow.accel.bridge import memory_bridge as bridge_mod

    cuda = FakeCuda()
    cuda.install(monkeypatch, torch)
    monkeypatch.setattr(dali_graph, "DaliPolicyPipeline", CpuStandIn)
    monkeypatch.setattr(
        device_ring, "dali_view", lambda out: torch.from_numpy(np.stack([np.array(out[i]) for i in range(len(out))]))
    )

    def no_posix_ipc(device, budget):
        raise ImportError("No module named 'posix_ipc'")

    monkeypatch.setattr(bridge_mod, "MemoryBridge", no_posix_ipc)
    args = dict(
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        device="cuda:0",
        accelerator="dali-gpu",
        gpu_sharing="temporal",
        seed=4,
        timeout=60,
    )
    ld = FusionFlowLoader(Bytes(16), **args)
    ld.parts.delivery.alloc_device = torch.device("cpu")
    _, labels = collect(ld)
    assert sorted(i for y in labels for i in y.tolist()) == list(range(16))
    assert ld.stats.memory_bridge.startswith("off: No module named 'posix_ipc'")
    ld.close()

    failing = RecordingBridge()

    def close_fails():
        failing.closes += 1
        raise RuntimeError("cudaStreamWaitEvent: an illegal memory access was encountered")

    failing.close = close_fails
    monkeypatch.setattr(bridge_mod, "MemoryBridge", lambda device, budget: failing)
    ld = FusionFlowLoader(Bytes(16), **args)
    ld.parts.delivery.alloc_device = torch.device("cpu")
    with caplog.at_level("ERROR", logger="fusionflow.loader"):
        _, labels = collect(ld)
    assert sorted(i for y in labels for i in y.tolist()) == list(range(16))
    # not per mini-batch: once, when the epoch's end stopped the accelerator and its pipelines were gone
    assert failing.closes == 1 and "giving the arena back failed" in caplog.text
    ld.close()


def test_a_rebuild_runs_with_the_arena_paused_and_a_failing_pause_never_stops_it(monkeypatch, caplog):
    """MemoryBridge.paused: nothing before the arena is lent; while lent, DALI's own pool for the body (native
    pause, then resume); a native failure is logged and the body runs all the same."""
    mb, lib, alloc = stand_ins(monkeypatch)
    bridge = mb.MemoryBridge("cuda:0", 64 * MIB)
    try:
        with bridge.paused():
            pass
        assert lib.pauses == []  # nothing lent yet
        bridge.arm(types.SimpleNamespace(cuda_stream=11))
        bridge.lend(tiny_batches_done=0)
        ran = []
        with bridge.paused():
            ran.append(list(lib.pauses))
        assert ran == [[1]] and lib.pauses == [1, 0]

        def failing(device, paused, err, errlen):
            raise RuntimeError("native pause failed (stand-in)")

        lib.ff_bridge_pause = failing
        with caplog.at_level("ERROR", logger="fusionflow.accel.bridge.memory_bridge"), bridge.paused():
            ran.append("body")
        assert ran[-1] == "body" and "pausing the arena failed" in caplog.text
    finally:
        bridge.shutdown()


def test_the_pipeline_is_rebuilt_inside_its_build_guard_only():
    """DaliPolicyPipeline: the first build (ahead of time) outside the guard, a rebuild after a discarded run
    inside it (the accelerator sets the bridge's `paused` there)."""
    pytest.importorskip("nvidia.dali")
    import contextlib

    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    entered = []

    @contextlib.contextmanager
    def guard():
        entered.append("in")
        yield

    data = Bytes(2)
    pipe = DaliPolicyPipeline(SMALL, 2)
    try:
        pipe.build_guard = guard
        pipe.run([data[0][0], data[1][0]], [0, 1])
        assert entered == []
        pipe.reset()  # a failure outside DALI: the next submit rebuilds
        pipe.run([data[0][0], data[1][0]], [0, 1])
        assert entered == ["in"] and pipe.rebuilds == 1
    finally:
        pipe.close()
