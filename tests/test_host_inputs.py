"""The accelerator's host inputs made per run (accel/host_inputs.py) and by its helpers (accel/input_helpers.py)."""

import contextlib
import multiprocessing as mp
import os
import signal
import struct
import time
import types
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from dali_numpy import run_numpy  # noqa: E402
from test_accelerator import loader  # noqa: E402
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: E402,F401

from fusionflow.accel.dali_graph import DaliPolicyPipeline  # noqa: E402
from fusionflow.accel.header_sizes import HeaderSizes  # noqa: E402
from fusionflow.accel.host_inputs import HostInputs  # noqa: E402
from fusionflow.accel.input_helpers import (  # noqa: E402
    MIN_SHARE,
    STOPPED_S,
    HelperGone,
    InputHelper,
    helper_processes,
    start_helper,
)
from fusionflow.policy import crop_window, draw, load_policy  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
ERASING = load_policy(SMALL, normalize=MEAN_STD, erase={"p": 0.5, "value": [0.2, 0.4, 0.6]})
NOISE = load_policy(SMALL, normalize=MEAN_STD, erase={"p": 0.5, "value": "random"})


def sizes_of(ds):
    dims = HeaderSizes(len(ds.data))
    return [tuple(hw) for hw in dims.many(range(len(ds.data)), ds.data).tolist()]


@pytest.mark.parametrize("policy", [SMALL, ERASING, "randaugment", "trivialaugment"])
def test_a_runs_columns_are_its_samples_draws(policy):
    """Row i of each column is sample i's draw resolved as a CPU worker resolves it: the crop window of
    its image size, its flip, its ops' local ids and parameters, its erased rectangle."""
    p = load_policy(policy)
    host = HostInputs(p)
    indices, copies = [5, 0, 17, 3, 3], [0, 0, 1, 0, 2]
    sizes = [(90, 60), (31, 47), (200, 120), (64, 64), (64, 64)]
    cols = host.columns(indices, copies, sizes, seed=9, epoch=2)
    names = ["Identity"] + [o.name for o in p.augment.ops if o.name != "Identity"]
    for row, (i, c, (h, w)) in enumerate(zip(indices, copies, sizes)):
        d = draw(p, 9, 2, i, c)
        top, left, ch, cw = crop_window(p, d, h, w)
        assert cols[0][row].tolist() == [left, top] and cols[1][row].tolist() == [cw, ch]
        assert cols[2][row] == d.flip
        assert cols[3][row].tolist() == [names.index(op.name) for op in d.ops] + [0] * (host.slots - len(d.ops))
        for k, op in enumerate(d.ops):
            np.testing.assert_array_equal(cols[4][row, k], np.asarray(op.params(*p.size), np.float32))
        if p.erase is not None:
            e = d.erase
            assert cols[5][row].tolist() == ([e.top, e.left] if e else [0, 0])
            assert cols[6][row].tolist() == ([e.height, e.width] if e else [0, 0])
    assert len(cols) == 5 + (2 if p.erase is not None else 0)
    assert all(c.flags.c_contiguous and len(c) == len(indices) for c in cols)


@pytest.mark.parametrize("policy", [SMALL, ERASING])
def test_dali_fed_a_runs_columns_makes_the_per_sample_pixels(policy):
    ds = Bytes(12)
    sizes = sizes_of(ds)
    pipe = DaliPolicyPipeline(policy, batch_size=12)
    idx = list(range(12))
    per_sample = run_numpy(pipe, ds.data, idx, seed=3, epoch=1)
    cols = HostInputs(pipe.policy).columns(idx, None, sizes, seed=3, epoch=1)
    pipe.submit(ds.data, idx, 3, 1, sizes=sizes, columns=cols)
    out = pipe.collect()
    np.testing.assert_array_equal(np.stack([np.array(out[i]) for i in range(12)]), per_sample)
    pipe.close()


class Failing(HostInputs):
    def columns(self, indices, copies, sizes, seed, epoch):
        raise ValueError(f"no columns for {np.asarray(indices).tolist()}")


def test_the_helper_answers_as_the_thread_would_and_ends_on_close(no_leaks):
    p = load_policy("randaugment")
    helper = InputHelper(HostInputs(p), mp.get_context())
    indices, sizes = list(range(40)), [(100 + i, 80 + 2 * i) for i in range(40)]
    got = helper.columns(indices, [1] * 40, sizes, 5, 7)
    want = HostInputs(p).columns(indices, [1] * 40, sizes, 5, 7)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert helper.cpu_seconds > 0  # its CPU time is reported, not hidden
    helper.close()
    helper.close()  # idempotent
    assert not helper.alive


def test_the_helpers_error_is_raised_and_a_dead_helper_says_so(no_leaks):
    failing = InputHelper(Failing(load_policy(SMALL)), mp.get_context())
    with pytest.raises(ValueError, match=r"no columns for \[1, 2\]"):
        failing.columns([1, 2], None, [(30, 30)] * 2, 0, 0)
    assert failing.alive  # an error computing a run is that run's, not the helper's end
    failing.close()
    helper = InputHelper(HostInputs(load_policy(SMALL)), mp.get_context())
    os.kill(helper._procs[0].pid, signal.SIGKILL)
    helper._procs[0].join(30)
    with pytest.raises(HelperGone, match="gone"):
        helper.columns([1], None, [(30, 30)], 0, 0)
    helper.close()


class FailingFrom(HostInputs):
    """Fails any share holding a sample index >= `bad`."""

    bad = 10**9

    def columns(self, indices, copies, sizes, seed, epoch):
        if max(np.asarray(indices).tolist()) >= self.bad:
            raise ValueError("a share failed")
        return super().columns(indices, copies, sizes, seed, epoch)


def test_helpers_cut_a_run_into_shares_and_answer_as_the_thread_would(no_leaks):
    """Three helpers: a run cut into contiguous shares (all three busy at 3 * MIN_SHARE samples, fewer below)
    gives the thread's columns exactly; one share's error is raised and the pipes stay in step (the next run is
    right); a helper killed makes the next run say HelperGone."""
    p = load_policy("randaugment")
    host = HostInputs(p)
    failing = FailingFrom(p)
    failing.bad = 1000
    helper = InputHelper(failing, mp.get_context(), processes=3)
    assert helper.alive and len(helper._procs) == 3
    for n in (1, MIN_SHARE, 2 * MIN_SHARE + 1, 3 * MIN_SHARE, 100):
        indices, sizes = list(range(7, 7 + n)), [(100 + i, 80 + 2 * i) for i in range(n)]
        copies = [i % 3 for i in range(n)]
        got = helper.columns(indices, copies, sizes, 5, 7)
        want = host.columns(indices, copies, sizes, 5, 7)
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), n
    with pytest.raises(ValueError, match="a share failed"):  # the last shares fail, the first answers
        helper.columns(list(range(950, 1050)), None, [(64, 64)] * 100, 0, 0)
    got = helper.columns(list(range(60)), None, [(64, 64)] * 60, 1, 1)
    assert all(np.array_equal(a, b) for a, b in zip(got, host.columns(list(range(60)), None, [(64, 64)] * 60, 1, 1)))
    assert helper.cpu_seconds > 0
    os.kill(helper._procs[2].pid, signal.SIGKILL)
    helper._procs[2].join(30)
    assert not helper.alive
    with pytest.raises(HelperGone):
        helper.columns(list(range(60)), None, [(64, 64)] * 60, 1, 1)
    helper.close()
    assert not helper._procs


class Hanging(HostInputs):
    def columns(self, indices, copies, sizes, seed, epoch):
        time.sleep(3600)


class Stubborn(Exception):
    def __init__(self, a, b):  # pickles as Stubborn(a): unpickling it fails in the training process
        super().__init__(a)


class Unreadable(HostInputs):
    def columns(self, indices, copies, sizes, seed, epoch):
        raise Stubborn("x", "y")


def test_a_silent_helper_is_given_up_on_and_closing_it_is_bounded(no_leaks):
    """A helper that never answers: the run says HelperGone after `timeout`, and close() ends within its own
    bound (a forked helper closed the descriptor join waits on: join alone would wait for it forever)."""
    helper = InputHelper(Hanging(load_policy(SMALL)), mp.get_context("fork"), timeout=0.5, processes=2)
    t0 = time.monotonic()
    with pytest.raises(HelperGone, match="no answer"):
        helper.columns(list(range(40)), None, [(30, 30)] * 40, 0, 0)
    # given up on: closed, the hung one killed at once -- not after close()'s 5 s grace, which it would wait out
    # (it reads no stop message while it computes): the thread must still read the run inside the stall bound
    assert not helper._procs and time.monotonic() - t0 < 0.5 + 4.0
    with pytest.raises(HelperGone, match="closed"):  # and a run asked of a closed helper says so
        helper.columns([1], None, [(30, 30)], 0, 0)
    hung = InputHelper(Hanging(load_policy(SMALL)), mp.get_context("fork"), timeout=60)
    hung._conns[0].send((np.arange(2), None, np.full((2, 2), 30), 0, 0))  # busy for an hour
    t0 = time.monotonic()
    hung.close(timeout=0.5)
    assert time.monotonic() - t0 < 30 and not hung._procs


def test_an_answer_that_cannot_be_read_closes_the_helpers():
    """An exception that pickles but does not unpickle: the pipes would be out of step (the other helpers'
    answers unread), so the helpers are closed and the run says HelperGone (the thread makes inputs)."""
    helper = InputHelper(Unreadable(load_policy(SMALL)), mp.get_context(), processes=2)
    with pytest.raises(HelperGone, match="unreadable"):
        helper.columns(list(range(40)), None, [(30, 30)] * 40, 0, 0)
    assert not helper._procs


def test_helpers_count_this_ranks_cores_only(monkeypatch):
    from fusionflow.runtime.cores import rank_cores

    assert rank_cores(16) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on the node: a quarter each
    assert rank_cores(16) == 4 and rank_cores(2) == 1
    assert helper_processes(True, rank_cores(16), 2, 1) == 1


def test_helper_processes_take_the_cores_left_on_a_gpu_only():
    assert helper_processes(False, 16, 4, 4) == 1  # DALI's CPU backend: the CPU workers need the cores
    assert helper_processes(True, 16, 4, 4) == 4  # 7 cores left: at most MAX_HELPERS
    assert helper_processes(True, 16, 4, 9) == 2
    assert helper_processes(True, 16, 15, 1) == 1  # none left: still one (the thread's own work is dearer)
    with pytest.raises(ValueError, match="processes=0"):
        InputHelper(HostInputs(load_policy(SMALL)), mp.get_context(), processes=0)


def test_a_forked_helper_keeps_none_of_the_training_processes_descriptors(no_leaks):
    """A pipe's write end open in the training process when the helper forks: once the training process
    closes it, its reader sees end-of-file -- the helper did not keep a copy."""
    r, w = os.pipe()
    helper = InputHelper(HostInputs(load_policy(SMALL)), mp.get_context("fork"))
    helper.columns([0], None, [(30, 30)], 0, 0)  # it is past its start-up
    os.close(w)
    os.set_blocking(r, False)
    try:
        assert os.read(r, 1) == b""  # EOF, not BlockingIOError (a writer left open)
    finally:
        os.close(r)
        helper.close()


def test_no_helper_for_noise_erasing():
    assert start_helper(load_policy(NOISE)) is None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_helper_killed_or_stopped_costs_seconds_the_thread_makes_the_inputs(no_leaks, caplog, sig):
    """The helper killed, or stopped and never continued, after the first mini-batch: every sample of both epochs
    still arrives once, the same accelerator keeps producing (in its own thread from then on: the next epoch's runs
    are made after it), it is not retired, and the log says why. Stopped, it retired the accelerator at the stall
    bound (25 s) until 2026-11-29."""
    ds = Bytes(61)  # test_accelerator's loader: batch 12, one CPU worker, tiny-batches of 2, DALI's CPU backend
    ld = loader(ds, shuffle=True, generator=torch.Generator().manual_seed(2), persistent_workers=True)
    before, pid = None, None
    try:
        with caplog.at_level("WARNING", logger="fusionflow.accel.input_helpers"):
            for epoch in (0, 1):
                ld.set_epoch(epoch)
                order = []
                for _, y in ld:
                    order += y.tolist()
                    if before is None:
                        accel = ld.parts.gpu.accel
                        pid = accel.source.helper._procs[0].pid
                        os.kill(pid, sig)
                        before = ld.stats.accelerator_samples
                assert sorted(order) == list(range(61)), epoch
        assert ld.parts.gpu.accel is accel and accel.source.helper is None and ld.stats.accelerator_retired is None
        assert "makes its inputs in its own thread" in caplog.text
        assert sig == signal.SIGKILL or f"(pid {pid}) has been stopped for" in caplog.text
        assert ld.stats.accelerator_samples > before  # it went on producing
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGCONT)
        ld.close()


def test_a_stopped_helper_is_given_up_within_seconds_and_killed(no_leaks):
    """A helper stopped (SIGSTOP, a paused debugger) while the thread awaits its answer: HelperGone once it has been
    stopped STOPPED_S, well before the bound a running helper gets (until 2026-11-29 the thread waited 60 s, past
    the accelerator's 25 s stall bound: a helper stopped mid-run retired the accelerator), and the stopped helper
    is killed at once, not after close()'s grace."""
    helper = InputHelper(HostInputs(load_policy(SMALL)), mp.get_context("fork"))
    helper.columns([0], None, [(30, 30)], 0, 0)  # past its start-up
    pid = helper._procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(HelperGone, match=rf"helper 0 \(pid {pid}\) has been stopped for"):
            helper.columns(list(range(8)), None, [(30, 30)] * 8, 0, 0)
        took = time.monotonic() - t0
        assert STOPPED_S <= took < helper.answer_bound(), took
        assert not helper._procs  # closed: the stopped helper killed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_helper_stopped_in_the_middle_of_its_answer_is_given_up_within_seconds(no_leaks):
    """An answer begun and not finished (a helper stopped while writing a reply larger than a pipe holds): the thread
    waited in recv() until the accelerator's stall bound retired it. Now the rest must come within STOPPED_S. The
    helper's pipe is swapped for one whose other end wrote a frame's length and ten bytes, then nothing."""
    helper = InputHelper(HostInputs(load_policy(SMALL)), mp.get_context("fork"))
    mine, theirs = mp.Pipe()
    try:
        os.write(theirs.fileno(), struct.pack("!i", 1 << 20) + b"x" * 10)
        helper._conns[0] = mine
        t0 = time.monotonic()
        with pytest.raises(HelperGone, match="gone or its answer unreadable .*10 of 1048576"):
            helper.columns([0], None, [(30, 30)], 0, 0)
        assert time.monotonic() - t0 < helper.answer_bound() and not helper._procs  # its helpers closed
    finally:
        theirs.close()
        helper.close()


def test_a_running_helper_is_given_up_before_the_run_it_holds():
    """A running helper's answer bound is at most half the stall bound `watch` puts on a run that lasts as long as
    the helpers' answers (a run lasts at least that; the other half: the run's time before it was asked for, and the
    thread's own read of it once the helpers are given up): the accelerator loses its helpers, never the run."""
    from fusionflow.runtime import liveness

    helper = InputHelper(HostInputs(load_policy(SMALL)), mp.get_context("fork"))
    try:
        for mean in (0.0, 0.002, 0.5, 30.0):  # none measured yet (the first run may build), fast, slow, very slow
            helper.answer_seconds = mean
            assert 0 < helper.answer_bound() <= liveness.stuck_bound(mean) / 2
        helper.columns([0], None, [(30, 30)], 0, 0)
        assert 0 < helper.answer_seconds < 30  # measured from the answers
    finally:
        helper.close()
    assert InputHelper.answer_bound(types.SimpleNamespace(timeout=0.5)) == 0.5  # a given timeout wins


def test_an_interrupt_ends_the_wait_for_a_hung_helper(no_leaks):
    """The accelerator's stop interrupts a wait for a helper that never answers: HelperGone within a slice, not
    at the answer bound (the thread that did not stop within 10 s left its DALI pipeline to the collector)."""
    import threading

    helper = InputHelper(Hanging(load_policy(SMALL)), mp.get_context("fork"))
    threading.Timer(0.5, helper.interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(HelperGone, match="interrupted"):
        helper.columns(list(range(8)), None, [(30, 30)] * 8, 0, 0)
    assert time.monotonic() - t0 < helper.answer_bound() / 2
    assert not helper._procs
