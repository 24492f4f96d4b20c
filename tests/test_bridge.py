"""The allocator bridge end to end: PyTorch side (snapshot parsing, lending), the native DALI
resource (builds and loads against the stock DALI wheel here; serves DALI on a GPU), and the
loader's `memory_bridge` argument. GPU tests are marked and skipped without one."""

import os

import numpy as np
import pytest
import torch
from dali_numpy import run_numpy
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401

from fusionflow import native
from fusionflow.accel.bridge.ledger import Block
from fusionflow.accel.bridge.torch_side import MIN_BLOCK, free_cached_blocks, plan_requests
from fusionflow.loader import FusionFlowLoader

MIB = 1 << 20


def segment(address, blocks, stream=0, device=0, kind="large", expandable=False, with_addresses=True):
    out, cur = [], address
    for size, state in blocks:
        b = {"size": size, "state": state, "requested_size": size}
        if with_addresses:
            b["address"] = cur
        out.append(b)
        cur += size
    return {
        "device": device,
        "address": address,
        "total_size": cur - address,
        "stream": stream,
        "segment_type": kind,
        "is_expandable": expandable,
        "blocks": out,
    }


@pytest.mark.parametrize("with_addresses", [True, False])
def test_free_cached_blocks_from_a_snapshot(with_addresses):
    segs = [
        segment(
            0x10000000,
            [
                (20 * MIB, "active_allocated"),
                (8 * MIB, "inactive"),
                (MIB, "inactive"),
                (4 * MIB, "active_pending_free"),
                (6 * MIB, "inactive"),
            ],
            with_addresses=with_addresses,
        ),
        segment(0x20000000, [(10 * MIB, "inactive")], stream=77),  # another stream's pool
        segment(0x30000000, [(10 * MIB, "inactive")], device=1),
        segment(0x40000000, [(MIB, "inactive")], kind="small"),
        segment(0x50000000, [(10 * MIB, "inactive")], expandable=True),
    ]
    got = free_cached_blocks(segs, device=0, stream=0)
    assert [(b.address, b.size) for b in got] == [(0x10000000 + 20 * MIB, 8 * MIB), (0x10000000 + 33 * MIB, 6 * MIB)]
    assert MIN_BLOCK == 2 * MIB  # the 1 MiB block was left out because of it
    assert [b.address for b in free_cached_blocks(segs, device=0, stream=77)] == [0x20000000]


def test_blocks_go_out_in_chunks_largest_first():
    blocks = [Block(0x1000, 150 * MIB), Block(0x9000, 3 * MIB), Block(0x5000, 64 * MIB + MIB)]
    assert plan_requests(blocks, chunk=64 * MIB) == [64 * MIB] * 3 + [22 * MIB, 3 * MIB]  # 1 MiB tails stay
    assert plan_requests([Block(0, 10 * MIB)], chunk=4 * MIB, min_block=2 * MIB) == [4 * MIB, 4 * MIB, 2 * MIB]
    assert sum(plan_requests(blocks, chunk=512)) == sum(b.size for b in blocks)


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
            memory_bridge.MemoryBridge("cuda:0")
    finally:
        memory_bridge._IN_USE.discard(0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"memory_bridge": "sometimes"}, r"memory_bridge='sometimes' must be one of"),
        (
            {"memory_bridge": "on"},
            r"memory_bridge='on' lends PyTorch's free GPU blocks to DALI on the GPU, but "
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
    """Stands in for MemoryBridge's CUDA side, recording the window protocol the loader drives."""

    def __init__(self):
        import threading

        self.armed, self.lends, self.closes, self.lent_outside, self.shutdowns = False, 0, 0, 0, 0
        self.stats = type(
            "S", (), dict(windows=0, lent_bytes=0, borrowed_bytes=0, fallback_bytes=0, pinned_bytes=0, seconds=0.0)
        )()
        self.main = threading.get_ident()

    def arm(self, stream):
        self.armed = True

    def lend(self, tiny_batches_done):
        import threading

        assert threading.get_ident() != self.main  # the accelerator thread asks
        self.lends += 1
        self.lent_outside += not self.armed

    def close(self):
        self.armed = False
        self.closes += 1

    def shutdown(self):
        self.shutdowns += 1


def test_window_protocol_accelerator_works_only_inside_next(monkeypatch):
    """With a bridge, temporal sharing is strict: the accelerator takes tiny-batches only between
    the start of next() and the batch being ready, asks to borrow there, and every window is closed
    before the batch is handed over. Real loader, real DALI (CPU backend); the CUDA calls are what
    the stand-in replaces."""
    rec = RecordingBridge()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ld = FusionFlowLoader(
        Bytes(40), batch_size=8, num_workers=1, policy=SMALL, tiny_batch_size=2, accelerator="dali-cpu", seed=4
    )
    ld.parts.gpu.bridge = rec  # what GpuSession._start_bridge sets up on a GPU
    seen = []
    for _, y in ld:
        assert not rec.armed  # closed before the batch reached us
        accel = ld.parts.gpu.accel
        assert accel.gated and not accel.window_open and accel.in_flight == 0
        seen += y.tolist()
    assert sorted(seen) == list(range(40))
    # one lend per DALI run (a run may take several tiny-batches of one mini-batch: max_images)
    assert ld.stats.accelerator_tiny_batches > 0 and rec.lends == ld.stats.accelerator_runs
    assert rec.lent_outside == 0 and rec.closes >= 5
    ld.close()
    assert rec.shutdowns == 1


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_lender_takes_free_cached_blocks_without_reserving_more():
    from fusionflow.accel.bridge.torch_side import TorchLender

    dev = torch.device("cuda:0")
    x = [torch.empty(s * MIB, dtype=torch.uint8, device=dev) for s in (64, 32, 8)]
    del x
    reserved, allocated = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
    lender = TorchLender(dev)
    stream = torch.cuda.current_stream(dev)
    blocks = lender.lend(None, stream)
    assert sum(b.size for b in blocks) >= 100 * MIB
    assert torch.cuda.memory_reserved(dev) == reserved
    assert torch.cuda.memory_allocated(dev) >= allocated + sum(b.size for b in blocks)  # a <=1 MiB tail rides along
    y = torch.empty(8 * MIB, dtype=torch.uint8, device=dev)  # PyTorch cannot be handed a lent block
    assert all(not (b.address <= y.data_ptr() < b.address + b.size) for b in blocks)
    del y
    lender.take_back(blocks)
    assert torch.cuda.memory_allocated(dev) == allocated


@pytest.mark.gpu
def test_dali_runs_in_lent_blocks_and_gives_them_back():
    from fusionflow.accel.bridge.memory_bridge import MemoryBridge
    from fusionflow.accel.dali_graph import DaliPolicyPipeline

    dev = torch.device("cuda:0")
    bridge = MemoryBridge(dev, warmup=0)  # installed before the pipeline exists
    ds = Bytes(16)
    pipe = DaliPolicyPipeline(SMALL, 8, device="gpu", device_id=0)
    ref = [np.asarray(run_numpy(pipe, ds.data[i : i + 8], list(range(i, i + 8)), seed=3)) for i in (0, 8)]
    x = torch.empty(1024 * MIB, dtype=torch.uint8, device=dev)
    del x
    reserved = torch.cuda.memory_reserved(dev)
    for i, want in zip((0, 8), ref):
        bridge.arm(torch.cuda.current_stream(dev))
        bridge.lend(tiny_batches_done=99)
        got = run_numpy(pipe, ds.data[i : i + 8], list(range(i, i + 8)), seed=3)
        bridge.close()
        assert np.array_equal(got, want)  # same output from lent memory
    assert bridge.stats.windows == 2 and bridge.stats.lent_bytes >= 512 * MIB
    assert bridge.stats.borrowed_bytes > 0  # DALI really allocated from the lent blocks
    assert torch.cuda.memory_reserved(dev) == reserved
    pipe.close()
    del pipe
    ledger_name = bridge.ledger.name  # shutdown() drops the ledger
    bridge.shutdown()
    assert bridge.stats.pinned_bytes == 0
    assert not os.path.exists("/dev/shm" + ledger_name)


@pytest.mark.gpu
def test_loader_with_bridge_delivers_every_sample_once():
    ds = Bytes(48)
    ld = FusionFlowLoader(
        ds,
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        device="cuda:0",
        accelerator="dali-gpu",
        gpu_sharing="temporal",
        memory_bridge="on",
        seed=4,
        persistent_workers=True,
    )
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")  # something for PyTorch to lend
    del x
    for epoch in (0, 1):
        ld.set_epoch(epoch)
        _, labels = collect(ld)
        assert sorted(i for y in labels for i in y.tolist()) == list(range(48))
    s = ld.stats
    assert s.memory_bridge == "on" and s.accelerator_tiny_batches > 0
    assert s.bridge_windows > 0 and s.bridge_lent_bytes > 0 and s.bridge_borrowed_bytes > 0
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
record E0 on T
wait T for E1
close returned 1 0x10000000
close refused: cap
-- a free whose event record fails
record E0 on T
wait S2 for E0
r 0x20000000
record E2 on S2 fails
host syncs S2
close returned 1 0x20000000
"""


def test_dali_resource_orders_streams_by_events(tmp_path):
    """The real BridgeResource class, compiled against the DALI wheel's headers with the CUDA
    calls it makes replaced by logging fakes (tests/native/bridge_resource_harness.cc): outside a
    window everything goes to DALI's pool; inside, the first use of lent memory on a stream waits
    for the lender's event, reuse of a range freed on another stream waits for that free's event, a
    host-synchronous allocation waits on the host, a free records its stream's event at the free, and
    close makes the lender's stream wait for exactly the frees since the last close, returning only
    blocks nothing holds. A free whose event record fails (cudaErrorCudartUnloading at exit) never
    throws into DALI's deleter (that would be std::terminate): the host waits for the stream instead."""
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


def test_auto_bridge_falls_back_on_any_start_failure_and_window_close_failures_are_contained(monkeypatch, caplog):
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
        device_ring,
        "copy_out",
        lambda out, dst, stream: dst.copy_(torch.from_numpy(np.stack([np.array(out[i]) for i in range(len(out))]))),
    )

    def no_posix_ipc(device):
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
    monkeypatch.setattr(bridge_mod, "MemoryBridge", lambda device: failing)
    ld = FusionFlowLoader(Bytes(16), **args)
    ld.parts.delivery.alloc_device = torch.device("cpu")
    with caplog.at_level("ERROR", logger="fusionflow.loader"):
        _, labels = collect(ld)
    assert sorted(i for y in labels for i in y.tolist()) == list(range(16))
    assert failing.closes >= 2 and "closing the prep window failed" in caplog.text
    ld.close()
