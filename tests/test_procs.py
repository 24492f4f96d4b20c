"""fusionflow/runtime/procs.py: a Ctrl-C held back around a worker's start (`interrupts_deferred`)."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from fusionflow.runtime import worker_pool
from fusionflow.runtime.procs import interrupts_deferred


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler in place (KeyboardInterrupt), whatever the test runner set."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_ctrl_c_inside_the_block_arrives_after_it(python_sigint):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python would run the handler here: at the next bytecode
            reached.append("the block's end")
    assert reached == ["the block's end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():  # none sent: nothing raised
        pass


def test_the_handler_in_place_gets_the_held_back_interrupt_and_is_put_back(python_sigint):
    seen = []
    handler = lambda signum, frame: seen.append(signum)  # noqa: E731
    signal.signal(signal.SIGINT, handler)
    with interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert seen == []
    assert seen == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is handler


def test_outside_the_main_thread_it_changes_nothing():
    done = []

    def run():
        with interrupts_deferred():  # signal.signal would raise ValueError in this thread
            done.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert done == [signal.getsignal(signal.SIGINT)]


def test_a_ctrl_c_between_a_workers_start_and_its_record_leaves_no_process(python_sigint, monkeypatch):
    """Session 33's sweep: an interrupt landing after a worker process started and before the pool listed it left
    a process close() did not know of. It now arrives once the worker is listed, and close() stops it."""
    from fusionflow.loader import FusionFlowLoader
    from fusionflow.tools.synthetic import EncodedImages, make_jpegs

    real = worker_pool.WorkerConn
    sent = []

    def interrupted(*args, **kwargs):  # runs between proc.start() and the pool's record of it
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_pool, "WorkerConn", interrupted)
    loader = FusionFlowLoader(EncodedImages(make_jpegs(8, 32, 33, seed=1)), batch_size=4, num_workers=1)
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    labels = [i for _, y in loader for i in y.tolist()]  # and the loader goes on
    assert sorted(labels) == list(range(8))
    loader.close()
    deadline = time.monotonic() + 30
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mp.active_children()


def test_run_every_runs_each_step_whatever_an_earlier_one_raised_then_raises_the_first(caplog):
    """...and logs a later step's error, which would otherwise be lost (a second Ctrl-C is not logged)."""
    from fusionflow.runtime.procs import run_every

    ran = []

    def interrupted():
        ran.append("a")
        raise KeyboardInterrupt

    def failing():
        ran.append("b")
        raise ValueError("second")

    with pytest.raises(KeyboardInterrupt), caplog.at_level("ERROR", logger="fusionflow.runtime.procs"):
        run_every(interrupted, failing, interrupted, lambda: ran.append("c"))
    assert ran == ["a", "b", "a", "c"]
    logged = [r for r in caplog.records if r.name == "fusionflow.runtime.procs"]
    assert len(logged) == 1 and "second" in str(logged[0].exc_info[1])
    run_every()  # nothing to do


class _Stubborn:
    """A process that ignored its stop; its first join is interrupted (a Ctrl-C in the grace)."""

    def __init__(self):
        self.alive, self.joins, self.ended_by = True, 0, None

    def join(self, timeout=None):
        self.joins += 1
        if self.joins == 1:
            raise KeyboardInterrupt

    def is_alive(self):
        return self.alive

    def terminate(self):
        self.alive, self.ended_by = False, "terminate"

    def kill(self):
        self.alive, self.ended_by = False, "kill"


def test_end_processes_interrupted_in_its_grace_still_ends_every_process():
    from fusionflow.runtime.procs import end_processes

    procs = [_Stubborn(), _Stubborn()]
    with pytest.raises(KeyboardInterrupt):
        end_processes(procs, grace=30.0)
    assert [p.ended_by for p in procs] == ["terminate", "terminate"]


def test_a_cpu_worker_ends_quietly_on_sigterm_whatever_handler_the_script_installed():
    """A script's SIGTERM handler (`python -m fusionflow serve` has one) is not a worker's: SIGTERMed (scancel,
    kill of the process group), a worker ends by the signal, not in the script's handler mid-sample."""
    from test_loader import SMALL, Bytes, collect

    from fusionflow.loader import FusionFlowLoader

    def scripts(signum, frame):
        raise KeyboardInterrupt("the script's handler")

    old = signal.signal(signal.SIGTERM, scripts)
    try:
        ld = FusionFlowLoader(Bytes(16), batch_size=4, num_workers=1, policy=SMALL, persistent_workers=True)
        collect(ld)
        proc = ld._manager.pool.workers[0].process
    finally:
        signal.signal(signal.SIGTERM, old)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60  # (the loader's thread reaps it too: a join here may return before its status)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.exitcode == -signal.SIGTERM
    ld.set_epoch(1)
    assert sorted(i for y in collect(ld)[1] for i in y.tolist()) == list(range(16))  # a new worker took over
    ld.close()


def test_a_lock_holder_counts_as_stopped_only_at_two_looks_in_a_row(monkeypatch):
    """StoppedHolder: a waiter gives up on a lock's holder seen stopped at two looks 0.1 s apart; a stop seen once
    (a profiler's sampling stop) does not count, and nothing is looked up before CHECK_S of waiting."""
    from fusionflow.runtime import procs

    states = iter([True, False, True, True])  # the holder's state at each look
    looks = []
    monkeypatch.setattr(procs, "is_stopped", lambda pid: looks.append(pid) or next(states))
    watch = procs.StoppedHolder(lambda: 42, began=0.0)
    assert watch.seen_stopped(0.005) is None and looks == []  # too early to look
    got = [watch.seen_stopped(t) for t in (0.02, 0.05, 0.13, 0.24, 0.35)]  # 0.05: before the next look is due
    assert got == [None, None, None, None, 42] and looks == [42] * 4
