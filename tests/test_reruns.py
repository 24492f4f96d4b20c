"""A straggling tiny-batch is started again on an idle CPU worker; the first copy wins, the other's
worker is stopped; every sample arrives exactly once with the pixels of a run without stragglers --
with timeout=0 (DataLoader's default, wait forever): nothing but the loader itself ends the wait."""

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401

from fusionflow.loader import FusionFlowLoader
from fusionflow.runtime import liveness
from fusionflow.runtime.counters import RuntimeCounters
from fusionflow.runtime.reruns import Reruns
from fusionflow.scheduling.queue import Work

SLOW = 13  # the sample whose first worker straggles
N = 32


class Straggles(Bytes):
    """Sample SLOW's first read straggles: `first` says how (its worker stops itself, as a paused
    container would, or waits until the second copy has started); the second read (the copy started
    again elsewhere) does what `second` says. Markers in `marker_dir` order the two without a clock."""

    def __init__(self, marker_dir, first, second):
        super().__init__(N)
        self.dir, self.first, self.second = marker_dir, first, second

    def _mark(self, name):
        open(os.path.join(self.dir, name), "w").close()

    def _has(self, name):
        return os.path.exists(os.path.join(self.dir, name))

    def _act(self, how):
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif how == "wait for the second":
            deadline = time.monotonic() + 120
            while not self._has("second") and time.monotonic() < deadline:
                time.sleep(0.01)

    def __getitem__(self, i):
        if i == SLOW and not self._has("first"):
            self._mark("first")
            self._act(self.first)
        elif i == SLOW and not self._has("second"):
            self._mark("second")
            self._act(self.second)
        return super().__getitem__(i)


def _loader(dataset, **kw):
    return FusionFlowLoader(dataset, batch_size=4, num_workers=2, policy=SMALL, seed=3, timeout=0, **kw)


@pytest.fixture
def fast_reruns(monkeypatch):
    """A straggler bound of 0.3 s (5 s by default); the stuck bound stays 25 s, far beyond these tests."""
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 0.3)


def _check_exactly_once_with_the_reference_pixels(images, labels):
    reference_images, reference_labels = collect(_loader(Bytes(N)))
    assert sorted(torch.cat(labels).tolist()) == list(range(N))
    assert torch.equal(torch.cat(labels), torch.cat(reference_labels))  # sampler order unchanged
    assert torch.equal(torch.cat(images), torch.cat(reference_images))  # both copies wrote the same bytes


def test_a_stopped_worker_s_tiny_batch_runs_again_on_the_idle_one_and_wins(tmp_path, fast_reruns):
    trace = tmp_path / "trace.json"
    loader = _loader(Straggles(str(tmp_path), first="stop", second=None), trace=str(trace))
    images, labels = collect(loader)
    _check_exactly_once_with_the_reference_pixels(images, labels)
    stats = loader.stats
    assert stats.tiny_batches_rerun == 1 and stats.reruns_won == 1
    assert stats.workers_stuck == 0  # no 25 s stuck bound waited for: the stopped worker lost the race
    assert stats.worker_restarts >= 1  # the stopped worker was killed and replaced
    assert stats.summary()["tiny_batches_rerun"] == 1 and stats.summary()["reruns_won"] == 1
    assert sum(stats.tiny_batches_per_worker) * 4 >= N  # counted once per tiny-batch, the lost copy not
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "discarded"]
    assert len(spans) == 1 and SLOW in spans[0]["args"]["indices"]
    done = [
        i
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("cat") == "tiny-batch"
        for i in e["args"]["indices"]
    ]
    assert sorted(done) == list(range(N))  # the winning copy traced once, as an ordinary tiny-batch


def test_when_the_first_copy_wins_the_second_copy_s_worker_is_stopped(tmp_path, fast_reruns):
    loader = _loader(Straggles(str(tmp_path), first="wait for the second", second="stop"))
    images, labels = collect(loader)
    _check_exactly_once_with_the_reference_pixels(images, labels)
    assert loader.stats.tiny_batches_rerun == 1 and loader.stats.reruns_won == 0
    assert loader.stats.worker_restarts >= 1 and loader.stats.workers_stuck == 0


def test_without_stragglers_nothing_runs_twice(tmp_path):
    loader = _loader(Bytes(N))
    collect(loader)
    assert loader.stats.tiny_batches_rerun == 0 and loader.stats.worker_restarts == 0


# ---------------------------------------------------------------- the rule, pure


def test_the_straggler_bound_follows_the_tiny_batch_time_above_a_floor_and_waits_for_a_mean():
    assert liveness.straggler_bound(0.0) == float("inf")  # nothing finished yet: no mean to compare with
    assert liveness.straggler_bound(0.01) == liveness.STRAGGLER_FLOOR_S
    assert liveness.straggler_bound(10.0) == 10.0 * liveness.STRAGGLER_FACTOR
    assert liveness.straggler_bound(0.01) < liveness.stuck_bound(0.01)  # run again long before killed as stuck
    assert liveness.is_straggler(liveness.STRAGGLER_FLOOR_S + 0.1, 0.01)
    assert not liveness.is_straggler(liveness.STRAGGLER_FLOOR_S - 0.1, 0.01)


def _worker(wid, *works, since=0.0, ready=True):
    from collections import deque

    w = SimpleNamespace(worker_id=wid, process=object(), alive=True, ready=ready, lent_to=None, retiring=False)
    w.lost, w.head_since, w.outstanding = None, since, deque((k, work) for k, work in enumerate(works))
    w.idle = w.alive and w.ready and not w.outstanding
    return w


def _work(seq, gen=1):
    return Work(seq, gen, slot=0, epoch=0, positions=(0, 1), indices=(2 * seq, 2 * seq + 1))


def test_pick_pairs_each_straggler_with_an_idle_worker_once():
    counters = RuntimeCounters()
    reruns = Reruns(counters)
    slow, late, fresh = _work(1), _work(2), _work(3)
    a, b, c = _worker(0, slow, since=0.0), _worker(1, late, since=1.0), _worker(2, fresh, since=99.0)
    idle = _worker(3)
    picks = reruns.pick([a, None, b, c, idle], task_seconds=0.01, now=100.0, generation=1)
    assert picks == [(slow, a, idle)]  # one idle worker: the first straggler; c's tiny-batch is young
    reruns.started(slow, a, idle, 100.0)
    assert counters.tiny_batches_rerun == 1
    idle.outstanding.append((9, slow))
    idle.head_since, idle.idle = 100.0, False
    assert reruns.pick([a, idle, b, c, _worker(4)], 0.01, 101.0, 1)[0][0] is late  # slow's copy is young
    assert reruns.pick([a, b, _worker(4)], 0.01, 100.0, generation=2) == []  # an older iterator's work
    assert reruns.pick([a, b, _worker(4, ready=False)], 0.01, 100.0, 1) == []  # nobody idle


def test_a_copy_that_straggles_too_gets_another_up_to_max_copies():
    from fusionflow.runtime.reruns import MAX_COPIES

    reruns = Reruns(RuntimeCounters())
    work = _work(1)
    runners = [_worker(0, work, since=0.0)]
    for k in range(1, MAX_COPIES + 1):
        spare = _worker(10 + k)
        picks = reruns.pick(runners + [spare], task_seconds=0.01, now=100.0 * k, generation=1)
        if k == MAX_COPIES:
            assert picks == []  # enough copies: the stuck bound takes it from here
            break
        assert [p[0] for p in picks] == [work] and picks[0][2] is spare  # every copy straggles: one more
        reruns.started(work, runners[0], spare, 100.0 * k)
        spare.outstanding.append((k, work))
        spare.head_since, spare.idle = 100.0 * k - 50.0, False
        runners.append(spare)
    losers = reruns.settle(work, runners[-1])
    assert losers == runners[:-1]  # the last copy won: every other copy's worker is stopped


def test_settle_names_the_losers_and_counts_a_won_rerun():
    counters = RuntimeCounters()
    reruns = Reruns(counters)
    first, again = _work(1), _work(2)
    a, b, c, d = _worker(0, first), _worker(1), _worker(2, again), _worker(3)
    reruns.started(first, a, b, 0.0)
    reruns.started(again, c, d, 0.0)
    assert reruns.settle(first, a) == [b] and counters.reruns_won == 0  # the first copy won
    assert reruns.settle(again, d) == [c] and counters.reruns_won == 1  # the second copy won
    assert reruns.settle(first, b) == []  # settled once: a late copy names nobody
    once = _work(3)
    assert reruns.settle(once, a) == [] and not reruns.forget(once, a)


def test_a_copy_whose_worker_died_leaves_the_others_running():
    reruns = Reruns(RuntimeCounters())
    work = _work(1)
    a, b, c = _worker(0, work), _worker(1), _worker(2)
    reruns.started(work, a, b, 0.0)
    reruns.started(work, a, c, 0.0)
    assert reruns.forget(work, a)  # a died: not requeued, b's and c's copies go on
    assert reruns.forget(work, b)  # c's goes on, now as an ordinary tiny-batch
    assert reruns.settle(work, c) == []  # its DONE completes it; nobody to stop
    assert not reruns.forget(work, c)


def test_a_sample_that_never_returns_is_reported_also_when_its_copies_run_on_replacements(monkeypatch):
    """Straggler copies on, stuck bound 2 s: the copy of a read that never returns was started again on each killed
    worker's replacement, so every kill left a copy running, counted no death, and the loader killed a worker every
    bound for ever (a helper's repro: 46 kills in 600 s, never an error). Now each kill counts, the bound doubles
    for the copy left, no new copy starts, and the sample is named after max_retries + 1 kills."""
    from test_loader import SlowAt

    from fusionflow.errors import SampleKilledWorkersError

    monkeypatch.setattr(liveness, "STUCK_FLOOR_S", 2.0)
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 0.3)
    loader = _loader(SlowAt(24, 3600.0), tiny_batch_size=1, max_retries=1)
    with pytest.raises(SampleKilledWorkersError, match=r"sample 13 killed 2 CPU worker processes"):
        collect(loader)
    assert loader.stats.workers_stuck >= 2 and loader.stats.tiny_batches_rerun >= 1  # (a busy machine: more)
    loader.close()


FROZEN_JOB = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from test_loader import SMALL, Bytes
from fusionflow.loader import FusionFlowLoader
from fusionflow.runtime import liveness
liveness.STUCK_FLOOR_S = liveness.FIRST_TASK_S = 6.0  # (forked workers and the manager thread share these)
liveness.STUCK_FACTOR, liveness.STRAGGLER_FLOOR_S = 1.0, 1e9  # no copy started on the other worker: stuck kills only
class Spins(Bytes):  # CPU time, not a deadline: a sample under way at the stop is still under way at the resume
    def __getitem__(self, i):
        start = time.process_time()
        while time.process_time() - start < 0.6:
            pass
        return super().__getitem__(i)
loader = FusionFlowLoader(Spins(24), batch_size=4, num_workers=2, policy=SMALL, tiny_batch_size=1)
labels = []
for x, y in loader:
    labels += y.tolist()
    if len(labels) == 4:
        open(sys.argv[2], "w").close()  # busy workers now: the test stops the whole job here
stats = loader.stats
print(json.dumps({"labels": sorted(labels), "stuck": stats.workers_stuck, "restarts": stats.worker_restarts}))
loader.close()
"""


def test_a_job_stopped_as_a_whole_and_resumed_kills_no_worker(tmp_path):
    """SLURM's `scontrol suspend` (a paused VM, a laptop asleep) stops every process of the job at once. Resumed, the
    manager thread read each busy worker's time in its tiny-batch -- the pause included -- as no progress past the
    stuck bound and killed every one (each kill a death against its samples' max_retries). The time this process
    itself did not run is not counted against its workers now."""
    import subprocess
    import sys

    marker = tmp_path / "busy"
    here = os.path.dirname(os.path.abspath(__file__))
    job = subprocess.Popen(
        [sys.executable, "-c", FROZEN_JOB, here, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the job, its workers included
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), job.communicate(timeout=60)
        os.killpg(job.pid, signal.SIGSTOP)
        time.sleep(14.0)  # past the (lowered) 6 s stuck bound, and the 10 s at which a pause is told from a slow turn
        os.killpg(job.pid, signal.SIGCONT)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, err[-2000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["labels"] == list(range(24))
    assert got["stuck"] == 0 and got["restarts"] == 0, (got, err[-2000:])


class _PausingCond:
    """A board's lock whose waits play the whole job stopped once (its clock jumps 30 s), then end the thread."""

    def __init__(self, clock, kind):
        self.clock, self.kind, self.waits = clock, kind, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self, timeout):
        self.waits += 1
        self.clock[0] += 30.0 if self.waits == 1 else timeout
        if self.waits > 1:
            self.kind._stopped = True


def test_a_job_stopped_as_a_whole_keeps_its_ray_gateway(monkeypatch):
    """The Ray kind's feeding thread waits a second at a time: a wait that took 30 s means the whole job was
    stopped (its gateway with it). The gateway's silence and its tiny-batches' time away counted the pause, and it
    was killed at the resume (a new one took seconds). They skip it now; a gateway silent for 30 s while the thread
    ran is still killed (remote/pulse.py)."""
    from fusionflow.remote import kind as kind_module
    from fusionflow.remote.link import GatewayState

    clock = [1000.0]
    monkeypatch.setattr(kind_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    killed = []
    for paused in (True, False):
        kind = object.__new__(kind_module.RemoteWorkers)
        gw = object.__new__(GatewayState)
        gw.link = SimpleNamespace(kill=lambda paused=paused: killed.append(paused))
        gw.unresponsive, gw.heard_at, gw.sent_at = None, clock[0], {(1,): clock[0]}
        kind._gw, kind._stopped, kind.retired = gw, False, None
        kind.config, kind._round_trip, kind._take = SimpleNamespace(call_timeout=None), 0.0, lambda gw: []
        kind.board = SimpleNamespace(cond=_PausingCond(clock, kind))
        if not paused:  # the same 30 s with the thread running: the gateway is silent
            gw.heard_at -= 30.0
        kind._feed()
    assert killed == [False]


def test_a_job_stopped_as_a_whole_keeps_its_ray_actors(monkeypatch):
    """The gateway process is stopped with the job; its Ray actors (other nodes) are not. Its loop waits half a
    second at a time: a wait that took 30 s is the pause, and the calls away meanwhile skip it (each was taken for
    hung, its actor killed and replaced at the resume). A call 30 s away while the loop ran is still ended."""
    import collections

    from fusionflow.remote import gateway as gateway_module

    clock, lost = [1000.0], []
    monkeypatch.setattr(gateway_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(gateway_module, "parent_gone", lambda pid: False)
    for paused in (True, False):
        waits = []

        def wait(objects, timeout, paused=paused, waits=waits):
            waits.append(timeout)
            if len(waits) > 1:
                raise EOFError  # the loader closed its end: serve() ends
            clock[0] += 30.0 if paused else 0.0
            return []

        monkeypatch.setattr(gateway_module, "mp_wait", wait)
        g = object.__new__(gateway_module.Gateway)
        g.conn = g._wake_r = g.m = None
        g.parent_pid, g._next_maintain, g.retired, g.actors = 1, clock[0] + 1e9, None, []
        g.finished, g.fifo, g.call_mean = collections.deque(), collections.deque(), 0.0
        g.config = SimpleNamespace(call_timeout=None, in_flight=1, per_call=1)
        g.calls = {"call": (SimpleNamespace(name="actor", inflight=1), ["task"])}
        g.call_started = {"call": clock[0] - (0.0 if paused else 30.0)}
        g._lost, g._failed_call = (lambda *a, paused=paused: lost.append(paused)), (lambda: None)
        with pytest.raises(EOFError):
            g.serve()
    assert lost == [False]
