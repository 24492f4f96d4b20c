"""The loader's parts, each built and driven alone (fusionflow/loader/checkpoint.py, loader/delivery.py,
loader/trace.py, accel/session.py, loader/lifecycle.py, loader/epoch.py), and the loader's shape: it holds its
configuration and the parts; each iteration's state lives in the iterator it returns."""

import gc
import json
import threading
import warnings
import weakref

import numpy as np
import pytest
import torch
from test_loader import SMALL, Bytes, no_leaks  # noqa: F401
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from fusionflow import FusionFlowError
from fusionflow.accel.session import GpuSession
from fusionflow.errors import SampleError
from fusionflow.loader import FusionFlowLoader
from fusionflow.loader.checkpoint import Checkpoint
from fusionflow.loader.config import resolve_config
from fusionflow.loader.delivery import Delivery
from fusionflow.loader.epoch import InlineIterator, WorkerIterator
from fusionflow.loader.lifecycle import LoaderRuntime
from fusionflow.loader.stats import LoaderStats
from fusionflow.loader.trace import Tracing
from fusionflow.runtime.host import Host
from fusionflow.runtime.messages import SampleFailure


# ---------------------------------------------------------------------------------- Checkpoint
def _samplers(n=10, bs=3, generator=None):
    sampler = RandomSampler(range(n), generator=generator) if generator is not None else SequentialSampler(range(n))
    return sampler, BatchSampler(sampler, bs, False)


def test_checkpoint_counts_epochs_as_the_loader_does():
    cp = Checkpoint()
    assert cp.begin()[0] == 0  # first iteration: epoch 0
    assert cp.begin()[0] == 1  # no set_epoch: the previous + 1
    cp.set_epoch(7, sampler=None)
    assert cp.begin()[0] == 7 and cp.begin()[0] == 8
    with pytest.raises(ValueError, match=r"epoch=-1 must be a non-negative integer"):
        cp.set_epoch(-1, sampler=None)
    # past the draw's epoch field it was taken, and every sample of that epoch and the next failed
    with pytest.raises(ValueError, match=r"epoch=1180591620717411303424 must be a non-negative integer below 2\*\*63"):
        cp.set_epoch(2**70, sampler=None)
    cp.set_epoch(np.int64(3), sampler=None)  # numpy's integers, as a sampler's set_epoch takes them
    assert cp.begin()[0] == 3 and type(cp.epoch) is int


def test_checkpoint_reads_only_the_newest_iterations_progress():
    cp = Checkpoint()
    sampler, bsampler = _samplers()
    shape = {"dataset_len": 10, "batch_size": 3, "drop_last": False, "num_batches": 4}
    _, old = cp.begin()
    list(cp.batches(old, bsampler, sampler))
    old.yielded = 3
    _, new = cp.begin()
    batches = cp.batches(new, bsampler, sampler)
    next(batches)
    new.yielded = 1
    old.yielded = 4  # an abandoned iterator going on changes nothing
    state = cp.state_dict(shape, 0, bsampler, sampler)
    assert state["batches_yielded"] == 1 and state["epoch"] == 1
    new.done = True
    assert cp.state_dict(shape, 0, bsampler, sampler)["batches_yielded"] is None  # between epochs

    resumed = Checkpoint()
    resumed.load_state_dict(state, shape, bsampler, sampler)
    epoch, progress = resumed.begin()
    assert epoch == 1 and progress.yielded == 1
    assert [b for b in resumed.batches(progress, bsampler, sampler)] == [[3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(
        ValueError,
        match=r"the state is from a loader with batch_size=3, this loader has "
        r"batch_size=4",
    ):
        Checkpoint().load_state_dict(state, {**shape, "batch_size": 4}, bsampler, sampler)


# ---------------------------------------------------------------------------------- Delivery
def _failure(position, index):
    return SampleFailure(
        position=position, index=index, what=f"sample {index}", exc_type="DecodeError", message="bad", traceback="tb"
    )


def test_delivery_applies_on_error_and_counts():
    stats = LoaderStats()
    raising = Delivery(stats, torch.device("cpu"), pin_memory=False, on_error="raise")
    assert raising.select(4, []) is None
    with pytest.raises(SampleError, match="sample 11"):
        raising.select(4, [_failure(2, 12), _failure(1, 11)])
    skipping = Delivery(stats, torch.device("cpu"), pin_memory=False, on_error="skip")
    with pytest.warns(UserWarning, match=r"on_error='skip': dropping sample 11"):
        assert skipping.select(4, [_failure(2, 12), _failure(1, 11)]) == [0, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per loader
        assert skipping.select(2, [_failure(0, 5)]) == [1]
    assert stats.skipped == 3 and stats.skipped_indices == [11, 12, 5] and stats.skipped_by_cause == {"corrupt": 3}
    skipping.account(0.5, 3)
    assert (stats.batches, stats.samples, stats.wait_seconds) == (1, 3, [0.5])


def test_delivery_hands_out_copies_the_caller_owns():
    ring = np.arange(2 * 3 * 2 * 2, dtype=np.uint8).reshape(2, 3, 2, 2)
    labels = np.array([4, 5], np.int64)
    images_t, labels_t, event = Delivery(LoaderStats(), torch.device("cpu"), False, "raise").deliver(ring, labels)
    ring[:] = 0  # the ring slot is reused
    labels[:] = 0
    assert event is None and images_t.sum() > 0 and labels_t.tolist() == [4, 5]
    assert Delivery(LoaderStats(), torch.device("cpu"), False, "raise").collate_targets([0.5, 1.5]).tolist() == [
        0.5,
        1.5,
    ]


# ---------------------------------------------------------------------------------- Tracing
def test_tracing_block_installs_the_recorder_and_writes_the_file(tmp_path):
    changes = []
    tracing = Tracing()
    tracing.on_change = changes.append
    tracing.wait(0.1, 0, 4)  # nothing to record into: a no-op
    with tracing.block(tmp_path / "t.json") as recorder:
        tracing.wait(0.001, 0, 4)
        with pytest.raises(ValueError, match="one trace at a time"):
            with tracing.block(tmp_path / "u.json"):
                pass
    assert changes == [recorder, None] and tracing.recorder is None
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["wait mb0"]

    whole = Tracing(str(tmp_path / "run.json"))
    whole.wait(0.001, 3, 2)
    whole.flush()
    assert "wait mb3" in (tmp_path / "run.json").read_text()


# ---------------------------------------------------------------------------------- GpuSession
class _Bridge:
    def __init__(self):
        self.closes = self.shutdowns = 0
        self.stats = type(
            "S",
            (),
            {
                "lends": 2,
                "lent_bytes": 10,
                "borrowed_bytes": 5,
                "fallback_bytes": 0,
                "pinned_bytes": 0,
                "seconds": 0.25,
            },
        )()

    def close(self):
        self.closes += 1

    def shutdown(self):
        self.shutdowns += 1


def test_gpu_session_shutdown_steps_with_nothing_started():
    stats = LoaderStats()
    gpu = GpuSession(
        stats,
        accelerator="dali-gpu",
        device=torch.device("cuda", 0),
        gpu_sharing="auto",
        aot=True,
        taas=True,
        taas_last_k=True,
        memory_bridge="auto",
        bridge_why_off=None,
    )
    bridge = gpu.bridge = _Bridge()
    gpu.end_window_now(mgr=None)  # no accelerator: no window to close
    gpu.manager_stopped(stats)
    assert bridge.closes == 1 and stats.bridge_lends == 2 and stats.bridge_max_lent_bytes == 10
    assert gpu.accel is None and gpu.device_ring is None and gpu.profiler is None
    gpu.shutdown_bridge()
    gpu.shutdown_bridge()  # idempotent
    assert bridge.shutdowns == 1 and gpu.bridge is None


# ---------------------------------------------------------------------------------- LoaderRuntime
def _config(**kw):
    ds = Bytes(16)
    kw = {"batch_size": 4, "num_workers": 1, "policy": SMALL, "tiny_batch_size": 2, "seed": 3, **kw}
    names = (
        "shuffle",
        "sampler",
        "batch_sampler",
        "collate_fn",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "device",
        "on_error",
        "max_retries",
        "pin_workers",
        "accelerator",
        "gpu_sharing",
        "aot",
        "taas",
        "taas_last_k",
        "global_manager",
        "memory_bridge",
        "trace",
        "stage_times",
        "remote_workers",
    )
    defaults = {n: None for n in names}
    defaults.update(
        pin_memory=False,
        drop_last=False,
        timeout=0,
        persistent_workers=False,
        device="cpu",
        on_error="raise",
        max_retries=2,
        pin_workers=False,
        gpu_sharing="auto",
        aot=True,
        taas=True,
        taas_last_k=True,
        global_manager=None,
        memory_bridge="auto",
        stage_times=False,
    )
    return ds, resolve_config(ds, **{**defaults, **kw}, host=Host(cores=lambda: 2), notes=[])


def test_workers_start_once_stop_and_are_finalized_when_dropped(no_leaks):
    ds, cfg = _config()
    workers = LoaderRuntime(ds, LoaderStats(), Tracing())
    mgr = workers.start(cfg, torch.device("cpu"))
    assert workers.start(cfg, torch.device("cpu")) is mgr and workers.manager is mgr
    workers.stop()
    assert workers.manager is None and mgr._closed
    again = workers.start(cfg, torch.device("cpu"))
    assert again is not mgr
    ref = weakref.ref(again)
    del workers, again  # the finalizer shuts the manager down; nothing refers back to it
    gc.collect()
    assert ref() is None
    assert not [t for t in threading.enumerate() if t.name == "fusionflow-manager" and t.is_alive()]


# ---------------------------------------------------------------------------------- the loader's shape
def test_the_loader_is_composed_and_each_iteration_owns_its_state(no_leaks):
    assert FusionFlowLoader.__bases__ == (object,)
    assert "tiny_batch_size" in FusionFlowLoader.__doc__ and "memory_bridge" in FusionFlowLoader.__doc__
    inline = FusionFlowLoader(Bytes(8), batch_size=4, policy=SMALL)
    assert isinstance(iter(inline), InlineIterator)
    loader = FusionFlowLoader(Bytes(16), batch_size=4, num_workers=1, policy=SMALL, persistent_workers=True)
    assert loader.batch_size == 4 and loader.num_workers == 1 and loader.seed == loader.config.seed
    with pytest.raises(AttributeError):
        loader.batch_size = 8  # as DataLoader: configuration is fixed after construction
    first, second = iter(loader), iter(loader)
    assert isinstance(first, WorkerIterator) and first is not second
    assert loader._manager is None  # nothing starts before the first next()
    next(first)
    next(second)  # a newer iteration abandons the older one's unfinished work
    with pytest.raises(FusionFlowError, match="no longer tracked"):
        next(first)
    assert len(list(second)) == 3
    assert loader.state_dict()["batches_yielded"] is None  # the newest epoch completed
    loader.close()


def test_slot_pool_hands_out_the_longest_free_slot_and_withdraws_adopted_ones():
    from fusionflow.runtime.slots import SlotPool

    pool = SlotPool(range(4))
    assert (pool.take(), pool.take()) == (0, 1) and len(pool) == 2
    pool.give(0)
    pool.withdraw([2])  # a slot the previous epoch's speculation already filled
    assert [pool.take(), pool.take()] == [3, 0] and not pool and 0 not in pool
    with pytest.raises(IndexError):
        pool.take()
