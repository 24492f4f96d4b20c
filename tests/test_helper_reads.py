"""A DALI run read by the input helpers (accel/helper_reads.py, input_helpers.py's InputHelper.read): the bytes,
targets, sizes and draws the training process would have read and made itself, the bytes in shared memory
that DALI reads in place; slots held while DALI may read them; anything the helpers cannot do read by the
training process, with nothing lost."""

import gc
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from test_accelerator import loader  # noqa: E402
from test_loader import JPEGS, Bytes, no_leaks  # noqa: E402,F401
from test_run_read import works_of  # noqa: E402

from fusionflow.accel import helper_reads  # noqa: E402
from fusionflow.accel.header_sizes import HeaderSizes  # noqa: E402
from fusionflow.accel.host_inputs import HostInputs  # noqa: E402
from fusionflow.accel.input_helpers import MAX_READ_FAILURES, InputHelper  # noqa: E402
from fusionflow.accel.run_read import read_by_helpers  # noqa: E402
from fusionflow.policy import load_policy  # noqa: E402

POLICY = load_policy("randaugment")


class NotInHelpers(Bytes):
    """Bytes that the input helpers cannot read (they raise there, as a handle that does not survive their start
    would); counts the reads made in the process that made it."""

    def __init__(self, n=61, bad=()):
        super().__init__(n, bad=bad)
        self.home, self.home_reads = os.getpid(), []

    def __getitem__(self, i):
        if mp.current_process().name.startswith("fusionflow-dali-inputs"):
            raise OSError("this dataset cannot be read in a helper")
        if os.getpid() == self.home:
            self.home_reads.append(i)
        return super().__getitem__(i)


class CountsHome(Bytes):
    """Bytes counting the reads made in the process that made it (a CPU worker's or a helper's are not)."""

    def __init__(self, n=61):
        super().__init__(n)
        self.home, self.home_reads = os.getpid(), []

    def __getitem__(self, i):
        if os.getpid() == self.home:
            self.home_reads.append(i)
        return super().__getitem__(i)


def helper_for(ds, ctx="fork", processes=1, run_samples=64, depth=2):
    return InputHelper(HostInputs(POLICY), mp.get_context(ctx), processes=processes, reads=(ds, run_samples, depth, 0))


@pytest.mark.parametrize("ctx,processes", [("fork", 1), ("fork", 3), ("spawn", 2)])
def test_helpers_read_a_run_as_the_training_process_would(no_leaks, ctx, processes):
    """Bytes (bit for bit), targets, header sizes and draws of every sample, in order, for runs cut into one
    share or several; the bytes are views of the helpers' shared memory."""
    ds = Bytes(61)
    helper = helper_for(ds, ctx, processes)
    rng = np.random.default_rng(0)
    try:
        for n in (1, 20, 40, 61):
            indices = rng.permutation(61)[:n].tolist()
            copies = [i % 2 for i in range(n)]
            got = helper.read(indices, copies, 3, 1)
            assert got is not None and got.unplaced == []
            assert [bytes(s) for s in got.samples] == [ds.data[i] for i in indices]
            assert all(isinstance(s, np.ndarray) and s.base is not None for s in got.samples)  # views, not copies
            assert got.labels == indices
            want_hw = HeaderSizes(61).many(indices, [ds.data[i] for i in indices])
            np.testing.assert_array_equal(got.hw, want_hw)
            want = HostInputs(POLICY).columns(indices, copies, want_hw, 3, 1)
            assert len(got.columns) == len(want) and all(np.array_equal(a, b) for a, b in zip(got.columns, want))
            del got
        assert helper.cpu_seconds > 0  # the reads are the helpers' CPU, reported
    finally:
        helper.close()


def test_a_slot_is_held_while_its_run_may_be_read_and_comes_back_after(no_leaks):
    """depth + 2 slots: that many runs read and held, the next is left to the training process (None); one let
    go, the next run is read by the helpers again, into the slot let go."""
    ds = Bytes(20)
    helper = helper_for(ds, depth=2)
    try:
        held = [helper.read([i], None, 0, 0) for i in range(4)]
        assert all(h is not None for h in held) and len({h.slot.index for h in held}) == 4
        assert helper.read([5], None, 0, 0) is None
        freed = held.pop(1).slot.index
        gc.collect()
        again = helper.read([6, 7], None, 0, 0)
        assert again is not None and again.slot.index == freed
        assert [bytes(s) for s in again.samples] == [ds.data[6], ds.data[7]]
        assert [bytes(s) for s in held[0].samples] == [ds.data[0]]  # the runs still held keep their bytes
    finally:
        helper.close()


@pytest.mark.parametrize("processes,n", [(1, 8), (3, 60)])
def test_samples_too_big_for_the_slot_are_read_by_the_training_process(no_leaks, monkeypatch, processes, n):
    """A slot with room for a few samples: the rest of the run are left unplaced by the helpers (one, or three
    with a share each) and read_by_helpers reads them here; the run is whole, in order, with the helpers' draws."""
    monkeypatch.setattr(helper_reads, "SAMPLE_BYTES", max(map(len, JPEGS[:61])) * 3 // 60)
    ds = CountsHome(61)
    helper = helper_for(ds, processes=processes, run_samples=60)
    try:
        order = np.random.default_rng(n).permutation(61)[:n].tolist()
        read = read_by_helpers(helper, ds, works_of(order), None, seed=1)
        assert read is not None and read.keep is not None
        assert [bytes(s) for s in read.samples] == [ds.data[i] for i in order]
        assert read.labels == order and read.given_back == []
        assert 0 < len(ds.home_reads) < len(order)  # some placed by the helpers, the others read here
        hw = HeaderSizes(61).many(order, [ds.data[i] for i in order])
        want = HostInputs(POLICY).columns(order, None, hw, 1, 0)
        assert all(np.array_equal(a, b) for a, b in zip(read.columns, want))
    finally:
        helper.close()


def test_a_run_with_unreadable_samples_gives_their_tiny_batches_back_and_keeps_the_rest(no_leaks):
    """A sample that is not an image: its tiny-batch goes back whole (the CPU path reports it), the others run
    with their own draws (the columns' rows of the given-back tiny-batch dropped)."""
    ds = Bytes(12, bad={4})
    helper = helper_for(ds, run_samples=12)
    try:
        order = [0, 1, 4, 5, 8, 9]
        read = read_by_helpers(helper, ds, works_of(order), None, seed=2)
        assert [w.indices for w in read.given_back] == [(4, 5)]
        assert read.labels == [0, 1, 8, 9] and [bytes(s) for s in read.samples] == [ds.data[i] for i in (0, 1, 8, 9)]
        hw = HeaderSizes(12).many([0, 1, 8, 9], [ds.data[i] for i in (0, 1, 8, 9)])
        want = HostInputs(POLICY).columns([0, 1, 8, 9], None, hw, 2, 0)
        assert all(np.array_equal(a, b) for a, b in zip(read.columns, want))
    finally:
        helper.close()


def test_a_dataset_the_helpers_cannot_read_is_read_by_the_training_process(no_leaks):
    """The helpers' reads fail: each such run is left to the training process (None, its slot free again); a
    failure counts once the training process has read that run (`read_here`), and after MAX_READ_FAILURES the
    helpers stop reading (they still make the draws)."""
    ds = NotInHelpers(12)
    helper = helper_for(ds)
    try:
        for _ in range(MAX_READ_FAILURES + 2):  # the training process failed too: the dataset's failure, not theirs
            assert helper.read([0, 1], None, 0, 0) is None
        assert helper.slots is not None and helper.read_failures == 0
        for _ in range(MAX_READ_FAILURES):
            assert helper.slots is not None
            assert helper.read([0, 1], None, 0, 0) is None
            helper.read_here()
        assert helper.slots is None and helper.read([0, 1], None, 0, 0) is None
        assert helper.columns([0], None, [(30, 30)], 0, 0)[0].shape == (1, 2)
    finally:
        helper.close()


@pytest.mark.parametrize("dataset", [CountsHome, NotInHelpers])
def test_the_loader_reads_the_accelerators_samples_in_its_helpers(no_leaks, dataset):
    """Two epochs on DALI's CPU backend: every sample once, the accelerator producing; the training process
    read none of them itself where the helpers could (CountsHome), and read them all where they could not."""
    ds = dataset(61)
    ld = loader(ds, shuffle=True, generator=torch.Generator().manual_seed(5), persistent_workers=True)
    ds.home_reads.clear()  # the loader's own look at the dataset, made at construction
    try:
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            order = [i for _, y in ld for i in y.tolist()]
            assert sorted(order) == list(range(61)), epoch
        assert ld.stats.accelerator_samples > 0
        if dataset is CountsHome:
            assert ds.home_reads == []
        else:
            assert len(ds.home_reads) >= ld.stats.accelerator_samples
    finally:
        ld.close()


class HoldsAFile(Bytes):
    """Bytes whose targets are read from a file it opened when made (a descriptor a forked process inherits)."""

    def __init__(self, n, path):
        super().__init__(n)
        with open(path, "wb") as f:
            f.write(bytes(range(n)))
        self.fd = os.open(path, os.O_RDONLY)

    def __getitem__(self, i):
        return self.data[i], os.pread(self.fd, 1, i)[0]


def test_a_forked_helper_keeps_the_datasets_own_descriptors(no_leaks, tmp_path):
    """A dataset reading through a descriptor it opened before the helpers forked reads right in them."""
    ds = HoldsAFile(30, tmp_path / "targets")
    helper = helper_for(ds, "fork", processes=2)
    try:
        indices = list(range(29, -1, -1))
        got = helper.read(indices, None, 0, 0)
        assert got is not None and got.labels == indices
        assert [bytes(s) for s in got.samples] == [ds.data[i] for i in indices]
    finally:
        helper.close()
        os.close(ds.fd)


class Unpicklable(Bytes):
    def __reduce__(self):
        raise TypeError("this dataset does not pickle")


def test_helpers_that_cannot_take_the_dataset_still_make_the_draws(no_leaks, caplog):
    """Spawned helpers need the dataset pickled: where it does not pickle they start without it (the accelerator
    reads its runs) and say so."""
    from fusionflow.accel.input_helpers import start_helper

    with caplog.at_level("WARNING", logger="fusionflow.accel.input_helpers"):
        helper = start_helper(POLICY, mp.get_context("spawn"), 1, (Unpicklable(5), 16, 2, 0))
    try:
        assert helper is not None and helper.slots is None and helper.read([0], None, 0, 0) is None
        assert "cannot read the dataset" in caplog.text
        want = HostInputs(POLICY).columns([1, 2], None, [(40, 30)] * 2, 0, 0)
        assert all(np.array_equal(a, b) for a, b in zip(helper.columns([1, 2], None, [(40, 30)] * 2, 0, 0), want))
    finally:
        helper.close()


def test_a_run_read_by_the_helpers_takes_as_many_calls_in_the_training_process_whatever_its_size(no_leaks):
    """Issue 41's feeder bar: the training process's Python calls for a run the helpers read do not grow with the
    run (8 samples in tiny-batches of 4, or 120 in tiny-batches of 60)."""
    from test_run_read import calls_of

    ds = Bytes(61)
    helper = helper_for(ds, run_samples=128)
    try:
        read_by_helpers(helper, ds, works_of(list(range(61)), per=4), None, 0)  # every header read once

        def calls(n, per):
            works = works_of([i % 61 for i in range(n)], per=per)
            got = []
            count = calls_of(lambda: got.append(read_by_helpers(helper, ds, works, None, 0)))
            assert len(got[0].samples) == n and got[0].labels == [i % 61 for i in range(n)]
            return count

        assert calls(8, 4) == calls(120, 60)
    finally:
        helper.close()


def test_the_pipeline_holds_a_runs_slot_until_dali_is_done_with_its_bytes(no_leaks):
    """DALI reads the views in place: the slot goes back only when the pipeline lets the run go -- one run after
    its collection (DALI may read fed memory until then), or when it is discarded."""
    from fusionflow.accel.dali_graph import DaliPolicyPipeline
    from fusionflow.policy import load_policy

    ds = Bytes(8)
    helper = helper_for(ds, run_samples=4, depth=0)  # two slots
    pipe = DaliPolicyPipeline(load_policy(POLICY, size=(32, 32)), 4, depth=2)
    try:
        first = read_by_helpers(helper, ds, works_of([0, 1, 2, 3]), None, 0)
        pipe.submit(first.samples, [0, 1, 2, 3], 0, 0, None, first.sizes, first.columns, keep=first.keep)
        second = read_by_helpers(helper, ds, works_of([4, 5]), None, 0)
        pipe.submit(second.samples, [4, 5], 0, 0, None, second.sizes, second.columns, keep=second.keep)
        del first, second
        gc.collect()
        assert helper.read([6], None, 0, 0) is None  # both slots held by the runs in flight
        pipe.collect()
        gc.collect()
        assert helper.read([6], None, 0, 0) is None  # the first run's bytes are kept one run more
        pipe.collect()
        gc.collect()
        third = helper.read([6], None, 0, 0)
        assert third is not None  # the first run's slot is back
        assert helper.read([7], None, 0, 0) is None  # the second's is still kept
        pipe.reset()
        gc.collect()
        assert helper.read([7], None, 0, 0) is not None  # discarded with the pipeline's runs
    finally:
        pipe.close()
        helper.close()


class TensorTargets(Bytes):
    def __getitem__(self, i):
        return self.data[i], torch.tensor(i)


def test_targets_other_than_numbers_are_read_by_the_training_process(no_leaks):
    """Tensor targets would cost the training process more to unpickle than to read: the helpers leave those
    runs to it (and after MAX_READ_FAILURES leave it every run); the accelerator keeps producing, every sample
    once, with its own target."""
    ds = TensorTargets(61)
    ld = loader(ds, shuffle=True, generator=torch.Generator().manual_seed(5), persistent_workers=True)
    try:
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            order = [i for _, y in ld for i in y.tolist()]
            assert sorted(order) == list(range(61)), epoch
        accel = ld.parts.gpu.accel
        assert ld.stats.accelerator_samples > 0 and accel.retired is None
        assert accel.source.helper is not None and accel.source.helper.slots is None  # still drawing, no longer reading
    finally:
        ld.close()


def test_reading_helpers_end_when_the_training_process_is_killed(tmp_path):
    """SIGKILL of the training process: its forked reading helpers see their pipe's end and exit (none keeps
    the training process's end of its own pipe, or another's)."""
    import signal
    import subprocess
    import sys
    import time

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "train.py"
    script.write_text(
        f"""
import multiprocessing as mp, sys, time
sys.path[:0] = [{here!r}]
from test_helper_reads import helper_for
from test_loader import Bytes
helper = helper_for(Bytes(20), "fork", processes=3)
assert helper.read(list(range(20)), None, 0, 0) is not None
print(" ".join(str(p.pid) for p in helper._procs), flush=True)
time.sleep(600)
"""
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=here)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
        time.sleep(0.05)
    for pid in alive:  # nothing left behind by a failing run either
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"reading helpers left running after the training process died: {alive}"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.lower() for line in f if line.startswith("State:")), "")
    except OSError:
        return "zombie"


class NumpyTargets(CountsHome):
    """Targets from an array, as `self.targets = np.array(...)` gives them (np.int64), and (image, a, b) items."""

    def __getitem__(self, i):
        data, _ = super().__getitem__(i)
        return data, np.int64(i), float(i) / 2


def test_numpy_and_several_targets_travel_with_the_helpers_reads(no_leaks):
    """np.int64 targets and (image, a, b) items are read by the helpers (only tensors stay home): the training
    process reads none of the accelerator's samples, every sample once with its own targets."""
    ds = NumpyTargets(61)
    ld = loader(ds, shuffle=True, generator=torch.Generator().manual_seed(5), persistent_workers=True)
    ds.home_reads.clear()
    try:
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            got = [(int(i), float(h)) for _, a, b in ld for i, h in zip(a.tolist(), b.tolist())]
            assert sorted(got) == [(i, i / 2) for i in range(61)], epoch
        assert ld.stats.accelerator_samples > 0 and ds.home_reads == []
        assert ld.parts.gpu.accel.source.helper.slots is not None
    finally:
        ld.close()


def _closes_owned_and_checks(fd, conn):
    from fusionflow.runtime.shm import close_owned_fds

    close_owned_fds()
    try:
        os.fstat(fd)
        conn.send(True)
    except OSError:
        conn.send(False)


def test_no_descriptor_is_left_for_forked_children_to_close_after_the_helpers_stop_reading(no_leaks, tmp_path):
    """Helpers that stopped reading, then closed: the descriptors their segments' mappings kept are no longer on the
    list forked children close, so a file opened afterwards (which may get one of those numbers) stays open in a
    child that closes the list, as a CPU worker does."""
    ds = NotInHelpers(12)
    helper = helper_for(ds)
    for _ in range(MAX_READ_FAILURES):
        assert helper.read([0, 1], None, 0, 0) is None
        helper.read_here()
    assert helper.slots is None
    helper.close()
    gc.collect()
    files = [open(tmp_path / f"f{k}", "wb") for k in range(8)]  # noqa: SIM115 -- closed below
    try:
        for f in files:
            parent, child = mp.get_context("fork").Pipe()
            proc = mp.get_context("fork").Process(target=_closes_owned_and_checks, args=(f.fileno(), child))
            proc.start()
            assert parent.recv(), f"a forked child closed descriptor {f.fileno()}"
            proc.join(30)
            parent.close()
            child.close()
    finally:
        for f in files:
            f.close()
