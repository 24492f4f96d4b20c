"""GPU delivery's CUDA protocol, run on a CPU: the real loader, local manager, accelerator thread and
device ring, with `torch.cuda` replaced by a recording fake (tests/fake_cuda.py), DALI's CPU backend
standing in for its GPU pipeline and the delivered tensors kept on the CPU. Checked: one device
(the loader's, cuda:1, while cuda:0 is current) for every CUDA call; nothing on a default stream;
the accelerator copies on its own stream; every event blocking and recorded on the stream that did
the work; the training stream waits for the accelerator's copies; no synchronous host-to-device
copy per batch; the ring registered portable and unregistered only after the last copy finished."""

import os
import re
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from fake_cuda import FakeCuda  # noqa: E402
from test_loader import SMALL, Bytes, no_leaks  # noqa: E402,F401

from fusionflow.accel import (
    dali_graph,  # noqa: E402
    device_ring,  # noqa: E402
)
from fusionflow.accel.device_ring import accel_runs  # noqa: E402
from fusionflow.errors import FusionFlowError  # noqa: E402
from fusionflow.loader import FusionFlowLoader  # noqa: E402
from fusionflow.runtime import cuda_host  # noqa: E402


class CpuStandIn(dali_graph.DaliPolicyPipeline):
    """The accelerator's 'GPU' pipeline, on DALI's CPU backend."""

    collected_on: list = []  # the stream each collect was given (class-wide: the accelerator builds its own)

    def __init__(self, policy, batch_size, device="cpu", device_id=None, **kw):
        self.asked = (device, device_id)
        super().__init__(policy, batch_size, device="cpu", device_id=None, **kw)

    def collect(self, stream=None):
        CpuStandIn.collected_on.append(stream)
        return super().collect(stream)  # a CPU pipeline: DALI's outputs are host-ordered whatever the stream


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda(devices=2)
    cuda.install(monkeypatch, torch)
    monkeypatch.setattr(dali_graph, "DaliPolicyPipeline", CpuStandIn)
    monkeypatch.setattr(CpuStandIn, "collected_on", [])

    views = set()  # the storages of DALI's outputs as the ring sees them

    def dali_view(out):  # DALI's outputs in place (its CUDA array interface): here a host array
        view = torch.from_numpy(np.stack([np.array(out[i]) for i in range(len(out))]))
        views.add(view.untyped_storage().data_ptr())
        return view

    monkeypatch.setattr(device_ring, "dali_view", dali_view)
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):  # a copy out of DALI's outputs: on which stream, blocking or not
        if src.untyped_storage().data_ptr() in views:
            cuda.log("copy", stream=cuda.current_stream(1), non_blocking=non_blocking)
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # host->device copies: from where, blocking or not, on which stream
        cuda.log(
            "h2d",
            ptr=self.data_ptr(),
            nbytes=self.nbytes,
            non_blocking=kwargs.get("non_blocking", False),
            stream=cuda.current_stream(1),
        )
        out = real_to(self, *args, **kwargs)
        return out.clone() if out.data_ptr() == self.data_ptr() else out  # a copy, as on a real device

    monkeypatch.setattr(torch.Tensor, "to", to)

    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            cuda.log("h2d_tensor", non_blocking=False, ptr=0, nbytes=0, stream=cuda.current_stream(1))
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return cuda


class WorkerSlowBytes(Bytes):
    """Bytes read 20 ms slower in a CPU worker (not in the training process): in temporal mode the accelerator
    runs only inside next()'s window, and a fast worker on a busy machine could otherwise take every share
    before a window opens (the run checks the accelerator's delivery, so it must get work)."""

    def __init__(self, n):
        super().__init__(n)
        self.home = os.getpid()

    def __getitem__(self, i):
        if os.getpid() != self.home:
            time.sleep(0.02)
        return super().__getitem__(i)


@pytest.mark.parametrize("sharing", ["temporal", "spatial"])
def test_gpu_delivery_uses_one_device_own_streams_blocking_events_and_no_sync_copies(
    fake, no_leaks, sharing, monkeypatch
):
    train = fake.Stream(device=1)  # the training loop's stream on the loader's device
    ld = FusionFlowLoader(
        WorkerSlowBytes(40),
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        seed=4,
        device="cuda:1",
        accelerator="dali-gpu",
        gpu_sharing=sharing,
        memory_bridge="off",
        timeout=60,
    )
    ld.parts.delivery.alloc_device = torch.device(
        "cpu"
    )  # the tensors stay on the CPU; every CUDA call goes to the fake
    view = device_ring.dali_view
    windows, stepping = [], [False]

    def view_in_window(out):
        windows.append(not stepping[0])  # the training thread is inside next(), not in its step
        return view(out)

    monkeypatch.setattr(device_ring, "dali_view", view_in_window)
    seen = []
    with fake.stream(train):
        for images, labels in ld:
            assert images.shape == (len(labels), 3, 24, 24)
            seen += labels.tolist()
            stepping[0] = True
            time.sleep(0.05)  # the training step: the accelerator must not work now in temporal mode
            stepping[0] = False
    ld.close()
    assert sorted(seen) == list(range(40))
    assert ld.stats.accelerator_tiny_batches > 0  # the merged delivery ran
    assert ld._manager is None

    r = fake.records
    accel_stream = {x["stream"] for x in fake.of("copy")}
    assert len(accel_stream) == 1 and all(x["non_blocking"] for x in fake.of("copy"))
    (accel_stream,) = accel_stream
    assert not accel_stream.default and accel_stream.device_index == 1
    # DALI's outputs are asked for ordered on that stream, and the host waits for DALI's work on it through a
    # blocking event before each copy (asleep; outside the ring write, so `watch` may give a hung run up)
    assert CpuStandIn.collected_on and all(s is accel_stream for s in CpuStandIn.collected_on)
    mine = [x for x in r if x["thread"] == "fusionflow-accelerator" and x["kind"] in ("copy", "host_wait")]
    mine = [x["kind"] for x in mine if x["kind"] == "copy" or x["event"].stream is accel_stream]
    writes = "".join("c" if k == "copy" else "w" for k in mine)  # a write: its copies, then the host's wait
    assert "c" in writes and re.fullmatch(r"w+(c+w+)*", writes), writes
    # 1. nothing on a default stream, every CUDA call with the loader's device current
    for x in r:
        if "stream" in x:
            assert not x["stream"].default and x["stream"].device_index == 1, x
        if x["kind"] not in ("h2d", "h2d_tensor", "host_wait"):  # .to(device), event sync: any device current
            assert x["device"] == 1, x
    # 2. events: blocking, recorded on the stream that did the work
    records = fake.of("record")
    assert records and all(x["event"].blocking for x in records)
    assert {x["stream"] for x in records if x["thread"] == "fusionflow-accelerator"} == {accel_stream}
    assert {x["stream"] for x in records if x["thread"] != "fusionflow-accelerator"} == {train}
    assert all(x["event"].stream is not None for x in fake.of("host_wait"))
    # the accelerator's copies are waited for: by the host before the slot is reported, by the training stream
    waits = fake.of("wait")
    assert waits and all(x["stream"] is train and x["event"].stream is accel_stream for x in waits)
    # 3. no synchronous host->device copy: every one non-blocking, from the registered (pinned) ring
    (reg,) = fake.of("host_register")
    assert reg["flags"] == cuda_host.HOST_REGISTER_PORTABLE
    lo, hi = reg["ptr"], reg["ptr"] + reg["size"]
    h2d = fake.of("h2d") + fake.of("h2d_tensor")
    assert h2d and all(x["non_blocking"] and lo <= x["ptr"] and x["ptr"] + x["nbytes"] <= hi for x in h2d), h2d
    assert all(x["stream"] is train for x in h2d)
    # 4. temporal: the accelerator works only inside next() (the prep window), after waiting (host,
    # blocking) for the training stream's step event
    if sharing == "temporal":
        assert windows and all(windows)
        step_waits = [
            x for x in fake.of("host_wait") if x["thread"] == "fusionflow-accelerator" and x["event"].stream is train
        ]
        assert step_waits
    # 5. teardown: the last batch's copy event is waited for before the ring is unregistered
    unreg = next(i for i, x in enumerate(r) if x["kind"] == "host_unregister")
    last_record = max(i for i, x in enumerate(r) if x["kind"] == "record" and x["stream"] is train)
    assert any(x["kind"] == "host_wait" and x["event"] is r[last_record]["event"] for x in r[last_record:unreg])


def test_failed_host_register_clears_cudas_last_error_or_says_it_cannot(fake, monkeypatch, no_leaks):
    fake.cudart_.register_rc = 1  # cudaErrorInvalidValue
    cleared = []
    monkeypatch.setattr(cuda_host, "clear_last_error", lambda: cleared.append(fake.current_device()) or True)
    ld = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, device="cuda:1", timeout=60)
    ld.parts.delivery.alloc_device = torch.device("cpu")
    seen = [y.tolist() for _, y in ld]
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]] and cleared == [1]
    assert not fake.of("host_unregister")  # nothing was registered
    ld.close()
    monkeypatch.setattr(cuda_host, "clear_last_error", lambda: False)
    ld = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, device="cuda:1", timeout=60)
    with pytest.raises(FusionFlowError, match="last error could not be reset"):
        next(iter(ld))
    ld.close()


def test_a_cuda_device_without_index_is_resolved_once(fake):
    with fake.device(1):
        ld = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, device="cuda")
    assert ld.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:5': this process sees 2 CUDA device"):
        FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, device="cuda:5")


def test_accelerator_runs_are_slices():
    assert accel_runs([6, 7, 0, 1, 4]) == [(0, 2), (4, 5), (6, 8)]
    assert accel_runs([]) == []


@pytest.mark.parametrize("accelerator", [None, "dali-gpu"])
def test_one_slot_on_the_gpu_path_delivers_the_whole_epoch(fake, no_leaks, accelerator):
    """prefetch_factor=1 with CUDA delivery: the only ring slot is held until the caller's next
    next() (its copies may still run), so that call must release it and submit the next mini-batch
    before deciding the epoch is over. The whole epoch arrives, each sample once."""
    ld = FusionFlowLoader(
        Bytes(40),
        batch_size=8,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        seed=4,
        device="cuda:1",
        accelerator=accelerator,
        memory_bridge="off",
        prefetch_factor=1,
        timeout=60,
    )
    ld.parts.delivery.alloc_device = torch.device("cpu")
    with fake.stream(fake.Stream(device=1)):
        seen = [y for _, labels in ld for y in labels.tolist()]
    ld.close()
    assert sorted(seen) == list(range(40))


def test_a_dali_run_of_several_tiny_batches_lands_in_their_positions(fake):
    """One DALI run holding tiny-batches at positions 4-5 and 0-1 (not adjacent): copied slice by slice
    out of DALI's buffer on the accelerator's stream, nothing staged; no host-to-device copy, nothing on a
    default stream, and the slot's event recorded after the copies."""
    from fusionflow.runtime.shm import RingLayout

    ring = device_ring.DeviceRing(RingLayout(2, 6, (1, 2, 2), "uint8"), torch.device("cuda:1"), torch.device("cpu"))
    ring.images.zero_()
    out = [np.full((1, 2, 2), v, np.uint8) for v in (10, 11, 20, 21)]
    ring.write(1, [4, 5, 0, 1], out)
    assert [int(ring.images[1, p, 0, 0, 0]) for p in range(6)] == [20, 21, 0, 0, 10, 11]
    assert int(ring.images[0].sum()) == 0
    assert not fake.of("h2d") and not fake.of("h2d_tensor")
    copies = fake.of("copy")
    assert len(copies) == 2 and all(c["stream"] is ring.stream and c["non_blocking"] for c in copies)
    ring.write(0, [2, 3], out[:2])  # adjacent positions: one copy
    assert [int(ring.images[0, p, 0, 0, 0]) for p in range(6)] == [0, 0, 10, 11, 0, 0]
    assert len(fake.of("copy")) == 3
    with pytest.raises(ValueError, match=r"DALI gave \(2, 1, 2, 2\) torch.uint8, the ring takes \(3, 1, 2, 2\)"):
        ring.write(0, [0, 1, 2], out[:2])  # a run's outputs must be its samples'


def test_a_run_holding_shares_of_two_mini_batches_lands_in_both_slots(fake):
    """Positions 0-1 of slot 1 and 0-1 of slot 0 in one run: copied per (slot, run of positions), and both
    slots' events are the copies'."""
    from fusionflow.runtime.shm import RingLayout

    ring = device_ring.DeviceRing(RingLayout(2, 4, (1, 2, 2), "uint8"), torch.device("cuda:1"), torch.device("cpu"))
    ring.images.zero_()
    out = [np.full((1, 2, 2), v, np.uint8) for v in (10, 11, 20, 21)]
    ring.write([1, 1, 0, 0], [0, 1, 0, 1], out)
    assert [int(ring.images[s, p, 0, 0, 0]) for s in (0, 1) for p in range(4)] == [20, 21, 0, 0, 10, 11, 0, 0]
    assert ring.ready[0] is ring.ready[1] is not None
    assert not fake.of("h2d") and not fake.of("h2d_tensor")


@pytest.mark.gpu
def test_dali_outputs_land_exactly_with_runs_in_flight():
    """On a GPU: three DALI runs in flight, each collected ordered on the ring's stream and written through
    DALI's buffer in place (its CUDA array interface) -- one slot whole, one split over two slots -- equal
    DALI's own copy of its outputs to the host, bit for bit."""
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.runtime.shm import RingLayout

    data = Bytes(12)
    pipe = DaliPolicyPipeline(SMALL, 4, device="gpu", device_id=0, num_threads=2, depth=3)
    ring = device_ring.DeviceRing(RingLayout(3, 4, (3, 24, 24), "uint8"), torch.device("cuda:0"))
    try:
        for k in range(3):
            pipe.submit([data[i][0] for i in range(4 * k, 4 * k + 4)], list(range(4 * k, 4 * k + 4)), seed=1)
        for k, (slots, positions) in enumerate([(0, [0, 1, 2, 3]), ([1, 1, 2, 2], [2, 3, 0, 1]), (1, [0, 1, 2, 3])]):
            out = pipe.collect(ring.stream)
            ring.wait_for_outputs()
            ring.write(slots, positions, out)
            want = torch.from_numpy(np.asarray(out.as_cpu().as_tensor()))
            slots = [slots] * 4 if isinstance(slots, int) else slots
            got = torch.stack([ring.images[s, p].cpu() for s, p in zip(slots, positions)])
            assert torch.equal(got, want), k
    finally:
        pipe.close()


@pytest.mark.gpu
def test_a_drained_gpu_pipeline_is_kept_and_its_next_runs_equal_a_fresh_pipeline_s():
    """On a GPU: an epoch left with three DALI runs in flight is drained on the device ring's stream (waited for on
    a blocking event, not DALI's spinning host order) and its pipeline kept; the next epoch's runs, collected on a
    new ring's stream, equal a fresh pipeline's outputs bit for bit."""
    import types

    from fusionflow.accel.accelerator import AcceleratorWorker
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.runtime.shm import RingLayout

    data, layout = Bytes(12), RingLayout(3, 4, (3, 24, 24), "uint8")
    runs = [([data[i][0] for i in range(4 * k, 4 * k + 4)], list(range(4 * k, 4 * k + 4))) for k in range(3)]
    pipe = DaliPolicyPipeline(SMALL, 4, device="gpu", device_id=0, num_threads=2, depth=3)
    fresh = DaliPolicyPipeline(SMALL, 4, device="gpu", device_id=0, num_threads=2, depth=3)
    try:
        for samples, indices in runs:
            pipe.submit(samples, indices, seed=1, epoch=0)
        accel, kept = AcceleratorWorker.__new__(AcceleratorWorker), []
        accel.pipeline, accel.keep_pipeline, accel.ledger = pipe, kept.append, types.SimpleNamespace(retired=None)
        accel.device_ring = device_ring.DeviceRing(layout, torch.device("cuda:0"))
        accel._collecting = None
        accel._drain()
        accel._release(pipe)
        assert kept == [pipe] and pipe.idle
        ring = device_ring.DeviceRing(layout, torch.device("cuda:0"))  # the next epoch's, on a stream of its own
        for samples, indices in runs:
            pipe.submit(samples, indices, seed=1, epoch=1)
            fresh.submit(samples, indices, seed=1, epoch=1)
        for k in range(3):
            out = pipe.collect(ring.stream)
            ring.wait_for_outputs()
            ring.write(k, [0, 1, 2, 3], out)
            want = torch.from_numpy(np.asarray(fresh.collect().as_cpu().as_tensor()))
            assert torch.equal(ring.images[k].cpu(), want), k
    finally:
        pipe.close()
        fresh.close()
