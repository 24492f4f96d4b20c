"""The global manager: its tables, its loop, and loaders lending workers through it (in one process
and across processes), with exactly-once delivery, faults on either side, and elastic capacity."""

import contextlib
import math
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
from test_loader import SMALL, Bytes, collect, ff_segments, no_leaks  # noqa: F401

from fusionflow.loader import FusionFlowLoader
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.runtime.gm import tables as gt
from fusionflow.runtime.gm.manager import GlobalManager, GlobalManagerClient
from fusionflow.runtime.procs import is_stopped, pid_alive
from fusionflow.runtime.shm import BatchRing, RingLayout
from fusionflow.scheduling.lending import Loan, Progress, plan_lending


def job():
    return "test-" + secrets.token_hex(6)


def ordered(labels):
    return [i for y in labels for i in y.tolist()]


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def gm_pid_of(name):
    t = gt.Tables.attach(name)
    try:
        assert wait_until(lambda: t.gm_pid != 0), "the GM never took its table"
        return t.gm_pid
    finally:
        t.close()


class Unpicklable(Bytes):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.hook = lambda: None  # lambdas do not pickle


@pytest.fixture
def tables():
    t = gt.Tables.create(gt.table_name(job()))
    yield t
    t.unlink()
    t.close()


# ---------------------------------------------------------------- tables and the GM loop, no processes


def test_table_is_private_and_registration_respects_closing(tables):
    mode = os.stat("/dev/shm" + tables.name).st_mode & 0o777
    assert mode == 0o600
    assert tables.register(os.getpid()) == 0 and tables.register(os.getpid()) == 1
    other = gt.Tables.attach(tables.name)
    assert other.secret == tables.secret and len(other.secret) == 32
    assert other.active_rows() == [0, 1]
    tables.header["state"] = gt.CLOSING
    assert other.register(os.getpid()) is None  # its GM is about to unlink it
    other.close()


def _row(t, lm, waiting=0, idle=0, active=(), task_seconds=1.0, pid=None):
    assert t.register(pid or os.getpid()) == lm
    row = t.progress[lm]
    row["waiting"], row["idle"], row["task_seconds"], row["can_borrow"] = waiting, idle, task_seconds, 1
    row["heartbeat"] = time.monotonic() + 60  # fresh for the whole test
    row["address"] = f"ff-test-nobody-{secrets.token_hex(4)}".encode()  # no socket: the GM cannot ring it
    row["n_active"] = len(active)
    row["active_since"][: len(active)] = active


def test_gm_orders_follow_the_rule_and_wait_for_acks(tables):
    now = time.monotonic()
    _row(tables, 0, idle=2)
    _row(tables, 1, waiting=3, active=(now - 0.9,))  # one tiny-batch 90% done: need 2
    _row(tables, 2, waiting=0, idle=0)
    gm = GlobalManager(tables)
    gm.step()
    expect = plan_lending([Progress(0, 0, 0, (), 2), Progress(1, 0, 3, (0.9,), 0), Progress(2, 0, 0)])
    assert expect == [Loan(0, 1, 2)]
    a0, a1 = tables.action[0], tables.action[1]
    assert (int(a0["yield_seq"]), int(a0["yield_peer"]), int(a0["yield_count"])) == (1, 1, 2)
    assert (int(a1["borrow_seq"]), int(a1["borrow_peer"]), int(a1["borrow_count"])) == (1, 0, 2)
    gm.step()
    assert int(a0["yield_seq"]) == 1  # not acknowledged yet: no second order
    a0["yield_done"], a0["yield_ack"] = 2, 1  # the LM lent both
    tables.progress[0]["idle"] = 0
    gm.step()
    assert int(a0["yield_seq"]) == 1
    tables.progress[2]["idle"] = 1  # another idle worker appears: LM 1's two are still on their way
    gm.step()
    assert int(tables.action[2]["yield_seq"]) == 0
    tables.progress[1]["guests_total"] = 2  # they arrived; LM 1 still has 3 waiting
    gm.step()
    assert int(tables.action[2]["yield_seq"]) == 1 and int(tables.action[2]["yield_peer"]) == 1


def test_an_interrupt_anywhere_in_the_gm_loop_unlinks_its_table(tables, monkeypatch):
    """`gm serve` takes SIGTERM as KeyboardInterrupt: one landing between the loop's poll and its sleep (most of a
    2 ms turn) escaped the handler that unlinks the table, and left it in /dev/shm (a sweep, session 50)."""
    from fusionflow.runtime.gm import manager

    calls = []

    def monotonic():  # the loop's own clock after its first sleep: outside the step and the sleep
        if sys._getframe(1).f_code.co_name in ("run", "_poll"):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return time.monotonic()

    monkeypatch.setattr(manager, "time", types.SimpleNamespace(monotonic=monotonic, sleep=time.sleep))
    GlobalManager(tables).run(linger=5.0)
    assert len(calls) == 2 and not os.path.exists(os.path.join("/dev/shm", tables.name.lstrip("/")))


def test_gm_never_lends_to_an_lm_that_cannot_borrow(tables):
    _row(tables, 0, idle=2)
    _row(tables, 1, waiting=5)
    tables.progress[1]["can_borrow"] = 0
    GlobalManager(tables).step()
    assert int(tables.action[0]["yield_seq"]) == 0


def test_gm_reclaims_a_dead_lms_row_and_ring(tables):
    dead = subprocess.Popen(["true"])
    dead.wait()
    ring = BatchRing(RingLayout(1, 1, (1,), "uint8"))
    _row(tables, 0, waiting=4, pid=dead.pid)
    tables.progress[0]["ring"] = ring.name.encode()
    assert GlobalManager(tables).step() == 0
    assert tables.progress[0]["state"] == gt.FREE
    assert ring.name[1:] not in os.listdir("/dev/shm")
    ring.close()


def test_lending_rule_counts_incoming_workers():
    assert Progress(0, 0, waiting=4, incoming=3).need == 1
    assert Progress(0, 0, waiting=4, can_borrow=False).need == 0
    assert plan_lending([Progress(0, 0, 0, (), 3), Progress(1, 0, 4, incoming=3)]) == [Loan(0, 1, 1)]


# ---------------------------------------------------------------- loaders lending to each other


def lent_worker(lender):
    """`lender`'s own worker once it is lent to another loader (asserted within 20 s)."""
    found = []
    pool = lender._manager.pool
    assert wait_until(
        lambda: found.extend(w for w in pool.workers if w is not None and w.lent_to is not None) or bool(found),
        timeout=20,
    )
    return found[0]


def lending_pair(dataset, **kw):
    """Loader `a` over `dataset` (1-sample tiny-batches, batch 16) and `b` over 8 samples under one GM;
    `b` has run an epoch, `a` has delivered its first batch: `a`, `b`, a's iterator, the labels so far."""
    name = job()
    a = make(dataset, name, tiny_batch_size=1, batch_size=16, **kw)
    b = make(Bytes(8), name)
    collect(b)
    it = iter(a)
    return a, b, it, next(it)[1].tolist()


def serves_its_own_again(lender):
    """The lender's next epoch, on its own worker(s): every sample once, in order."""
    lender.set_epoch(1)
    _, labels = collect(lender)
    assert ordered(labels) == list(range(len(lender.dataset)))


def make(ds, name, **kw):
    args = dict(
        batch_size=8, num_workers=1, policy=SMALL, persistent_workers=True, pin_workers=False, global_manager=name
    )
    args.update(kw)
    return FusionFlowLoader(ds, **args)


def test_idle_loader_lends_to_a_busy_one_exactly_once_with_the_borrowers_draws():
    name = job()
    slow, fast = Bytes(40, sleep=0.04), Bytes(40)
    a, b = make(slow, name, seed=11), make(fast, name, seed=3)
    _, labels_b = collect(b)  # b's worker is idle from now on
    assert ordered(labels_b) == list(range(40))
    # the GM rings each LM on a connection of its own instead of LMs polling their action rows
    assert wait_until(lambda: b._manager.agent.bell is not None)
    assert not b._manager.agent.guests  # a doorbell is not a lent worker
    pipe = CpuPipeline(SMALL)
    for epoch in range(2):
        a.set_epoch(epoch)
        images, labels = collect(a)
        assert ordered(labels) == list(range(40))  # every sample once, in sampler order
        for x, y in zip(images, labels):
            for img, i in zip(x.numpy(), y.tolist()):  # a lent worker ran a's policy with a's seed
                assert np.array_equal(img, pipe(slow.data[i], i, seed=11, epoch=epoch)), i
    a.close()
    b.close()
    assert a.stats.workers_borrowed > 0 and a.stats.borrowed_tiny_batches > 0
    # (the lender counts a loan's tiny-batches when its worker is home: the last loan may not be yet)
    assert b.stats.workers_lent > 0 and 0 < b.stats.lent_tiny_batches <= a.stats.borrowed_tiny_batches
    assert a.stats.global_manager == b.stats.global_manager == "active"
    assert wait_until(lambda: not os.path.exists("/dev/shm" + gt.table_name(name)))  # the GM left


@pytest.mark.parametrize("cached", ["borrower", "lender"])
def test_a_lent_worker_renders_the_borrowers_samples_as_the_borrower_renders_them(cached):
    """One dataset, one policy, the decoded-image cache on one side only: a lent worker renders the
    borrower's samples as the borrower's own workers do -- from the cache's resolution when the borrower has
    a cache (the lender's worker has no store of it), uncached when only the lender has one."""
    from fusionflow import DecodedCache
    from fusionflow.ops.cached import CacheRendering

    name, ds = job(), Bytes(40, sleep=0.04)
    cache = DecodedCache("16MB", max_side=28, fill_share=None)  # below most images' sides
    b = make(ds, name, seed=3, cache=cache if cached == "lender" else None)
    collect(b)  # b's worker is idle from now on
    a = make(ds, name, seed=11, tiny_batch_size=1, cache=cache if cached == "borrower" else None)
    pipe = CpuPipeline(SMALL, cache=CacheRendering(28) if cached == "borrower" else None)
    images, labels = collect(a)
    assert ordered(labels) == list(range(40))
    for x, y in zip(images, labels):
        for img, i in zip(x.numpy(), y.tolist()):
            assert np.array_equal(img, pipe(ds.data[i], i, seed=11, epoch=0)), i
    a.close()
    b.close()
    assert a.stats.borrowed_tiny_batches > 0


_ROLE = ["borrower"]  # which loader's process a worker was forked in: its copy of this list says


def _stop_if_lent(worker_id):
    """a's worker_init_fn: run by a worker b lent to a (forked while this said "lender"), it stops itself there."""
    if _ROLE[0] == "lender":
        os.kill(os.getpid(), signal.SIGSTOP)


def test_a_worker_stopped_while_lent_is_ended_by_its_owner_which_trains_on(caplog, monkeypatch):
    """b lends its only worker to a, and the worker stops (SIGSTOP) while it sets up a's work: a drops the guest
    that never became ready, and b waited for its HOME for ever -- its next epoch hung (with timeout=0). Now b kills
    its lent worker once it has stayed stopped STOPPED_S (lowered from 10 s), a replacement starts, and b's next
    epoch completes."""
    from fusionflow.runtime import stuck

    name = job()
    a = make(Bytes(48, sleep=0.2), name, tiny_batch_size=1, batch_size=16, worker_init_fn=_stop_if_lent)
    monkeypatch.setattr(stuck, "STOPPED_S", 3.0)
    b = make(Bytes(24), name, timeout=120)
    try:
        _ROLE[0] = "lender"
        collect(b)  # b's worker is forked now, and idle from now on
        _ROLE[0] = "borrower"
        pool = b._manager.pool
        it = iter(a)
        got = ordered([next(it)[1]])
        assert wait_until(lambda: any(w is not None and w.lent_to is not None for w in pool.workers), 60)
        lent = next(w for w in pool.workers if w is not None and w.lent_to is not None)
        # stopped in a's worker_init_fn (or, on a busy machine, already killed for it: STOPPED_S is short)
        assert wait_until(lambda: is_stopped(lent.process.pid) or "while lent to loader" in caplog.text, 60)
        got += ordered(y for _, y in it)
        assert got == list(range(48))
        b.set_epoch(1)
        _, labels = collect(b)
        assert ordered(labels) == list(range(24))
        assert "while lent to loader" in caplog.text and b.stats.workers_stuck >= 1
    finally:
        _ROLE[0] = "borrower"
        a.close()
        b.close()


def test_a_lender_closing_mid_loan_costs_its_borrowers_sample_no_death(caplog):
    """b closes while its worker, lent to a, is inside one of a's samples (6 s each): b's close stops the worker
    mid-task after its grace (2 s). a re-runs that tiny-batch as no death: with max_retries=0 its epoch completes.
    It used to count a death against the innocent sample and fail the mini-batch with SampleKilledWorkersError."""
    name = job()
    a = make(Bytes(4, sleep=6.0), name, tiny_batch_size=1, batch_size=2, max_retries=0, timeout=120)
    b = make(Bytes(8), name)
    try:
        collect(b)
        it = iter(a)
        got = ordered([next(it)[1]])
        agent = a._manager.agent
        assert wait_until(lambda: any(g.outstanding for g in list(agent.guests)), 60)
        time.sleep(0.5)  # inside the sample
        b.close()
        got += ordered(y for _, y in it)
        assert sorted(got) == list(range(4))
        assert a.stats.workers_borrowed >= 1 and "left with 1 tiny-batches" in caplog.text  # lost mid-task
    finally:
        a.close()
        b.close()


def test_a_gm_stopped_holding_its_tables_lock_is_ended_by_the_last_loader_out(monkeypatch):
    """The GM takes its table's lock 4 times a second; stopped (SIGSTOP) while it held it, the job's last loader
    timed out leaving, kept its row, and the stopped GM and its table stayed for good. Now that loader ends the
    stopped GM (its death frees the lock: played here by the test, which holds the lock until the GM is gone),
    leaves, and the table goes."""
    import fcntl
    import threading

    import posix_ipc

    monkeypatch.setattr(gt, "LOCK_S", 5.0)
    name = job()
    tname = gt.table_name(name)
    a = make(Bytes(8), name)
    collect(a)
    gm = gm_pid_of(tname)
    seg = posix_ipc.SharedMemory(tname)
    try:
        fcntl.flock(seg.fd, fcntl.LOCK_EX)  # "the GM's" hold of the lock...
        os.kill(gm, signal.SIGSTOP)
        assert wait_until(lambda: is_stopped(gm))

        def release_once_the_gm_is_gone():
            wait_until(lambda: not pid_alive(gm), 60)
            fcntl.flock(seg.fd, fcntl.LOCK_UN)  # ...ends with it

        watcher = threading.Thread(target=release_once_the_gm_is_gone)
        watcher.start()
        a.close()
        watcher.join(60)
        assert not pid_alive(gm) and not os.path.exists("/dev/shm" + tname)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(gm, signal.SIGKILL)
        seg.close_fd()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(tname)


def test_a_dataset_that_does_not_pickle_is_never_borrowed_for(caplog):
    name = job()
    a, b = make(Unpicklable(24, sleep=0.02), name, persistent_workers=False), make(Bytes(24), name)
    collect(b)
    for _ in range(2):  # each epoch starts its workers anew, and makes the spec anew
        _, labels = collect(a)
        assert ordered(labels) == list(range(24))
    a.close()
    b.close()
    assert a.stats.workers_borrowed == 0 and b.stats.workers_lent == 0
    assert caplog.text.count("cannot be pickled") == 1  # said once, not at each epoch's start


def test_killed_gm_is_reported_once_and_loaders_keep_their_workers(caplog):
    name = job()
    a = make(Bytes(24, sleep=0.01), name)
    collect(a)
    pid = gm_pid_of(gt.table_name(name))
    os.kill(pid, signal.SIGKILL)
    for epoch in range(2):
        a.set_epoch(epoch + 1)
        _, labels = collect(a)
        assert ordered(labels) == list(range(24))
    a.close()
    assert a.stats.global_manager == "lost"
    assert caplog.text.count("global manager of this job") == 1
    assert not os.path.exists("/dev/shm" + gt.table_name(name))  # the last loader unlinked the table


def test_elastic_workers_added_and_removed_while_training():
    name = job()
    ds = Bytes(48, sleep=0.005)
    a = make(ds, name, batch_size=4)
    restarts = []
    it = iter(a)
    next(it)
    a._manager.on_capacity_change = restarts.append
    client = GlobalManagerClient(name)
    with pytest.raises(ValueError, match="workers=0 must be an integer from 1"):
        client.set_workers(0)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"to {cores} \\(the cores here\\)"):
        client.set_workers(cores + 1)
    client.set_workers(2)
    got = [i for _, y in it for i in y.tolist()]
    assert wait_until(lambda: sum(w is not None and not w.retiring for w in a._manager.pool.workers) == 2)
    assert restarts and restarts[-1] == 2
    client.set_workers(1)
    a.set_epoch(1)
    _, labels = collect(a)
    assert ordered(labels) == list(range(48))
    assert wait_until(lambda: sum(w is not None and not w.retiring for w in a._manager.pool.workers) == 1)
    assert restarts[-1] == 1
    assert len(got) == 44  # the first epoch lost nothing either (one batch was taken before)
    client.close()
    a.close()
    assert a.stats.worker_count_changes >= 2


def test_a_lower_target_retires_workers_of_a_loader_that_keeps_them_busy():
    """`gm workers 1` on a loader whose workers always hold queued tiny-batches (training faster than its data)
    retired none until the epoch's end: only idle workers were. The least busy one now drains and stops."""
    name = job()
    a = make(Bytes(60, sleep=0.04), name, batch_size=6, num_workers=2, tiny_batch_size=1)
    client = None
    try:
        seen, shrunk_at = [], None
        for k, (_, y) in enumerate(a):
            seen += y.tolist()
            if k == 1:  # (the loader has registered)
                client = GlobalManagerClient(name)
                client.set_workers(1)
            kept = sum(w is not None and not w.retiring for w in a._manager.pool.workers)
            if shrunk_at is None and k > 1 and kept == 1:
                shrunk_at = k
        assert sorted(seen) == list(range(60))  # nothing lost or repeated by the retirement
        assert shrunk_at is not None and shrunk_at < 9, shrunk_at  # within the epoch (of 10 mini-batches)
        assert wait_until(lambda: sum(w is not None and w.alive for w in a._manager.pool.workers) == 1)
    finally:
        if client is not None:
            client.close()
        a.close()


def test_of_two_targets_set_back_to_back_the_later_wins():
    """A job-wide target, then this loader's own, within one step of its lending agent: the agent applied the own
    first and the job-wide next, so the earlier won (3 of 3 in the sweep). Both now share one numbering."""
    from fusionflow.runtime.gm.manager import GlobalManagerClient

    name = job()
    a = make(Bytes(40, sleep=0.05), name, batch_size=4)
    it = iter(a)
    next(it)
    assert wait_until(lambda: os.path.exists("/dev/shm" + gt.table_name(name)), 30)
    client = GlobalManagerClient(name)
    assert wait_until(lambda: client.local_managers() != [], 30)
    client.set_workers(2)
    client.set_workers(1, lm=client.local_managers()[0]["lm"])
    for _ in it:
        pass
    assert wait_until(lambda: a._manager.pool.target_workers == 1, 10)
    time.sleep(0.5)  # (several of the agent's steps: the job-wide target does not come back)
    assert a._manager.pool.target_workers == 1
    client.close()
    a.close()


@pytest.mark.parametrize("gm_started", [True, False])
def test_a_loader_resumed_after_the_whole_job_stopped_does_not_write_its_gm_off(monkeypatch, gm_started):
    """The whole job stopped (SLURM's suspend) for over GM_SILENT_S, then resumed: a loader whose look came before the
    GM's first beat took the GM's silence -- the pause -- for its loss (or, with a GM still starting, the pause for
    GM_START_S past) and never lent again. After this process itself did not run, the GM's silence and start count
    from the resume."""
    from types import SimpleNamespace

    from fusionflow.runtime.gm.link import GMLink
    from fusionflow.runtime.gm.timing import GM_SILENT_S, GM_START_S

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    beat = [clock[0]]
    tables = SimpleNamespace(gm_pid=os.getpid() if gm_started else 0, gm_silent_s=lambda: clock[0] - beat[0])
    link = GMLink.__new__(GMLink)
    link.tables, link.gm_lost, link.joined_at = tables, False, clock[0]
    link._checked_at, link._resumed_at = clock[0], -math.inf
    link.disable_borrowing = lambda: None
    clock[0] += 0.5
    assert link.check_gm()
    clock[0] += max(GM_SILENT_S, GM_START_S) + 20  # everything stopped: the GM did not beat, this loader did not look
    for _ in range(8):  # its looks after the pause, 0.5 s apart, before the GM (resumed too, but slower) beats
        assert link.check_gm() and not link.gm_lost
        clock[0] += 0.5
    if not gm_started:
        tables.gm_pid = os.getpid()  # it claims the table
    beat[0] = clock[0]
    while clock[0] - beat[0] < GM_SILENT_S + 1:  # now the GM alone stays silent, this loader looking every 0.5 s
        clock[0] += 0.5
        link.check_gm()
    assert link.gm_lost


def test_a_worker_target_set_after_the_global_manager_died_is_still_applied():
    """The loader reads its target from its own row: `gm workers` works on after the job's GM was killed (it went
    unapplied, and the command said nothing)."""
    name = job()
    a = make(Bytes(24, sleep=0.01), name)
    collect(a)
    client = GlobalManagerClient(name)
    try:
        os.kill(gm_pid_of(gt.table_name(name)), signal.SIGKILL)
        a.set_epoch(1)
        collect(a)  # the loss is seen
        client.set_workers(2)
        a.set_epoch(2)
        _, labels = collect(a)  # (missing workers are started while training waits for a batch)
        assert ordered(labels) == list(range(24)) and a.stats.global_manager == "lost"
        assert wait_until(lambda: sum(w is not None and w.alive for w in a._manager.pool.workers) == 2, 60)
    finally:
        client.close()
        a.close()


def test_a_worker_target_outlives_the_gm_that_left_between_epochs():
    """Without persistent workers each epoch registers anew; a pause between epochs longer than the GM's linger
    (a validation pass) ended the GM and its table, and with it `gm workers`' target: the next epoch came back
    with num_workers. The loader now carries the target its last manager had."""
    name = job()
    a = make(Bytes(24, sleep=0.02), name, persistent_workers=False)
    try:
        it = iter(a)
        next(it)
        client = GlobalManagerClient(name)
        client.set_workers(2)
        client.close()
        assert wait_until(lambda: a._manager.pool.target_workers == 2)
        assert sorted(i for _, y in it for i in y.tolist()) == list(range(8, 24))
        assert wait_until(lambda: not os.path.exists("/dev/shm" + gt.table_name(name)), 60)  # the GM has left
        a.set_epoch(1)
        seen, targets, most = [], set(), 0
        for _, y in a:
            seen += y.tolist()
            targets.add(a._manager.pool.target_workers)
            most = max(most, sum(w is not None and w.alive for w in a._manager.pool.workers))
        assert sorted(seen) == list(range(24)) and targets == {2} and most == 2
    finally:
        a.close()


def test_a_client_follows_its_job_to_a_new_global_manager_and_says_when_none_runs():
    """A client whose GM ended does not write into the removed table: it raises while none runs, and takes the
    job's next GM once one does. An lm of the wrong type is named as given."""
    import fusionflow

    assert fusionflow.GlobalManagerClient is GlobalManagerClient
    name = job()
    a = make(Bytes(8), name)
    collect(a)
    client = GlobalManagerClient(name)
    with pytest.raises(ValueError, match=r"lm='0' is not an active local manager; active: \[0\]"):
        client.set_workers(1, lm="0")
    a.close()
    assert wait_until(lambda: client.t.removed, 60)  # the GM leaves LINGER_S after the job's last loader
    with pytest.raises(ValueError, match=f"the global manager of job {name!r} has ended"):
        client.set_workers(1)
    b = make(Bytes(8), name)
    collect(b)
    client.set_workers(1)
    assert [row["pid"] for row in client.local_managers()] == [os.getpid()] and not client.t.removed
    client.close()
    b.close()


BORROWER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_loader import SMALL, Bytes
    from fusionflow.loader import FusionFlowLoader
    ld = FusionFlowLoader(Bytes(60, sleep=0.05), batch_size=12, num_workers=1, policy=SMALL,
                          pin_workers=False, global_manager={name!r})
    for images, labels in ld:
        print("batch", flush=True)
""")


def test_borrower_killed_mid_loan_lender_gets_its_worker_back(tmp_path):
    name = job()
    b = make(Bytes(24), name)
    collect(b)  # b's worker is idle: the GM lends it to the borrower process
    script = BORROWER.format(tests=os.path.dirname(__file__), name=name)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "batch\n"
        lent = lambda: any(w is not None and w.lent_to is not None for w in b._manager.pool.workers)  # noqa: E731
        assert wait_until(lent, timeout=20), "the idle loader never lent its worker"
        child.kill()  # mid-loan
        child.wait()
    finally:
        child.kill()
    mgr = b._manager.pool
    assert wait_until(lambda: all(w.lent_to is None for w in mgr.workers if w is not None))  # home again
    b.set_epoch(1)
    _, labels = collect(b)
    assert ordered(labels) == list(range(24))
    b.close()
    # the borrower's ring (unlinked by its orphaned worker or by the GM) and the GM's table: no_leaks


def test_lending_with_a_new_local_manager_every_epoch():
    """Non-persistent loaders register a fresh LM (often in a reused row) every epoch: the GM's
    per-row accounting must start over, or a row's old guests would hide its new need."""
    name = job()
    slow, fast = Bytes(32, sleep=0.03), Bytes(40)
    a = make(slow, name, persistent_workers=False)
    b = make(fast, name, persistent_workers=False)
    borrowed = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        it_b = iter(b)
        first = next(it_b)[1].tolist()  # b's iterator stays open; its worker soon has nothing to do
        _, labels = collect(a)
        assert ordered(labels) == list(range(32))
        assert first + [i for _, y in it_b for i in y.tolist()] == list(range(40))
        borrowed.append(a.stats.borrowed_tiny_batches)
    a.close()
    b.close()
    assert borrowed[0] > 0 and borrowed[1] > borrowed[0] and borrowed[2] > borrowed[1], borrowed


class Versioned(Bytes):
    """Labels index + 1000 x `version`: a dataset whose samples change between epochs (each epoch's workers start
    anew with persistent_workers=False, so they see the change, as DataLoader's do)."""

    version = 0

    def __getitem__(self, i):
        data, label = super().__getitem__(i)
        return data, label + 1000 * self.version


def test_a_lent_worker_reads_the_borrowers_dataset_as_it_is_this_epoch():
    """The spec lent workers get (the pickled dataset) was made once per loader: with persistent_workers=False a
    borrower whose dataset changed between epochs had its later epochs' samples read by lent workers from epoch 0's
    copy (9 of 19 samples an epoch in the sweep's run). It is made at each runtime start now."""
    name = job()
    slow, fast = Versioned(32, sleep=0.03), Bytes(40)
    a = make(slow, name, persistent_workers=False)
    b = make(fast, name)  # the lender: its worker, and what it keeps of borrowers' specs, lives across a's epochs
    collect(b)
    borrowed = [0]
    for epoch in range(3):
        slow.version = epoch
        a.set_epoch(epoch)
        _, labels = collect(a)
        assert ordered(labels) == [i + 1000 * epoch for i in range(32)], epoch
        borrowed.append(a.stats.borrowed_tiny_batches)
    a.close()
    b.close()
    assert all(later > before for before, later in zip(borrowed, borrowed[1:])), borrowed  # lent workers read some


def test_a_worker_keeps_the_latest_borrowers_specs_only():
    """A lender's worker kept every borrower spec it was sent, for its life: a borrower making a new loader (or, now,
    a new spec) each epoch grew it by a dataset copy an epoch (407 -> 911 MiB over 5 epochs of 100 MB datasets)."""
    from fusionflow.runtime.worker import SpecCache

    kept = SpecCache(kept=2)
    for spec in "abc":
        kept.put(spec, spec.upper())
    assert kept.hashes() == ["b", "c"] and kept.get("a") is None
    assert kept.get("b") == "B"  # used: the latest now
    kept.put("d", "D")
    assert kept.hashes() == ["b", "d"]


def test_a_loader_that_leaves_before_its_gm_starts_does_not_hold_the_next_one_out(monkeypatch, tmp_path):
    """An epoch (no persistent workers) that ends before the GM it spawned has claimed the table: the table is
    not marked closing, so the next epoch's loader joins it at once (it waited out the GM's linger, or past its
    retries, losing lending for the run) and that GM serves it."""
    from fusionflow.runtime.gm import link

    gate, refused = tmp_path / "start", []
    code = (
        "import os, runpy, sys, time\n"
        f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
        "sys.argv[1:] = [sys.argv[-1]]\n"
        "runpy.run_module('fusionflow.runtime.gm.manager', run_name='__main__')\n"
    )
    monkeypatch.setattr(
        link, "spawn", lambda name: subprocess.Popen([sys.executable, "-c", code, name], start_new_session=True)
    )
    register = gt.Tables.register

    def counted(self, pid):
        got = register(self, pid)
        refused.extend([pid] if got is None else [])
        return got

    monkeypatch.setattr(gt.Tables, "register", counted)
    monkeypatch.setattr(link, "GM_START_S", 600.0)  # (b waits for its held GM as long as the test holds it)
    name = job()
    a = make(Bytes(8), name, persistent_workers=False)
    try:
        assert ordered(collect(a)[1]) == list(range(8))  # its LM has left; the GM waits at the gate
        t = gt.Tables.attach(gt.table_name(name))
        assert t is not None and t.gm_pid == 0 and int(t.header["state"][0]) != gt.CLOSING
        t.close()
        b = make(Bytes(8), name)
        it = iter(b)
        next(it)
        assert refused == [] and b._manager.agent.link.tables.name == gt.table_name(name)
        gate.touch()
        assert wait_until(lambda: b._manager.agent.link.tables.gm_pid != 0, timeout=60)  # the GM claimed it for b
        assert b.stats.global_manager == "active"
        list(it)
        b.close()
    finally:
        gate.touch()  # (the GM starts, and leaves after its linger)
        a.close()
    assert wait_until(lambda: not os.path.exists("/dev/shm" + gt.table_name(name)), timeout=30)  # the GM left


def test_the_gm_a_loader_spawned_is_reaped_when_it_exits_after_the_loader_closed():
    """The GM outlives its loaders by its linger: its Popen was dropped at close() while it ran (a ResourceWarning
    under python -X dev) and it stayed a zombie child of the training process."""
    name = job()
    a = make(Bytes(8), name)
    collect(a)
    pid = gm_pid_of(gt.table_name(name))
    a.close()
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60), "the GM is left a zombie"


def test_lender_shutting_down_mid_loan_loses_nothing_at_the_borrower():
    """The lender stops its lent worker (its own loader closes) while the worker serves the borrower:
    the borrower re-runs whatever that worker had queued, and does not count it as a death (the
    worker says LEAVING) -- with max_retries=0 a death would fail the epoch."""
    a, b, it, got = lending_pair(Bytes(48, sleep=0.05), max_retries=0)
    lent_worker(b)
    b.close()  # STOP to its worker while it serves a
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48))
    a.close()
    assert a.stats.workers_borrowed > 0


def test_lent_worker_killed_mid_task_loses_nothing_and_is_replaced_by_its_owner():
    a, b, it, got = lending_pair(Bytes(48, sleep=0.05))
    os.kill(lent_worker(b).process.pid, signal.SIGKILL)  # while it runs one of a's samples (or is about to)
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48))  # its task went back to a's queue; nothing twice, nothing lost
    serves_its_own_again(b)
    a.close()
    b.close()
    assert b.stats.worker_restarts == 1  # its owner replaced it


def test_a_worker_never_waits_on_a_socket_nobody_serves():
    from multiprocessing import AuthenticationError

    from fusionflow.runtime.gm.link import connect

    address = "ff-test-" + secrets.token_hex(6)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(4)  # accepts into its backlog, never answers
    t0 = time.monotonic()
    with pytest.raises((OSError, EOFError, AuthenticationError)):
        connect(address, b"x" * 32)
    assert time.monotonic() - t0 < 5
    listener.close()


def test_a_stale_table_of_an_earlier_job_is_replaced():
    name = job()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = gt.Tables.create(gt.table_name(name))
    stale.header["gm_pid"] = dead.pid  # its GM died and nobody unlinked the table
    old_secret = stale.secret
    stale.close()
    a = make(Bytes(16), name)
    collect(a)
    fresh = gt.Tables.attach(gt.table_name(name))
    assert fresh.secret != old_secret and wait_until(lambda: pid_alive(fresh.gm_pid))
    fresh.close()
    a.close()
    assert a.stats.global_manager == "active"


def test_the_cli_does_not_take_a_left_over_table_for_a_running_job():
    """`gm serve` killed: its table stays in /dev/shm with no GM and no loader. `gm status` listed it as a job and
    `gm workers 1 --job` said the target was set (rc 0), while the job's next loader replaced the table and ran with
    its own num_workers. Now the table is no job: status lists nothing, workers fails saying why."""
    from fusionflow.runtime.gm.manager import GlobalManagerClient

    name = job()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = gt.Tables.create(gt.table_name(name), name)
    stale.header["gm_pid"] = dead.pid
    try:
        assert name not in gt.jobs_on_this_node()
        with pytest.raises(ValueError, match="has ended and no loader of the job is registered"):
            GlobalManagerClient(name)
        cli = [sys.executable, "-m", "fusionflow", "gm", "workers", "1", "--job", name]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "has ended" in out.stderr and "set" not in out.stdout, out
    finally:
        stale.unlink()
        stale.close()


def test_a_job_sigkilled_as_a_whole_leaves_its_table_to_the_next_loader_on_the_node():
    """Every process of a job gone (OOM killer, scancel): its GM and loaders never unlinked the table, and nothing
    did; the next loader of any job on the node removes it. Tables of a live loader, of a stopped GM or just made
    (their GM starting) stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stopped = subprocess.Popen(["sleep", "120"])
    os.kill(stopped.pid, signal.SIGSTOP)
    import posix_ipc

    kept = ("live_loader", "stopped_gm", "just_made", "other_pid_namespace")
    names = {k: gt.table_name(job()) for k in ("killed", *kept)}
    tables = {k: gt.Tables.create(n) for k, n in names.items()}
    older = posix_ipc.SharedMemory(gt.table_name(job()), posix_ipc.O_CREX, mode=0o600, size=4096)  # another layout's
    try:
        for k, gm, lm in (
            ("killed", dead.pid, dead.pid),
            ("live_loader", dead.pid, os.getpid()),
            ("stopped_gm", stopped.pid, None),
            ("other_pid_namespace", dead.pid, dead.pid),  # its pids are another namespace's: not judged here
        ):
            tables[k].header["gm_pid"] = gm
            if lm is not None:
                tables[k].register(lm)
        tables["other_pid_namespace"].header["pid_ns"] = gt.pid_namespace() + 1
        assert wait_until(lambda: is_stopped(stopped.pid))
        a = make(Bytes(16), job())
        collect(a)
        a.close()
        assert not os.path.exists("/dev/shm" + names["killed"])
        assert all(os.path.exists("/dev/shm" + names[k]) for k in kept) and os.path.exists("/dev/shm" + older.name)
    finally:
        stopped.kill()
        stopped.wait()
        older.unlink()
        older.close_fd()
        for t in tables.values():
            t.unlink()
            t.close()


def test_a_gm_killed_under_a_running_job_is_started_again_by_the_next_loader_to_join():
    """A GM SIGKILLed while its job trains: loaders that saw it gone train on alone, and each epoch's new loader
    (persistent workers off) joined the dead GM's table and warned again, lending never coming back. The next
    loader to join starts another GM for the table."""
    name = job()
    a = make(Bytes(16), name)  # stays registered: the table is a live job's
    collect(a)
    first = gm_pid_of(gt.table_name(name))
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(first))
    b = make(Bytes(16), name, persistent_workers=False)
    try:
        assert sorted(ordered(collect(b)[1])) == list(range(16))
        t = gt.Tables.attach(gt.table_name(name))
        try:
            assert wait_until(lambda: t.gm_pid not in (0, first) and pid_alive(t.gm_pid), 60)
        finally:
            t.close()
        assert b.stats.global_manager == "active"
    finally:
        b.close()
        a.close()


def test_a_table_whose_gm_is_only_stopped_is_not_taken_for_stale():
    """A loader joining between epochs while its job's GM is stopped (a debugger, py-spy) must join that table: it
    used to take it for an earlier job's, unlink it and start a second GM, and the job's loaders were split over
    two tables that never lend to each other. Unless the stopped GM was closing its table (no loader left): every
    later loader of the job then retried joining ~5 s and ran without lending, at each start (until session 40).
    A table whose GM died is an earlier job's."""
    from fusionflow.runtime.gm.link import GMLink

    gm = subprocess.Popen(["sleep", "120"])
    tables = []
    try:
        os.kill(gm.pid, signal.SIGSTOP)
        assert wait_until(lambda: is_stopped(gm.pid))
        for closing, stale in ((False, False), (True, True), (False, True)):  # the last: its GM killed
            tables.append(t := gt.Tables.create(gt.table_name(job())))
            t.header["gm_pid"] = gm.pid
            if closing:
                t.header["state"] = gt.CLOSING
            if len(tables) == 3:
                gm.kill()
                gm.wait()
            assert not t.gm_alive() and not t.active_rows()  # not serving, nobody registered
            assert GMLink.unlink_if_stale(t) == stale and os.path.exists("/dev/shm" + t.name) != stale, (closing, stale)
    finally:
        gm.kill()
        gm.wait()
        for t in tables:
            t.unlink()


def test_a_table_unlinks_its_name_only_while_the_name_is_its_own():
    """A GM (or last loader) of a table another job's loader replaced under the same name must not remove the new
    table's name: the next loader of that job could not find it and would start a third."""
    name = gt.table_name(job())
    old = gt.Tables.create(name)
    newcomer = gt.Tables.attach(name)
    newcomer.unlink()  # judged stale by a newcomer, which then makes its own
    newcomer.close()
    new = gt.Tables.create(name)
    try:
        old.unlink()
        assert os.path.exists("/dev/shm" + name)
        old.close()
    finally:
        new.unlink()
        new.close()
    assert not os.path.exists("/dev/shm" + name)


def test_the_gms_doorbell_retries_back_off_and_skip_a_stopped_lm(tables, monkeypatch):
    """An LM whose socket does not accept (hung) costs the GM's loop a handshake's bound each try: tries follow
    from the end of the last one at delays doubling to BELL_RETRY_MAX_S (a retry due at once held the GM in
    handshakes, polling 4 times in 6 s). A stopped LM is not tried at all."""
    from fusionflow.runtime.gm import manager, timing

    tries = []

    def connect(address, secret):
        tries.append(address)
        raise TimeoutError("the handshake's bound")

    monkeypatch.setattr(manager, "connect", connect)
    _row(tables, 0)
    row = manager._P(*tables.progress[0].tolist())  # the GM's view of the row
    gm = GlobalManager(tables)
    delays = []
    for _ in range(7):
        gm._hang_bell(0, row)
        delays.append(gm.bell_retry[0][2])
        assert gm.bell_retry[0][1] >= time.monotonic() + delays[-1] - 1.0
    assert len(tries) == 7 and delays == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert timing.BELL_RETRY_S == 1.0 and timing.BELL_RETRY_MAX_S == 16.0
    stopped = subprocess.Popen(["sleep", "120"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        assert wait_until(lambda: is_stopped(stopped.pid))
        tables.progress[0]["pid"] = stopped.pid
        gm._hang_bell(0, row)
        assert len(tries) == 7 and 0 in gm.bell_retry  # not tried; tried again later
    finally:
        stopped.kill()
        stopped.wait()


def test_explicitly_started_gm_serves_loaders_and_answers_the_cli():
    name = job()
    gm = subprocess.Popen(
        [sys.executable, "-m", "fusionflow", "gm", "serve", "--job", name], stderr=subprocess.PIPE, text=True
    )
    try:
        assert wait_until(lambda: os.path.exists("/dev/shm" + gt.table_name(name)))
        assert gm_pid_of(gt.table_name(name)) == gm.pid
        a = make(Bytes(16), name)
        collect(a)
        cli = [sys.executable, "-m", "fusionflow", "gm"]
        out = subprocess.run(cli + ["status", "--job", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(f"lm=0 pid={os.getpid()}"), out
        # without --job: every job on the node, by name (under torchrun the default name holds a random run id)
        listed = subprocess.run(cli + ["status"], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and f"job {name!r}:\nlm=0 pid={os.getpid()}" in listed.stdout, listed
        for job_args in (["--job", name], ["--job", job()]):  # the count is judged first, whether the job runs or not
            bad = subprocess.run(cli + ["workers", "0", *job_args], capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and "count=0 must be 1 or more" in bad.stderr, bad
        ok = subprocess.run(cli + ["workers", "2", "--job", name], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and "CPU worker target 2 set for every local manager" in ok.stdout, ok  # not silence
        # the loader starts workers to the new target while it waits for a batch; with the next epoch's
        # first mini-batches already made (speculated) an epoch may pass before the order arrives
        assert wait_until(lambda: collect(a) and sum(w is not None for w in a._manager.pool.workers) == 2)
        a.close()
        assert gm.poll() is None  # an explicit GM stays up between jobs' loaders
        empty = subprocess.run(cli + ["status", "--job", name], capture_output=True, text=True, timeout=60)
        assert empty.returncode == 0 and "no local manager is registered" in empty.stdout, empty  # not silence
        gm.send_signal(signal.SIGTERM)
        assert gm.wait(timeout=10) == 0
    finally:
        gm.kill()
    assert not os.path.exists("/dev/shm" + gt.table_name(name))


def test_global_manager_argument_errors():
    with pytest.raises(ValueError, match="global_manager=5 must be"):
        FusionFlowLoader(Bytes(4), batch_size=2, num_workers=1, policy=SMALL, global_manager=5)
    with pytest.raises(ValueError, match="name the job"):
        FusionFlowLoader(Bytes(4), batch_size=2, num_workers=1, policy=SMALL, global_manager="")
    assert FusionFlowLoader(Bytes(4), batch_size=2, num_workers=1, policy=SMALL).job is None  # not under torchrun
    with pytest.raises(ValueError, match="no global manager runs for job"):
        GlobalManagerClient(job())


def tell_own(marker_dir, borrower) -> None:
    """The borrower's own workers' pids, for StopsInAGuest: written whole before the name appears (a worker reading
    a half-written list, empty, took itself for a guest and stopped: an own worker killed as stuck, CI on d4e5922)."""
    pids = " ".join(str(w.process.pid) for w in borrower._manager.pool.workers if w is not None)
    tmp = os.path.join(marker_dir, "own.tmp")
    with open(tmp, "w") as f:
        f.write(pids)
    os.replace(tmp, os.path.join(marker_dir, "own"))


class StopsInAGuest(Bytes):
    """A sample read by a worker that is not one of the borrower's own (listed in `own`, once known)
    stops that process (SIGSTOP), the first time: a lent worker stopped mid-task."""

    def __init__(self, n, marker_dir):
        super().__init__(n, sleep=0.05)
        self.own, self.stopped = os.path.join(marker_dir, "own"), os.path.join(marker_dir, "stopped")

    def __getitem__(self, i):
        if os.path.exists(self.own) and not os.path.exists(self.stopped):
            with open(self.own) as f:
                if str(os.getpid()) not in f.read().split():
                    open(self.stopped, "w").close()
                    os.kill(os.getpid(), signal.SIGSTOP)
        return super().__getitem__(i)


class StopsMidMessageInAGuest(StopsInAGuest):
    """As StopsInAGuest, but first the guest writes the start of a message to its borrower (a frame's head
    announcing 100 kB, and 10 bytes): a lent worker paused while it wrote a large DONE."""

    def __getitem__(self, i):
        if os.path.exists(self.own) and not os.path.exists(self.stopped):
            with open(self.own) as f:
                if str(os.getpid()) not in f.read().split():
                    open(self.stopped, "w").close()
                    frame = sys._getframe()
                    while frame.f_code.co_name != "run_task":  # its connection to the borrower: run_task's `out`
                        frame = frame.f_back
                    os.write(frame.f_locals["out"].fileno(), struct.pack("!i", 100_000) + b"0123456789")
                    os.kill(os.getpid(), signal.SIGSTOP)
        return Bytes.__getitem__(self, i)


def test_a_lent_worker_stopped_in_the_middle_of_a_message_is_killed_by_its_borrower(monkeypatch, tmp_path, caplog):
    """The borrower's manager thread reads its guests: one stopped mid-message would hold it (and the
    borrower's every worker) forever. Past authsock.REST_S (lowered from 5 s) the borrower kills it by its
    pid, re-runs its tiny-batch, and its owner replaces it; the stuck and straggler bounds are out of reach."""
    from fusionflow.runtime import authsock, liveness

    monkeypatch.setattr(authsock, "REST_S", 1.0)
    monkeypatch.setattr(liveness, "STUCK_FLOOR_S", 1e9)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1e9)
    a, b, it, got = lending_pair(StopsMidMessageInAGuest(48, str(tmp_path)), timeout=0)
    tell_own(tmp_path, a)
    lent_worker(b)
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48))
    assert (tmp_path / "stopped").exists() and a.stats.workers_stuck == 1
    assert "stopped in the middle of a message (nothing more within 1 s; 10 of 100000 bytes read)" in caplog.text
    serves_its_own_again(b)
    a.close()
    b.close()
    assert b.stats.worker_restarts == 1


@pytest.mark.parametrize("bound", ["STUCK_FLOOR_S", "STRAGGLER_FLOOR_S"])
def test_a_stopped_lent_worker_is_killed_by_its_borrower_and_replaced_by_its_owner(
    monkeypatch, tmp_path, caplog, bound
):
    """A worker lent to `a` stops (SIGSTOP) while it runs a's tiny-batch: past the stuck bound, or past
    the straggler bound once a's own worker is idle (each lowered here in turn), `a` kills it by its pid
    (a borrower cannot leave it alive: it may write into a reused slot), re-runs its tiny-batch, and its
    owner `b` replaces it."""
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, bound, 1.0)
    a, b, it, got = lending_pair(StopsInAGuest(48, str(tmp_path)), timeout=0)
    tell_own(tmp_path, a)
    lent_worker(b)
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48))  # nothing twice, nothing lost, and no timeout= needed
    assert (tmp_path / "stopped").exists() and a.stats.workers_stuck == 1
    assert ("while an own worker is idle" in caplog.text) == (bound == "STRAGGLER_FLOOR_S"), caplog.text
    serves_its_own_again(b)
    a.close()
    b.close()
    assert b.stats.worker_restarts == 1  # its owner replaced it


def test_a_lent_straggler_killed_by_its_borrower_costs_its_sample_no_death(monkeypatch, tmp_path, caplog):
    """A lent worker past the straggler bound while an own worker idles is killed for being slow, not for a
    sample that kills workers: its tiny-batch runs again without a death counted, so even max_retries=0
    delivers everything (a death used to fail the epoch with SampleKilledWorkersError)."""
    from fusionflow.runtime import liveness

    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1.0)
    a, b, it, got = lending_pair(StopsInAGuest(48, str(tmp_path)), timeout=0, max_retries=0)
    tell_own(tmp_path, a)
    lent_worker(b)
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48)) and a.stats.workers_stuck == 1
    assert "while an own worker is idle" in caplog.text
    a.close()
    b.close()


def test_a_lent_worker_whose_borrower_falls_silent_goes_home(monkeypatch):
    """The borrower stops giving its guest work and never sends RETURN (as a stopped or hung borrower
    would): past BORROWER_SILENT_S (lowered here, before the lender forks its worker) the worker
    leaves -- its owner gets it back -- and the borrower's epoch still completes on its own worker."""
    from fusionflow.runtime import worker as worker_module

    monkeypatch.setattr(worker_module, "BORROWER_SILENT_S", 1.0)
    a, b, it, got = lending_pair(Bytes(48, sleep=0.05))
    worker = lent_worker(b)
    pool, agent = a._manager.pool, a._manager.agent
    dispatch = pool.dispatch
    monkeypatch.setattr(pool, "dispatch", lambda guests, per_worker: dispatch((), per_worker))  # guests: nothing
    monkeypatch.setattr(agent, "return_finished_guests", lambda: None)  # ... and no RETURN either
    assert wait_until(lambda: worker.lent_to is None, timeout=60)  # home, though the borrower never said so
    got += [i for _, y in it for i in y.tolist()]
    assert got == list(range(48))
    serves_its_own_again(b)  # the worker serves its owner again
    a.close()
    b.close()
    assert b.stats.worker_restarts == 0


def test_a_stopped_gm_is_reported_once_and_loaders_keep_their_workers(monkeypatch, caplog):
    """A GM stopped (SIGSTOP) keeps its pid: its heartbeat says it is gone after GM_SILENT_S (lowered
    here); the loader logs it once and trains on alone, and its close unlinks the table and ends the
    stopped GM (nobody else will: a stopped process never goes by itself)."""
    from fusionflow.runtime.gm import link, tables

    monkeypatch.setattr(link, "GM_SILENT_S", 1.0)
    monkeypatch.setattr(tables, "GM_SILENT_S", 1.0)
    name = job()
    a = make(Bytes(24, sleep=0.01), name)
    collect(a)
    pid = gm_pid_of(gt.table_name(name))
    os.kill(pid, signal.SIGSTOP)
    try:
        for epoch in range(3):
            a.set_epoch(epoch + 1)
            _, labels = collect(a)
            assert ordered(labels) == list(range(24))
            time.sleep(0.6)
        a.close()
        assert a.stats.global_manager == "lost"
        assert caplog.text.count("global manager of this job") == 1 and "silent" in caplog.text
        assert not os.path.exists("/dev/shm" + gt.table_name(name))
        assert wait_until(lambda: not pid_alive(pid), timeout=30), "the stopped GM outlived its job"
        assert f"ended this job's global manager (pid {pid})" in caplog.text
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_gm_stopped_just_before_its_job_ends_goes_with_the_last_loader(caplog):
    """Found by experiments/chaos_jobs.py: a GM stopped less than GM_SILENT_S before the last loader
    closed outlived its job, stopped for good, its table left in /dev/shm. A stopped GM counts as gone
    at once for the last loader out, which unlinks the table and ends the GM."""
    name = job()
    a = make(Bytes(16), name)
    collect(a)
    pid = gm_pid_of(gt.table_name(name))
    os.kill(pid, signal.SIGSTOP)
    try:
        # the signal stops it when the kernel next schedules it: on a busy machine close() could run first
        assert wait_until(lambda: is_stopped(pid), timeout=30)
        a.close()
        assert wait_until(lambda: not pid_alive(pid), timeout=30), "the stopped GM outlived its job"
        assert not os.path.exists("/dev/shm" + gt.table_name(name))
        assert f"ended this job's global manager (pid {pid})" in caplog.text
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_flock_holder_is_found_and_not_waited_for():
    """The tables' (and the core claims') flock held by a stopped process: the waiter reads the holder from
    /proc/locks and gives up at once, not after the bound (a GM waited 10 s a poll, its heartbeat near silent)."""
    import contextlib
    import fcntl
    import tempfile

    from stopped_holder import held_by_a_stopped_process

    from fusionflow.runtime.userdir import flock_holder, flock_within

    with tempfile.NamedTemporaryFile() as f:

        @contextlib.contextmanager
        def take():
            fd = os.open(f.name, os.O_RDWR)  # its own open: a flock belongs to the open file
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield

        fd = os.open(f.name, os.O_RDWR)
        try:
            assert flock_holder(fd) is None
            with held_by_a_stopped_process(take) as holder:
                assert wait_until(lambda: is_stopped(holder)) and flock_holder(fd) == holder
                t0 = time.monotonic()
                with pytest.raises(TimeoutError, match=rf"the test's file is locked by stopped process {holder}"):
                    flock_within(fd, 60.0, "the test's file")
                assert time.monotonic() - t0 < 30  # (its bound was 60 s)
            flock_within(fd, 60.0, "the test's file")  # the holder gone: taken
        finally:
            os.close(fd)


def test_a_stopped_holder_of_the_table_lock_costs_lending_not_the_run(monkeypatch, caplog):
    """A process stopped (SIGSTOP) while it holds the GM table's lock: a loader joining the job gives up at once
    once it sees the holder stopped (at most LOCK_S, lowered here from 10 s), then trains without lending and says
    so; the loader already there trains on (nothing in its training takes the lock)."""
    import contextlib

    from stopped_holder import held_by_a_stopped_process

    monkeypatch.setattr(gt, "LOCK_S", 1.0)
    name = job()
    a = make(Bytes(16), name)
    collect(a)
    table = a._manager.agent.link.name

    @contextlib.contextmanager
    def take():  # its own open of the table: flock locks belong to the open file, not the process
        t = gt.Tables.attach(table)
        with t.locked():
            yield

    with held_by_a_stopped_process(take), caplog.at_level("WARNING", logger="fusionflow"):
        b = make(Bytes(16), name)
        try:
            t0 = time.monotonic()
            _, labels = collect(b)  # its workers start: it tries to join the job's table
            assert time.monotonic() - t0 < 30 and ordered(labels) == list(range(16))
            assert b._manager.agent is None and b.stats.global_manager == "lost"
            said = [r.getMessage() for r in caplog.records]
            assert any("locked by stopped process" in m and "without worker lending" in m for m in said), said
            a.set_epoch(1)
            _, labels = collect(a)
            assert ordered(labels) == list(range(16))
        finally:
            b.close()
    a.close()
