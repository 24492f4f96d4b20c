"""FusionFlowLoader: exactly-once delivery in sampler order, faults, cleanup, argument errors."""

import gc
import multiprocessing as mp
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from fusionflow import FusionFlowError
from fusionflow.errors import SampleError
from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.runtime.local_manager import SampleKilledWorkersError, WorkerStartError
from fusionflow.tools.synthetic import make_image, make_jpegs

SMALL = {
    "output": {"size": 24},
    "flip": 0.5,
    "crop": {"scale": [0.3, 1.0]},
    "augment": {
        "type": "rand",
        "num_ops": 2,
        "magnitude": 5,
        "num_bins": 11,
        "ops": {"Rotate": {"range": [0, 30], "signed": True}, "Posterize": {"range": [8, 4]}, "Equalize": {}},
    },
}
JPEGS = make_jpegs(61, 30, 90, seed=5)


class Bytes:
    """(jpeg bytes, index): the label is the index, so batches say which samples they hold."""

    def __init__(self, n=61, bad=(), killers=(), sleep=0.0):
        self.data, self.bad, self.killers, self.sleep = JPEGS[:n], set(bad), set(killers), sleep
        self.sizes = [len(d) for d in self.data]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i in self.killers:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sleep:
            time.sleep(self.sleep)
        return (b"not a jpeg at all" if i in self.bad else self.data[i]), i

    def describe(self, i):
        return f"/data/img_{i}.jpg"


def _our_tree() -> set[int]:
    """This process and its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def _held_elsewhere(names: set[str]) -> set[str]:
    """Those of `names` that a process outside this test run holds open or mapped: another test run's
    live segments on a shared machine, not a leak of ours (a leak is held by no one, or by a process
    of ours, which the process check reports)."""
    ours, held = _our_tree(), set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in ours:
            continue
        try:
            with open(f"/proc/{d}/maps") as f:
                maps = f.read()
            fds = {os.readlink(f"/proc/{d}/fd/{fd}") for fd in os.listdir(f"/proc/{d}/fd")}
        except OSError:
            continue
        held |= {n for n in names if f"/dev/shm/{n}" in maps or f"/dev/shm/{n}" in fds}
    return held


def ff_segments():
    names = {f for f in os.listdir("/dev/shm") if f.startswith(("ff_", "ffl_", "sem.ff"))}
    return sorted(names - _held_elsewhere(names)) if names else []


def collect(loader):
    images, labels = [], []
    for x, y in loader:
        images.append(x)
        labels.append(y)
    return images, labels


@pytest.fixture(autouse=True)
def no_leaks():
    before = set(ff_segments())
    yield
    # an iterator a failing sample's exception still refers to (its traceback's frames, in a cycle with the test's:
    # pytest.raises keeps the exception) lives on, as DataLoader's, until the collector frees it. Collected only
    # when something is left: a full collection here takes ~0.2 s (torch, DALI and pytest's objects), per test.
    if mp.active_children() or set(ff_segments()) - before:
        gc.collect()
    deadline = time.time() + 5
    while time.time() < deadline and (mp.active_children() or set(ff_segments()) - before):
        time.sleep(0.05)
    assert not mp.active_children(), f"worker processes left: {mp.active_children()}"
    # new ones only: a segment of an earlier test's global manager may go away meanwhile (it lingers)
    assert not set(ff_segments()) - before, "shared-memory segments left in /dev/shm"


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "shuffle,drop_last,batch_size",
    [(False, False, 8), (True, False, 8), (True, True, 8), (False, True, 7), (True, False, 61), (False, False, 1)],
)
def test_every_sample_once_in_sampler_order(num_workers, shuffle, drop_last, batch_size):
    ds = Bytes()
    gen = torch.Generator().manual_seed(3)
    loader = FusionFlowLoader(
        ds,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        policy=SMALL,
        tiny_batch_size=min(3, batch_size),
        seed=1,
        generator=gen,
    )
    # DataLoader's order with the same generator (its iterator draws a base seed from it before the sampler)
    reference = torch.utils.data.DataLoader(
        range(len(ds)), batch_size, shuffle, drop_last=drop_last, generator=torch.Generator().manual_seed(3)
    )
    expected = [b.tolist() for b in reference]
    images, labels = collect(loader)
    assert [y.tolist() for y in labels] == expected
    assert len(loader) == len(expected)
    pipe = CpuPipeline(SMALL)
    for x, idx in zip(images, expected):
        assert x.dtype == torch.uint8 and x.shape == (len(idx), 3, 24, 24)
        for k in (0, len(idx) - 1):
            assert np.array_equal(x[k].numpy(), pipe(ds.data[idx[k]], idx[k], seed=1, epoch=0))


@pytest.mark.parametrize("generator", [None, 4])
def test_shuffled_order_is_dataloaders_whatever_num_workers_and_persistence(generator):
    """Each epoch's iterator draws DataLoader's base seed (from the loader's generator, else torch's RNG) before
    the sampler draws: the same order with 0 or 2 workers, persistent or not, as DataLoader's (num_workers=0,
    whose iterator draws once an epoch; before, num_workers=0 skipped that draw and a generator was not used)."""

    def orders(make, labels):
        torch.manual_seed(5)
        loader = make(torch.Generator().manual_seed(generator) if generator is not None else None)
        return [[i for batch in loader for i in labels(batch).tolist()] for _ in range(3)]

    want = orders(lambda g: torch.utils.data.DataLoader(range(20), 4, shuffle=True, generator=g), lambda b: b)
    assert len({tuple(o) for o in want}) == 3  # three different epochs
    for workers, persistent in ((0, False), (2, False), (2, True)):
        kw = dict(batch_size=4, shuffle=True, num_workers=workers, persistent_workers=persistent, policy=SMALL)
        made = []

        def make(g, kw=kw, made=made):
            made.append(FusionFlowLoader(Bytes(20), generator=g, **kw))
            return made[-1]

        got = orders(make, lambda batch: batch[1])
        made[0].close()
        assert got == want, (workers, persistent)


@pytest.mark.parametrize("replicas", [2, 3])
def test_distributed_sampler_shards(replicas):
    ds = Bytes()
    union = []
    for rank in range(replicas):
        sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=4)
        loader = FusionFlowLoader(ds, batch_size=5, sampler=sampler, num_workers=2, policy=SMALL, tiny_batch_size=2)
        loader.set_epoch(1)
        _, labels = collect(loader)
        got = [i for y in labels for i in y.tolist()]
        ref = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=4)
        ref.set_epoch(1)
        assert got == list(ref)
        union += got
    assert set(union) == set(range(len(ds)))  # padding repeats a few, as DistributedSampler does


def test_persistent_workers_across_epochs_and_epoch_semantics():
    ds = Bytes(40)
    loader = FusionFlowLoader(
        ds, batch_size=6, shuffle=True, num_workers=2, persistent_workers=True, policy=SMALL, seed=2
    )
    pids = None
    epochs = []
    for _ in range(3):
        images, labels = collect(loader)
        assert sorted(i for y in labels for i in y.tolist()) == list(range(40))
        now = [w.process.pid for w in loader._manager.pool.workers]
        assert pids is None or now == pids  # the same worker processes every epoch
        pids = now
        epochs.append({int(i): x for xs, ys in zip(images, labels) for x, i in zip(xs, ys)})
    assert not torch.equal(epochs[0][5], epochs[1][5])  # no set_epoch: the epoch still advances
    loader.set_epoch(0)
    images, labels = collect(loader)
    again = {int(i): x for xs, ys in zip(images, labels) for x, i in zip(xs, ys)}
    assert all(torch.equal(again[i], epochs[0][i]) for i in range(40))  # set_epoch(0) reproduces epoch 0
    loader.close()


def test_killed_worker_is_replaced_and_nothing_is_lost():
    ds = Bytes(48, sleep=0.01)
    loader = FusionFlowLoader(ds, batch_size=8, num_workers=2, policy=SMALL, tiny_batch_size=2)
    labels = []
    for k, (_, y) in enumerate(loader):
        labels.append(y.tolist())
        if k == 1:
            os.kill(loader._manager.pool.workers[0].process.pid, signal.SIGKILL)
    assert labels == [list(range(s, s + 8)) for s in range(0, 48, 8)]
    assert loader.stats.worker_restarts >= 1


def test_sample_that_keeps_killing_workers_is_named():
    ds = Bytes(32, killers={13})
    loader = FusionFlowLoader(ds, batch_size=8, num_workers=2, policy=SMALL, tiny_batch_size=4, max_retries=1)
    with pytest.raises(
        SampleKilledWorkersError,
        match=r"sample 13 killed 2 CPU worker processes \(last: signal SIGKILL; its tiny-batch's deaths count too: "
        r"a tiny-batch that kills a worker is retried sample by sample to find which one does\)",
    ):
        collect(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_image_raises_with_index_and_path(num_workers):
    loader = FusionFlowLoader(Bytes(20, bad={11}), batch_size=4, num_workers=num_workers, policy=SMALL)
    with pytest.raises(
        SampleError, match=r"sample 11 \(/data/img_11\.jpg\) failed: DecodeError: .*cannot identify"
    ) as info:
        collect(loader)
    assert info.value.index == 11 and "Traceback" in info.value.worker_traceback


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_images_skipped_counted_and_warned_once(num_workers):
    loader = FusionFlowLoader(
        Bytes(20, bad={3, 11, 12}), batch_size=4, num_workers=num_workers, policy=SMALL, on_error="skip"
    )
    with pytest.warns(UserWarning, match=r"dropping sample 3 \(/data/img_3\.jpg\)") as record:
        _, labels = collect(loader)
    (skip,) = [r for r in record if "on_error='skip'" in str(r.message)]
    assert skip.filename == __file__  # the script's line that iterates (`collect`), not the loader's own
    assert [i for y in labels for i in y.tolist()] == [i for i in range(20) if i not in (3, 11, 12)]
    assert loader.stats.skipped == 3 and sorted(loader.stats.skipped_indices) == [3, 11, 12]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_never_delivers_an_empty_batch_and_a_dataset_failing_every_sample_raises(num_workers):
    kw = dict(batch_size=4, num_workers=num_workers, policy=SMALL, on_error="skip")
    with pytest.warns(UserWarning, match="on_error='skip'"):
        _, labels = collect(FusionFlowLoader(Bytes(16, bad={4, 5, 6, 7, 9}), **kw))
    assert [y.tolist() for y in labels] == [[0, 1, 2, 3], [8, 10, 11], [12, 13, 14, 15]]  # not an empty [4..7]
    loader = FusionFlowLoader(Bytes(16, bad={4, 5, 6, 7, 9}), **kw)
    it = iter(loader)
    with pytest.warns(UserWarning):
        next(it), next(it)  # [0..3], then [8, 10, 11] past the dropped batch
    resumed = FusionFlowLoader(Bytes(16, bad={4, 5, 6, 7, 9}), **kw)
    resumed.load_state_dict(loader.state_dict())  # the dropped batch counts as passed: nothing comes twice
    assert [y.tolist() for _, y in resumed] == [[12, 13, 14, 15]]
    loader.close()
    with pytest.warns(UserWarning), pytest.raises(SampleError, match=r"every sample of epoch 0 failed \(4 mini-b"):
        collect(FusionFlowLoader(Bytes(16, bad=set(range(16))), **kw))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_delivers_every_good_sample_behind_a_run_of_failures_at_the_start(num_workers):
    """A broken class folder that sorts first, read in order: on_error='skip' raised "every sample of the first 4
    mini-batches failed" after 2 empty mini-batches and 16 samples, and the good ones behind were never delivered;
    a dataset failing them all still raises, at the epoch's end, each epoch."""
    kw = dict(batch_size=4, num_workers=num_workers, policy=SMALL, on_error="skip")
    loader = FusionFlowLoader(Bytes(40, bad=set(range(24))), **kw)
    with pytest.warns(UserWarning, match="on_error='skip'"):
        for epoch in range(2):
            _, labels = collect(loader)
            assert sorted(i for y in labels for i in y.tolist()) == list(range(24, 40)), epoch
    assert loader.stats.skipped == 48
    loader.close()
    loader = FusionFlowLoader(Bytes(24, bad=set(range(24))), **kw)
    with pytest.warns(UserWarning):
        for epoch in range(2):
            with pytest.raises(SampleError, match=rf"every sample of epoch {epoch} failed \(6 mini-batch"):
                collect(loader)
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_raises_at_the_end_of_an_epoch_whose_every_sample_failed(num_workers):
    """A small dataset failing every sample, or one failing every sample after a good epoch (a mount lost):
    on_error='skip' ended such epochs as empty, silently."""
    kw = dict(batch_size=8, num_workers=num_workers, policy=SMALL, on_error="skip")
    with pytest.warns(UserWarning), pytest.raises(SampleError, match=r"every sample of epoch 0 failed \(2 mini-batch"):
        collect(FusionFlowLoader(Bytes(12, bad=set(range(12))), **kw))
    ds = Bytes(12)
    loader = FusionFlowLoader(ds, **kw)
    assert sum(len(y) for y in collect(loader)[1]) == 12
    ds.bad = set(range(12))  # the files are gone
    with (
        pytest.warns(UserWarning),
        pytest.raises(SampleError, match=r"(?s)sample \d+ .*every sample of epoch 1 failed"),
    ):
        collect(loader)
    ds.bad = {3}
    kept = sorted(i for y in collect(loader)[1] for i in y.tolist())  # (warned once)
    assert kept == [i for i in range(12) if i != 3]
    loader.close()
    ds = Bytes(12, bad={8, 9, 10, 11})  # resumed after the two good batches: the rest fails, the epoch had samples
    loader = FusionFlowLoader(ds, **{**kw, "batch_size": 4})
    it = iter(loader)
    next(it), next(it)
    resumed = FusionFlowLoader(ds, **{**kw, "batch_size": 4})
    resumed.load_state_dict(loader.state_dict())
    with pytest.warns(UserWarning, match="on_error='skip'"):
        assert collect(resumed)[1] == []
    loader.close()
    resumed.close()


def test_skip_judges_an_epoch_failing_every_sample_by_what_it_kept_not_by_the_stats_and_not_under_ddp(monkeypatch):
    from fusionflow.loader import delivery as dl
    from fusionflow.loader.stats import LoaderStats
    from fusionflow.runtime.messages import SampleFailure

    def failed(n):
        return [SampleFailure(p, p, f"sample {p}", "DecodeError", "bad", "") for p in range(n)]

    stats = LoaderStats()
    d = dl.Delivery(stats, torch.device("cpu"), False, "skip")
    start = tuple(d.tally)
    with pytest.warns(UserWarning):
        assert d.select(8, failed(3)) == [3, 4, 5, 6, 7]
    stats.reset()  # (stats.samples back to 0, as in a fresh process after load_state_dict)
    second = tuple(d.tally)
    for _ in range(4):  # empty batches are dropped, never a SampleError before the epoch's end
        with pytest.raises(dl.EmptyBatch):
            d.select(8, failed(8))
    assert d.all_failed(start, 0) is None  # the first epoch kept 5
    with pytest.raises(SampleError, match=r"every sample of epoch 1 failed \(4 mini-batch"):
        raise d.all_failed(second, 1)
    fresh = dl.Delivery(LoaderStats(), torch.device("cpu"), False, "skip")
    with pytest.warns(UserWarning):
        for _ in range(6):
            with pytest.raises(dl.EmptyBatch):
                fresh.select(8, failed(8))
    monkeypatch.setattr(dl, "NONE_KEPT_WARN", 16)  # none kept after that many: said once, and it goes on
    told = dl.Delivery(LoaderStats(), torch.device("cpu"), False, "skip")
    with pytest.warns(UserWarning) as record:
        for _ in range(5):
            with pytest.raises(dl.EmptyBatch):
                told.select(8, failed(8))
    said = [str(w.message) for w in record if "none of the first 16+ samples loaded" in str(w.message)]
    assert len(said) == 1 and "the latest: sample 7, DecodeError" in said[0] and "check the data" in said[0]
    monkeypatch.setattr(dl, "distributed", lambda: True)  # a DDP rank steps with an empty batch, as its peers step
    with pytest.warns(UserWarning, match="on_error='skip'"):
        assert dl.Delivery(LoaderStats(), torch.device("cpu"), False, "skip").select(4, failed(4)) == []


def test_a_state_taken_right_after_loading_one_is_that_state():
    """A save at start-up (a preemption handler) must not lose the position a resume is about to take."""
    kw = dict(batch_size=4, shuffle=True, num_workers=0, policy=SMALL, generator=torch.Generator().manual_seed(1))
    loader = FusionFlowLoader(Bytes(16), **kw)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [y.tolist() for _, y in it]
    resumed = FusionFlowLoader(Bytes(16), **{**kw, "generator": torch.Generator().manual_seed(1)})
    resumed.load_state_dict(state)
    again = FusionFlowLoader(Bytes(16), **{**kw, "generator": torch.Generator().manual_seed(1)})
    again.load_state_dict(resumed.state_dict())
    assert resumed.state_dict()["batches_yielded"] == 2
    assert [y.tolist() for _, y in again] == rest and len(rest) == 2


def test_a_sample_of_the_wrong_type_says_to_fix_the_dataset_not_to_skip():
    with pytest.raises(SampleError, match=r"got NoneType\n\(fix the dataset's __getitem__"):
        collect(FusionFlowLoader([(None, 0)] * 4, batch_size=2, policy=SMALL))
    with pytest.raises(SampleError, match=r"must return \(sample, target\), .* or a bare image, got a tuple of 1"):
        collect(FusionFlowLoader([(JPEGS[0],)] * 4, batch_size=2, policy=SMALL))  # (3-tuples: test_dropin.py)


def test_exception_and_keyboard_interrupt_in_training_loop_clean_up():
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers=2, policy=SMALL)
        with pytest.raises(type(exc)):
            for _ in loader:
                raise exc
        # the fixture checks that no worker and no segment is left


def test_a_ctrl_c_while_the_manager_starts_leaves_no_worker_or_thread(monkeypatch):
    """An interrupt landing in the manager thread's start (found by raising KeyboardInterrupt a few ms into the
    first iteration): the started workers and the thread go with the failed start; the next epoch is whole."""
    start = threading.Thread.start

    def interrupted_start(thread):
        start(thread)
        if thread.name == "fusionflow-manager" and not fired:
            fired.append(thread)
            raise KeyboardInterrupt

    fired: list = []
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    loader = FusionFlowLoader(Bytes(24), batch_size=4, num_workers=2, policy=SMALL, persistent_workers=True)
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    fired[0].join(timeout=30)
    assert not fired[0].is_alive() and not mp.active_children()
    _, labels = collect(loader)
    assert [i for y in labels for i in y.tolist()] == list(range(24))
    loader.close()


def test_break_then_iterate_again_with_persistent_workers():
    loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers=2, policy=SMALL, persistent_workers=True)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    _, labels = collect(loader)
    assert [i for y in labels for i in y.tolist()] == list(range(40))
    with loader:
        pass  # __exit__ closes


def test_shm_name_is_private_and_unguessable():
    loader = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, persistent_workers=True)
    next(iter(loader))
    name = loader._manager.board.ring.name
    assert re.fullmatch(r"/ff_[0-9a-f]{24}", name)
    assert os.fstat(loader._manager.board.ring.fd).st_mode & 0o777 == 0o600
    assert not os.path.exists("/dev/shm" + name)  # unlinked at creation: workers map its descriptor
    loader.close()
    assert not os.path.exists("/dev/shm" + name)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_job_killed_as_a_whole_leaves_no_segment(num_workers):
    """The OOM killer, scancel or a scheduler SIGKILLs the training process and its workers together:
    no process is left to unlink anything, so no name may exist by then."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_loader import Bytes, SMALL
        from fusionflow.loader import FusionFlowLoader
        loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers={num_workers}, policy=SMALL,
                                  persistent_workers=True)
        it = iter(loader); next(it)
        print(loader._manager.board.ring.name, flush=True)
        sys.stdin.read()  # until the test has killed the whole group
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("/ff_")
        assert not os.path.exists("/dev/shm" + name)  # nothing named while it runs
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not os.path.exists("/dev/shm" + name)


def test_training_process_killed_leaves_nothing():
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_loader import Bytes, SMALL
        from fusionflow.loader import FusionFlowLoader
        loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers=2, policy=SMALL, persistent_workers=True)
        it = iter(loader); next(it)
        print(loader._manager.board.ring.name, *[w.process.pid for w in loader._manager.pool.workers], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    name, *pids = out.stdout.split()
    deadline = time.time() + 10
    while time.time() < deadline and (os.path.exists("/dev/shm" + name) or any(_alive(int(p)) for p in pids)):
        time.sleep(0.1)
    assert not os.path.exists("/dev/shm" + name), "segment outlived the killed training process"
    assert not any(_alive(int(p)) for p in pids), "workers outlived the killed training process"


class SlowAfterFirst(Bytes):
    """Each sample past the first mini-batch takes 60 s: a worker is inside one read for a minute."""

    def __getitem__(self, i):
        if i >= 8:
            time.sleep(60)
        return super().__getitem__(i)


def test_busy_workers_of_a_killed_training_process_stop_within_seconds():
    """Work queued before the training process was SIGKILLed is not run for nobody: a busy worker's watchdog
    thread ends it within a second or so, even inside one sample's read of a minute (it looked only when idle,
    then between samples: here the read in hand ran on for 60 s)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_loader import SMALL, SlowAfterFirst
        from fusionflow.loader import FusionFlowLoader
        loader = FusionFlowLoader(SlowAfterFirst(64), batch_size=8, num_workers=2, policy=SMALL, tiny_batch_size=8)
        it = iter(loader); next(it)
        print(*[w.process.pid for w in loader._manager.pool.workers], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]  # (the workers hold the pipe too: no read to its end)
    proc.wait(timeout=120)
    gone = time.monotonic()
    proc.stdout.close()
    try:
        while any(_alive(p) for p in pids) and time.monotonic() - gone < 15:  # the read in hand: 60 s
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "busy workers ran on after their training process was killed"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


class WritesAsItReads(Bytes):
    """Sample 9's read writes a file over 1 s (a dataset filling its own cache as it reads); `begun/` and `done/`
    say which reads started and which returned."""

    def __init__(self, folder):
        super().__init__(24)
        self.folder = folder

    def __getitem__(self, i):
        open(os.path.join(self.folder, f"begun-{i}"), "w").close()
        if i == 9:
            with open(os.path.join(self.folder, "cache-9"), "w") as f:
                for _ in range(10):
                    f.write("x" * 100)
                    f.flush()
                    time.sleep(0.1)
        open(os.path.join(self.folder, f"done-{i}"), "w").close()
        return super().__getitem__(i)


def test_an_iteration_ended_early_lets_the_read_in_hand_finish(tmp_path, no_leaks):
    """A `break` SIGTERMed busy workers at once, in the middle of dataset[i]: a file the read was writing was left
    cut (then read back as a corrupt image). As DataLoader lets a fetch finish, the read in hand now returns first."""
    ds = WritesAsItReads(str(tmp_path))
    loader = FusionFlowLoader(ds, batch_size=8, num_workers=1, policy=SMALL, tiny_batch_size=4, shuffle=False)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 60
    while not os.path.exists(tmp_path / "begun-9") and time.monotonic() < deadline:  # the read of 1 s in hand
        time.sleep(0.01)
    del it
    loader.close()
    assert os.path.getsize(tmp_path / "cache-9") == 1000
    begun = {n.split("-")[1] for n in os.listdir(tmp_path) if n.startswith("begun-")}
    assert begun == {n.split("-")[1] for n in os.listdir(tmp_path) if n.startswith("done-")}


class Grows(Bytes):
    """Its length grows between epochs past the `sizes` it had when the workers started (persistent workers)."""

    def __init__(self):
        super().__init__(24)
        self.sizes, self.n = self.sizes[:8], 8

    def __len__(self):
        return self.n


def test_a_dataset_grown_past_its_sizes_runs_its_epochs_traced(tmp_path, no_leaks):
    """The tiny-batches' sort and the trace's byte counts read `sizes` at indices it did not have: a bare
    IndexError at the grown epoch."""
    ds = Grows()
    with FusionFlowLoader(ds, batch_size=4, num_workers=1, policy=SMALL, persistent_workers=True, shuffle=False,
                          trace=str(tmp_path / "t.json")) as loader:  # fmt: skip
        for epoch, n in ((0, 8), (1, 16)):
            ds.n = n
            loader.set_epoch(epoch)
            assert [i for _, y in loader for i in y.tolist()] == list(range(n))


class HangsInRead(Bytes):
    """Sample 9's first read hangs for a minute (a stalled network read)."""

    def __init__(self, folder):
        super().__init__(24)
        self.folder = folder

    def __getitem__(self, i):
        mark = os.path.join(self.folder, f"begun-{i}")
        if i == 9 and not os.path.exists(mark):
            open(mark, "w").close()
            time.sleep(60)
        return super().__getitem__(i)


def test_a_sigterm_ends_a_worker_at_once_even_inside_a_read(tmp_path, no_leaks):
    """Only the pool's own stop waits for the read in hand: a SIGTERM (multiprocessing's exit handling, which then
    waits without a bound; a scheduler) ended a worker at once before, and must still."""
    loader = FusionFlowLoader(HangsInRead(str(tmp_path)), batch_size=8, num_workers=1, policy=SMALL, tiny_batch_size=4)
    with loader:
        it = iter(loader)
        next(it)
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "begun-9") and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = loader._manager.pool.workers[0].process.pid
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20  # (the manager thread reaps it: its exit code is not ours to read)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)  # not after the read's minute
        assert sorted(i for _, y in it for i in y.tolist()) == list(range(8, 24))  # run again on its replacement


def test_a_child_the_script_forks_leaves_the_parents_workers_alone_when_it_exits():
    """A process the script forks (a helper of its own) that exits normally: multiprocessing's exit hook in it
    SIGTERMed every daemon process it had inherited a record of -- the parent's workers, which the parent then
    restarted -- and printed a traceback joining them (a helper's sweep: 2 restarts). They are not the child's."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_loader import SMALL, Bytes
        from fusionflow.loader import FusionFlowLoader
        loader = FusionFlowLoader(Bytes(48), batch_size=4, num_workers=2, policy=SMALL, persistent_workers=True)
        it = iter(loader)
        labels = next(it)[1].tolist()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        labels += [v for _, y in it for v in y.tolist()]
        labels += [v for _, y in loader for v in y.tolist()]  # a second epoch: a worker lost would be restarted by now
        exact = sorted(labels) == sorted(list(range(48)) * 2)
        print(os.waitstatus_to_exitcode(status), exact, loader.stats.worker_restarts)
        loader.close()
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "True", "0"], (run.stdout, run.stderr)
    assert "can only join a child process" not in run.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


class Arrays:
    def __init__(self):
        self.items = [make_image(50, 70, 1), Image.fromarray(make_image(64, 48, 2)), make_image(40, 40, 3)[:, :, 0]]

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return self.items[i], i


def test_pil_and_array_samples():
    images, labels = collect(FusionFlowLoader(Arrays(), batch_size=3, num_workers=1, policy=SMALL))
    assert images[0].shape == (3, 3, 24, 24) and labels[0].tolist() == [0, 1, 2]


def _touch(worker_id):
    open(os.path.join(os.environ["FF_TEST_DIR"], f"w{worker_id}"), "w").close()


def _fail(worker_id):
    raise RuntimeError(f"init failed in {worker_id}")


def _fail_value(worker_id):
    int("x")


def test_worker_init_fn(tmp_path, monkeypatch):
    monkeypatch.setenv("FF_TEST_DIR", str(tmp_path))
    collect(FusionFlowLoader(Bytes(8), batch_size=4, num_workers=2, policy=SMALL, worker_init_fn=_touch))
    assert sorted(os.listdir(tmp_path)) == ["w0", "w1"]
    with pytest.raises(WorkerStartError, match="init failed in"):
        collect(FusionFlowLoader(Bytes(8), batch_size=4, num_workers=2, policy=SMALL, worker_init_fn=_fail))
    # as DataLoader re-raises it: the worker_init_fn's own type too (`except ValueError` catches it)
    with pytest.raises(ValueError, match="invalid literal") as info:
        collect(FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, worker_init_fn=_fail_value))
    assert isinstance(info.value, WorkerStartError) and "failed to start" in str(info.value)


def test_timeout():
    loader = FusionFlowLoader(Bytes(8, sleep=3.0), batch_size=4, num_workers=1, policy=SMALL, timeout=0.5)
    # the error names the samples the worker is stuck on (a sweep found only the worker and its seconds there)
    with pytest.raises(
        FusionFlowError, match=r"not ready within timeout=0.5 s .*CPU worker 0 \(samples \[[0-3](, [0-3]){3}\]\)"
    ):
        collect(loader)


def test_an_iteration_ended_by_an_exception_says_so_at_the_next_call_once():
    """A timeout (any exception but a failing sample's) ends the iteration; a caller that catches it and calls
    next() again is told the rest of the epoch was not delivered -- once, then StopIteration -- where it used to
    get StopIteration at once, as if the epoch had ended."""
    loader = FusionFlowLoader(Bytes(8, sleep=3.0), batch_size=4, num_workers=1, policy=SMALL, timeout=0.5)
    try:
        it = iter(loader)
        with pytest.raises(FusionFlowError, match=r"not ready within timeout"):
            next(it)
        with pytest.raises(FusionFlowError, match=r"ended at the FusionFlowError an earlier next\(\) raised"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_after_a_failing_sample_the_iteration_goes_on_with_the_next_mini_batch(num_workers):
    """As DataLoader: a sample that raises (on_error='raise') costs the caller who catches the error and calls
    next() again the one mini-batch holding it; every other sample of the epoch still arrives once, and the
    next epoch runs as well. The iteration used to end there silently (StopIteration: 16 of 24 samples lost)."""
    loader = FusionFlowLoader(Bytes(24, bad=(9,)), batch_size=4, num_workers=num_workers, policy=SMALL)
    try:
        for _ in range(2):  # the next epoch runs on the same runtime, as whole
            got, errors, it = [], [], iter(loader)
            while True:
                try:
                    got += next(it)[1].tolist()
                except StopIteration:
                    break
                except SampleError as exc:
                    errors.append(exc.index)
            assert errors == [9] and sorted(got) == [i for i in range(24) if i // 4 != 2]
    finally:
        loader.close()


def test_float_output_when_policy_normalizes():
    cfg = dict(SMALL, output={"size": 24, "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3}})
    x, _ = next(iter(FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=cfg)))
    assert x.dtype == torch.float32 and x.shape == (4, 3, 24, 24)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, r"batch_size=0 must be an integer >= 1"),
        ({"batch_size": 4, "tiny_batch_size": 8}, r"tiny_batch_size=8 is larger than batch_size=4"),
        ({"policy": "/nope/policy.yaml"}, r"policy file '/nope/policy.yaml' does not exist"),
        ({"sampler": SequentialSampler(range(8)), "shuffle": True}, r"sampler is mutually exclusive with shuffle"),
        (
            {"batch_sampler": BatchSampler(SequentialSampler(range(8)), 4, False), "batch_size": 4},
            r"batch_sampler is mutually exclusive",
        ),
        ({"persistent_workers": True}, r"persistent_workers=True needs num_workers > 0"),
        ({"on_error": "ignore"}, r"on_error='ignore' must be one of"),
        ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "tpu"}, r"device="),
        ({"num_workers": 1, "prefetch_factor": 0}, r"prefetch_factor=0 must be an integer >= 1"),
        ({"timeout": -1}, r"timeout=-1 must be a number of seconds >= 0"),
        ({"seed": -1}, r"seed=-1 must be a non-negative integer"),
    ],
)
def test_invalid_arguments_say_how_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusionFlowLoader(Bytes(8), **{"policy": SMALL, **kwargs})


def test_batch_sampler_and_set_epoch_forwarding():
    sampler = DistributedSampler(Bytes(8), num_replicas=2, rank=0)
    loader = FusionFlowLoader(Bytes(8), batch_sampler=BatchSampler(sampler, 2, False), num_workers=1, policy=SMALL)
    loader.set_epoch(5)
    assert sampler.epoch == 5
    _, labels = collect(loader)
    ref = DistributedSampler(Bytes(8), num_replicas=2, rank=0)
    ref.set_epoch(5)
    assert [i for y in labels for i in y.tolist()] == list(ref)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_raising_mid_epoch_delivers_the_batches_drawn_before_then_raises(num_workers):
    """With workers, the batches drawn (and submitted) before the sampler raised were thrown away: [4, 5] and [6, 7]
    never came. Every batch drawn is delivered first now, as without workers, then the sampler's error."""

    class Failing:
        def __iter__(self):
            for i in range(12):
                if i == 9:
                    raise RuntimeError("the sampler failed at 9")
                yield i

        def __len__(self):
            return 12

    it = iter(FusionFlowLoader(Bytes(12), sampler=Failing(), batch_size=2, num_workers=num_workers, policy=SMALL))
    assert [next(it)[1].tolist() for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(RuntimeError, match="the sampler failed at 9"):
        next(it)
    with pytest.raises(FusionFlowError, match="this iteration ended at the RuntimeError"):
        next(it)


def test_set_epoch_reaches_a_batch_samplers_own_set_epoch():
    """A distributed or bucketing batch sampler orders its epoch by a set_epoch of its own: loader.set_epoch only
    reached the sampler it wraps, so such a batch sampler repeated epoch 0's order every epoch."""

    class Buckets:  # a batch sampler of one's own that orders each epoch by its number
        batch_size = 4

        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            order = torch.randperm(8, generator=torch.Generator().manual_seed(self.epoch)).tolist()
            return iter([order[:4], order[4:]])

        def __len__(self):
            return 2

    buckets = Buckets()
    loader = FusionFlowLoader(Bytes(8), batch_sampler=buckets, num_workers=0, policy=SMALL)
    for epoch in (3, 4):
        loader.set_epoch(epoch)
        assert buckets.epoch == epoch
        want = torch.randperm(8, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert [i for _, y in loader for i in y.tolist()] == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_indices_of_any_integer_type_are_the_same_samples_and_others_are_refused_by_name(num_workers):
    """A sampler over torch.arange yields 0-d tensors, numpy's yields np.int64: the same batches and pixels as
    Python ints (the inline path refused tensors); a float or a negative index is refused, saying which."""
    kw = dict(batch_size=4, num_workers=num_workers, policy=SMALL, seed=2)
    want = [(x, y.tolist()) for x, y in FusionFlowLoader(Bytes(8), sampler=[5, 0, 3, 1, 2, 7], **kw)]
    for sampler in (list(torch.tensor([5, 0, 3, 1, 2, 7])), list(np.array([5, 0, 3, 1, 2, 7]))):
        got = [(x, y.tolist()) for x, y in FusionFlowLoader(Bytes(8), sampler=sampler, **kw)]
        assert [y for _, y in got] == [y for _, y in want] == [[5, 0, 3, 1], [2, 7]]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want))
    with pytest.raises(TypeError, match=r"index 1.0 \(float\): indices must be integers"):
        list(FusionFlowLoader(Bytes(8), sampler=[0, 1.0], **kw))
    with pytest.raises(ValueError, match=r"index -1: FusionFlow takes indices 0..len\(dataset\)-1"):
        list(FusionFlowLoader(Bytes(8), sampler=[0, -1], **kw))


def test_any_batch_sampler_dataloader_accepts():
    """A list of index lists and a batch sampler without `batch_size` (DataLoader needs neither): the
    batches as DataLoader yields them, uneven sizes included; shared memory sized for the longest."""

    class Pairs:  # a batch sampler of one's own: re-iterable, no batch_size attribute
        def __iter__(self):
            return iter([[7, 1], [2, 3, 4], [0]])

        def __len__(self):
            return 3

    for batches in ([[5, 0, 3], [1], [2, 4, 6, 7]], Pairs()):
        want = [list(b) for b in batches]
        loader = FusionFlowLoader(Bytes(8), batch_sampler=batches, num_workers=1, policy=SMALL)
        with loader:
            for _ in range(2):
                assert [y.tolist() for _, y in loader] == want
        assert loader.capacity == max(len(b) for b in want) and len(loader) == len(want)


@pytest.mark.gpu
def test_cuda_delivery_matches_cpu():
    ds = Bytes(16)
    cpu_images, _ = collect(FusionFlowLoader(ds, batch_size=8, num_workers=2, policy=SMALL, seed=3))
    gpu_images, gpu_labels = collect(
        FusionFlowLoader(ds, batch_size=8, num_workers=2, policy=SMALL, seed=3, device="cuda:0")
    )
    assert gpu_images[0].device.type == "cuda" and gpu_labels[0].device.type == "cuda"
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu_images, gpu_images))


def _exit_early(worker_id):
    os._exit(3)


def test_worker_dying_before_ready_is_a_start_error_not_a_restart_loop():
    loader = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=2, policy=SMALL, worker_init_fn=_exit_early)
    with pytest.raises(WorkerStartError, match=r"exited \(exit code 3\) before it was ready"):
        collect(loader)


def _killed_at_first_start(marker_dir, worker_id):
    """As the OOM killer or a kill from outside would: each worker's first start-up is SIGKILLed."""
    marker = os.path.join(marker_dir, f"started-{worker_id}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_at_every_start(worker_id):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_while_it_starts_is_replaced_and_nothing_is_lost(tmp_path):
    import functools

    init = functools.partial(_killed_at_first_start, str(tmp_path))
    loader = FusionFlowLoader(
        Bytes(24), batch_size=4, num_workers=2, policy=SMALL, worker_init_fn=init, timeout=120, persistent_workers=True
    )
    # each worker's first start was killed and the second came up -- one may die only after the other made the whole
    # epoch (a busy machine): dead workers are replaced where the training process waits for a batch, so then in a
    # later epoch (the test waited 60 s after the first for a restart nothing would make; CI on a busy machine saw the
    # live worker keep ahead of training for 5 epochs)
    try:
        for epoch in range(40):
            loader.set_epoch(epoch)
            _, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(24))  # every sample once
            if loader.stats.worker_restarts == 2:
                break
        assert loader.stats.worker_restarts == 2
        assert sorted(os.listdir(tmp_path)) == ["started-0", "started-1"]
    finally:
        loader.close()


def _stopped_at_first_start(marker_dir, worker_id):
    """A worker that stops during its start-up (a paused container, SIGSTOP), the first time only."""
    marker = os.path.join(marker_dir, f"stopped-{worker_id}")
    if worker_id == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)


def _hangs_at_every_start(worker_id):
    time.sleep(3600)


def test_a_worker_stopped_while_it_starts_is_killed_past_the_start_bound_and_replaced(tmp_path, monkeypatch):
    import functools

    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "START_S", 1.0)
    init = functools.partial(_stopped_at_first_start, str(tmp_path))
    loader = FusionFlowLoader(
        Bytes(24), batch_size=4, num_workers=2, policy=SMALL, worker_init_fn=init, persistent_workers=True
    )
    deadline = time.monotonic() + 120
    with loader:  # worker 0 carries the epochs meanwhile; worker 1 is replaced once past the bound
        while time.monotonic() < deadline:
            _, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(24))
            per_worker = loader.stats.tiny_batches_per_worker
            if loader.stats.worker_restarts and len(per_worker) > 1 and per_worker[1]:
                break
        assert loader.stats.worker_restarts == 1 and per_worker[1] > 0  # the replacement works
    assert os.listdir(tmp_path) == ["stopped-1"]


def test_a_worker_that_never_becomes_ready_fails_with_the_reason_after_max_retries(monkeypatch):
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "START_S", 0.5)
    loader = FusionFlowLoader(
        Bytes(8), batch_size=4, num_workers=1, policy=SMALL, worker_init_fn=_hangs_at_every_start, max_retries=1
    )
    with pytest.raises(WorkerStartError, match=r"killed: not ready \d+ s after its start\) before it was ready"):
        collect(loader)
    assert loader.stats.worker_restarts == 1


def test_a_worker_killed_at_every_start_fails_after_max_retries():
    loader = FusionFlowLoader(
        Bytes(8), batch_size=4, num_workers=1, policy=SMALL, worker_init_fn=_killed_at_every_start, max_retries=1
    )
    with pytest.raises(WorkerStartError, match=r"exited \(signal SIGKILL\) before it was ready \(2 start-ups in a row"):
        collect(loader)
    assert loader.stats.worker_restarts == 1


class StopsItselfAt(Bytes):
    """Sample 13's worker stops itself (SIGSTOP) the first time, as a paused container or a read that
    never returns would leave it: alive, silent, no progress."""

    def __init__(self, n, marker_dir):
        super().__init__(n)
        self.marker = os.path.join(marker_dir, "stopped")

    def __getitem__(self, i):
        if i == 13 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().__getitem__(i)


def test_a_stopped_worker_is_killed_and_replaced_and_the_epoch_completes_without_a_timeout(
    tmp_path, monkeypatch, caplog
):
    """timeout=0 (wait forever, DataLoader's default): the stuck worker is killed past the stuck bound
    (lowered here from 25 s), its tiny-batches run again, every sample arrives exactly once; meanwhile
    the training loop is told what it waits for (after WAIT_SAY_S, lowered from 60 s)."""
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "STUCK_FLOOR_S", 2.0)
    monkeypatch.setattr(liveness, "WAIT_SAY_S", 0.3)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1e9)  # no second copy (tests/test_reruns.py): the kill itself
    loader = FusionFlowLoader(StopsItselfAt(32, str(tmp_path)), batch_size=4, num_workers=2, policy=SMALL, timeout=0)
    _, labels = collect(loader)
    assert sorted(torch.cat(labels).tolist()) == list(range(32))
    assert os.path.exists(os.path.join(tmp_path, "stopped"))
    assert loader.stats.workers_stuck >= 1 and loader.stats.worker_restarts >= 1
    assert loader.stats.summary()["workers_stuck"] == loader.stats.workers_stuck
    said = [r.getMessage() for r in caplog.records if "the training loop has waited" in r.getMessage()]
    assert said and "samples outstanding" in said[0] and "CPU worker" in said[0], said
    assert len(said) <= 6  # doubling intervals, not one line per second


class SlowAt(Bytes):
    """Sample 13 takes `seconds` every time it is read (a network read that stalls, a lazy download)."""

    def __init__(self, n, seconds):
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i):
        if i == 13:
            time.sleep(self.seconds)
        return super().__getitem__(i)


def test_a_sample_slower_than_the_stuck_bound_finishes_on_a_later_try(monkeypatch):
    """A sample that takes 6 s every time, against a stuck bound lowered to 4 s: its first try's worker is killed
    as stuck, its retry's bound doubles (8 s) and it finishes there -- the epoch completes, each sample once. It
    used to be killed at the same bound every try and fail its mini-batch as a sample that kills workers."""
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "STUCK_FLOOR_S", 4.0)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1e9)  # no second copy (tests/test_reruns.py): the bound itself
    loader = FusionFlowLoader(SlowAt(24, 6.0), batch_size=4, num_workers=2, policy=SMALL, timeout=0)
    _, labels = collect(loader)
    assert sorted(torch.cat(labels).tolist()) == list(range(24))
    assert loader.stats.workers_stuck == 1


def test_a_sample_that_never_returns_is_reported_as_slow_by_name(monkeypatch):
    """A read that never returns still fails its mini-batch after max_retries tries (bounds 1 s, then 2 s), with an
    error naming the sample and saying it was slow -- not that it crashed the decoder."""
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "STUCK_FLOOR_S", 1.0)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1e9)
    loader = FusionFlowLoader(SlowAt(24, 3600.0), batch_size=4, num_workers=2, policy=SMALL, max_retries=1)
    with pytest.raises(SampleKilledWorkersError, match=r"sample 13 killed 2 CPU worker processes") as info:
        collect(loader)
    assert "stuck bound" in str(info.value) and "crashes the decoder" not in str(info.value)
    loader.close()


class StopsMidMessageAt(StopsItselfAt):
    """Sample 13's worker, the first time, writes the start of a message to its loader (the head of a
    frame announcing 100 kB, and 10 bytes of it) and stops itself (SIGSTOP): a worker paused while it
    wrote a DONE larger than the pipe takes at once (a failure's traceback, non-int targets)."""

    def __getitem__(self, i):
        if i == 13 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            frame = sys._getframe()
            while frame.f_code.co_name != "run_task":  # the worker's connection to its loader: run_task's `out`
                frame = frame.f_back
            os.write(frame.f_locals["out"].fileno(), struct.pack("!i", 100_000) + b"0123456789")
            os.kill(os.getpid(), signal.SIGSTOP)
        return Bytes.__getitem__(self, i)


def test_a_worker_stopped_in_the_middle_of_a_message_is_killed_and_the_epoch_completes(tmp_path, monkeypatch, caplog):
    """The manager thread reads each worker's messages: one stopped mid-message used to hold that thread,
    and so every worker and the training loop, forever. Now the rest of a begun message must come within
    authsock.REST_S (lowered here from 5 s): past it the worker is killed, its tiny-batches run again,
    every sample arrives exactly once, with timeout=0."""
    from fusionflow.runtime import authsock, liveness

    monkeypatch.setattr(authsock, "REST_S", 1.0)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1e9)  # no second copy: the message's bound itself
    loader = FusionFlowLoader(StopsMidMessageAt(32, str(tmp_path)), batch_size=4, num_workers=2, policy=SMALL)
    _, labels = collect(loader)
    assert sorted(torch.cat(labels).tolist()) == list(range(32))
    assert os.path.exists(os.path.join(tmp_path, "stopped"))
    assert loader.stats.workers_stuck == 1 and loader.stats.worker_restarts >= 1
    assert "stopped in the middle of a message (nothing more within 1 s; 10 of 100000 bytes read)" in caplog.text


def test_the_stuck_bound_follows_the_tiny_batch_time_above_a_floor():
    from fusionflow.runtime import liveness

    assert liveness.stuck_bound(0.0) == liveness.FIRST_TASK_S  # nothing finished yet: kernels may be building
    assert liveness.stuck_bound(0.01) == liveness.STUCK_FLOOR_S
    assert liveness.stuck_bound(10.0) == 10.0 * liveness.STUCK_FACTOR
    floor = liveness.STUCK_FLOOR_S
    assert liveness.is_stuck(floor + 1.0, 0.01) and not liveness.is_stuck(floor - 1.0, 0.01)


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("old_ends_by", ["next", "del"])
def test_superseded_iterator_says_so_and_the_newer_one_goes_on(persistent, old_ends_by):
    """An older iterator, superseded by a newer iter(loader), says so when asked for more; its end -- that error,
    or being dropped -- leaves the newer one running, which yields its whole epoch. Without persistent workers the
    older one's end used to stop the workers the newer one ran on (session 33): it failed at its next batch."""
    loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers=2, policy=SMALL, persistent_workers=persistent)
    first = iter(loader)
    next(first)
    second = iter(loader)
    labels = next(second)[1].tolist()
    if old_ends_by == "next":
        with pytest.raises(FusionFlowError, match="a newer iter\\(loader\\) abandoned it"):
            next(first)
    else:
        del first
        gc.collect()
    labels += [i for _, y in second for i in y.tolist()]
    assert labels == list(range(40))
    assert labels == [i for _, y in loader for i in y.tolist()]  # and the loader goes on
    loader.close()


def _in_forked_child(loader, queue, live_iterator=None):
    """A forked process's use of its parent's loader: the parent's live iterator (if given), then a new epoch."""
    try:
        if live_iterator is not None:
            try:
                next(live_iterator)
                queue.put("the parent's iterator went on")
            except FusionFlowError as exc:
                queue.put(str(exc))
        queue.put(sorted(i for _, y in loader for i in y.tolist()))
        loader.close()
    except BaseException as exc:  # the parent's assertion says what
        queue.put(repr(exc))


@pytest.mark.parametrize("persistent", [True, False])
def test_a_forked_process_iterates_with_workers_of_its_own_and_leaves_the_parents_running(persistent):
    """A process forked from the training process (a fork-context Process, os.fork) that iterates the inherited
    loader starts workers of its own, as DataLoader does: it used to reuse the parent's manager -- no manager
    thread there, the workers the parent's -- and wait for good (session 33's sweep). The parent's iterator
    alive at the fork says it cannot go on there, before it touches a lock the fork may have copied held; the
    parent's workers and epochs go on untouched, and nothing is left behind."""
    loader = FusionFlowLoader(Bytes(40), batch_size=4, num_workers=1, policy=SMALL, persistent_workers=persistent)
    assert sorted(i for _, y in loader for i in y.tolist()) == list(range(40))  # the parent's workers started
    live = iter(loader)
    first = next(live)[1].tolist()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(loader, queue, live))
    child.start()
    said, labels = queue.get(timeout=120), queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert "cannot arrive in this process" in said and f"process {os.getpid()}" in said, said
    assert labels == list(range(40)), labels
    rest = [i for _, y in live for i in y.tolist()]  # the parent's own iteration is untouched
    assert first + rest == list(range(40))
    assert sorted(i for _, y in loader for i in y.tolist()) == list(range(40))
    loader.close()


class BusErrorAt(Bytes):
    """Sample 13's worker dies of SIGBUS, as one does touching shared memory tmpfs cannot back."""

    def __getitem__(self, i):
        if i == 13:
            import faulthandler

            faulthandler.disable()  # pytest's handler would print a stack dump; the death is the point
            os.kill(os.getpid(), signal.SIGBUS)
        return super().__getitem__(i)


def test_small_dev_shm_fails_at_start_naming_bytes_and_fixes(monkeypatch):
    from fusionflow import SharedMemoryError
    from fusionflow.runtime import shm

    monkeypatch.setattr(shm, "free_bytes", lambda path=shm.SHM_DIR: 1000)
    loader = FusionFlowLoader(Bytes(16), batch_size=8, num_workers=2, policy=SMALL)
    with pytest.raises(SharedMemoryError, match=r"needs .* but /dev/shm has 0\.0 MiB \(1000 bytes\) free.*--shm-size"):
        iter(loader).__next__()
    assert loader._manager is None  # no worker was started


def test_worker_sigbus_is_a_shared_memory_error_not_blamed_on_a_sample():
    from fusionflow import SharedMemoryError

    loader = FusionFlowLoader(
        BusErrorAt(32), batch_size=8, num_workers=2, policy=SMALL, tiny_batch_size=4, max_retries=0
    )
    with pytest.raises(SharedMemoryError, match=r"CPU worker \d died of SIGBUS.*not the fault of a sample") as info:
        collect(loader)
    assert not isinstance(info.value, SampleKilledWorkersError)


class WithBomb(Bytes):
    """Bytes whose sample 7 is a 900-megapixel PNG of a few hundred bytes."""

    def __getitem__(self, i):
        from fusionflow.tools.synthetic import png_bomb

        return (png_bomb(30000, 30000), i) if i == 7 else super().__getitem__(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_decompression_bomb_is_a_sample_error_naming_index_path_and_size(num_workers):
    loader = FusionFlowLoader(WithBomb(16), batch_size=4, num_workers=num_workers, policy=SMALL)
    with pytest.raises(
        SampleError,
        match=r"sample 7 \(/data/img_7\.jpg\) failed: ImageTooLargeError: .*"
        r"image of 900000000 pixels exceeds the policy's decode\.max_pixels=178956970",
    ):
        collect(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skipped_samples_are_counted_by_cause(num_workers):
    loader = FusionFlowLoader(
        WithBomb(16, bad={3, 11}), batch_size=4, num_workers=num_workers, policy=SMALL, on_error="skip"
    )
    with pytest.warns(UserWarning, match="on_error='skip'"):
        _, labels = collect(loader)
    assert [i for y in labels for i in y.tolist()] == [i for i in range(16) if i not in (3, 7, 11)]
    assert loader.stats.skipped == 3 and loader.stats.skipped_by_cause == {"corrupt": 2, "pixel_limit": 1}
    assert loader.stats.summary()["skipped_by_cause"] == {"corrupt": 2, "pixel_limit": 1}


class Tensors(Arrays):
    """Arrays' samples as torchvision.io would give them: uint8 CHW tensors (and one HW)."""

    def __getitem__(self, i):
        arr = np.asarray(self.items[i])
        t = torch.from_numpy(arr.copy())
        return (t.permute(2, 0, 1) if t.ndim == 3 else t), i


def test_tensor_samples_are_accepted_with_the_arrays_pixels():
    want, _ = collect(FusionFlowLoader(Arrays(), batch_size=3, num_workers=0, policy=SMALL, seed=3))
    got, labels = collect(FusionFlowLoader(Tensors(), batch_size=3, num_workers=1, policy=SMALL, seed=3))
    assert labels[0].tolist() == [0, 1, 2] and torch.equal(got[0], want[0])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_without_fork_map_the_unnamed_ring(method):
    ds = Bytes(12)
    loader = FusionFlowLoader(ds, batch_size=4, num_workers=1, policy=SMALL, multiprocessing_context=method, seed=2)
    images, labels = collect(loader)
    assert [y.tolist() for y in labels] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert np.array_equal(images[2][3].numpy(), CpuPipeline(SMALL)(ds.data[11], 11, seed=2, epoch=0))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_without_fork_stay_while_training_is_slow(method):
    """A worker idle past its watchdog checks that the training process still runs; under forkserver its parent is
    the fork server, and every idle worker took itself for an orphan, exited and was restarted (a helper's sweep)."""
    loader = FusionFlowLoader(
        Bytes(8), batch_size=4, num_workers=1, policy=SMALL, multiprocessing_context=method, persistent_workers=True
    )
    with loader:
        for _ in loader:
            time.sleep(1.5)  # a slow training step: the ring is full and the worker idles past WATCHDOG_S
        assert loader.stats.worker_restarts == 0


def test_pin_workers_is_checked():
    with pytest.raises(ValueError, match=r"pin_workers='yes' must be 'auto', True or False"):
        FusionFlowLoader(Bytes(8), batch_size=4, pin_workers="yes")


def test_counters_go_on_across_managers_and_tiny_batches_are_counted_per_worker():
    """The manager counts straight into loader.stats: restarts add up over epochs that each start a
    manager of their own, and so do tiny_batches_per_worker, by worker id (they started again with each manager:
    the last epoch's beside the whole run's batches and samples)."""
    loader = FusionFlowLoader(
        Bytes(16, sleep=0.02), batch_size=4, num_workers=2, policy=SMALL, tiny_batch_size=2, pin_workers=False
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        _, labels = collect(loader)
        assert sorted(i for y in labels for i in y.tolist()) == list(range(16))
        assert len(loader.stats.tiny_batches_per_worker) == 2
        assert sum(loader.stats.tiny_batches_per_worker) == 8 * (epoch + 1)  # 16 samples an epoch, 2 a tiny-batch
    assert loader._manager is None and loader.stats.worker_restarts == 0
    loader.stats.worker_restarts = 5  # counts go on from what the stats hold
    it = iter(loader)
    next(it)
    os.kill(loader._manager.pool.workers[0].process.pid, signal.SIGKILL)
    for _ in it:
        pass
    assert loader.stats.worker_restarts == 6
    loader.close()


def test_workers_start_right_after_opencv_work_in_the_training_process():
    """A worker forked while OpenCV's thread pool was busy in this process hung in cv2.setNumThreads
    (inherited locks, no threads behind them): the fork now happens with the pool held at one thread."""
    import cv2

    before = cv2.getNumThreads()
    big = np.random.default_rng(0).integers(0, 255, (600, 600, 3), np.uint8)
    for _ in range(4):
        loader = FusionFlowLoader(Bytes(8), batch_size=4, num_workers=2, policy=SMALL, timeout=60)
        cv2.GaussianBlur(big, (0, 0), 0.8)  # the pool's threads are busy a moment before the fork
        assert [i for _, y in loader for i in y.tolist()] == list(range(8))
    assert cv2.getNumThreads() == before  # the caller's OpenCV setting is left as it was


class BatchedOnly(torch.utils.data.Dataset):
    """Read only by `__getitems__` (torch's Dataset.__getitem__ raises NotImplementedError), as DataLoader's fetcher
    reads such a dataset; `bad` samples make the batched read raise, naming the first."""

    def __init__(self, n, bad=()):
        self.inner = Bytes(n)
        self.bad = set(bad)

    def __len__(self):
        return len(self.inner)

    def __getitems__(self, indices):
        if self.bad & set(indices):
            raise ValueError(f"sample {min(self.bad & set(indices))} is corrupt")
        return [self.inner[i] for i in indices]


class BatchedToo(Bytes):
    """Both reads: the batched one gives targets past 1000 (so a batch says which read made it) and raises where a
    `bad` sample is among its indices; a bad sample's own read gives bytes that are not an image."""

    def __getitems__(self, indices):
        if self.bad & set(indices):
            raise OSError("a batched read failed")
        return [(self.data[i], 1000 + i) for i in indices]


def targets_of(loader) -> list:
    got = [i for _, y in loader for i in y.tolist()]
    loader.close()
    return got


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_s_batched_read_is_used_as_dataloader_uses_it(num_workers):
    """CPU workers read each sample with dataset[i]: a dataset read by __getitems__ only failed every sample with
    NotImplementedError, and one with both was never read batched (DataLoader's fetcher calls __getitems__)."""
    kw = dict(batch_size=4, num_workers=num_workers, policy=SMALL, tiny_batch_size=2)
    assert sorted(targets_of(FusionFlowLoader(BatchedOnly(14), **kw))) == list(range(14))
    assert sorted(targets_of(FusionFlowLoader(BatchedToo(10), **kw))) == list(range(1000, 1010))  # all batched
    # a batched read that raises: each sample read alone, the failing one told from the rest of its tiny-batch
    with pytest.warns(UserWarning, match=r"on_error='skip': dropping sample 5 \(/data/img_5.jpg\) \(DecodeError"):
        got = targets_of(FusionFlowLoader(BatchedToo(10, bad={5}), on_error="skip", **kw))
    assert sorted(t % 1000 for t in got) == [i for i in range(10) if i != 5] and max(got) >= 1000
    assert 1 <= sum(t < 1000 for t in got) < len(got)  # 5's tiny-batch read alone, the others batched
    # ... also a dataset read only so: each sample alone by __getitems__([i]) (the batched read's error was blamed
    # on every sample of the tiny-batch, and on_error='skip' dropped them all)
    with pytest.raises(SampleError, match=r"sample 3 failed: ValueError: sample 3 is corrupt"):
        targets_of(FusionFlowLoader(BatchedOnly(8, bad={3}), **kw))
    with pytest.warns(UserWarning, match=r"dropping sample 5 \(ValueError: sample 5 is corrupt"):
        got = targets_of(FusionFlowLoader(BatchedOnly(12, bad={5}), on_error="skip", **kw))
    assert sorted(got) == [i for i in range(12) if i != 5]
    # read_ahead= reads each sample apart on its threads: by __getitems__([i]) where that is the only read
    assert sorted(targets_of(FusionFlowLoader(BatchedOnly(14), read_ahead=2, **kw))) == list(range(14))
    assert sorted(targets_of(FusionFlowLoader(BatchedToo(10), read_ahead=2, **kw))) == list(range(10))
