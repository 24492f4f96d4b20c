"""The Ray gateway (fusionflow/remote/gateway.py, link.py, kind.py): Ray's failures must not end
training. A training process (a child Python, so its exit status is the verdict) runs three epochs
with one local worker and one Ray actor on a local Ray instance FusionFlow started; mid-epoch the
node's dashboard agent (the raylet fate-shares with it, and Ray ends its drivers) or the raylet is
SIGKILLed. The training process must finish every epoch with every sample exactly once, never import
ray, exit 0, and leave no process of the gateways' sessions behind. Plus what the kind reports:
stage times and trace spans per actor. Skipped only when ray is not installed."""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from test_loader import SMALL, Bytes, collect, no_leaks  # noqa: F401  (autouse: no process or segment left)
from test_remote import PYTHONPATH, _loader, _ray, local_instance, no_ray_sessions_left  # noqa: F401

from fusionflow.runtime.procs import pid_alive

HERE = os.path.dirname(os.path.abspath(__file__))

TRAINING = r"""
import json, os, signal, sys, time
from test_loader import SMALL, Bytes
from fusionflow import FusionFlowLoader, RayWorkers
from fusionflow.runtime.procs import session_pids


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


victim = sys.argv[1]
loader = FusionFlowLoader(Bytes(48, sleep=0.02), batch_size=8, shuffle=True, num_workers=1, policy=SMALL,
                          tiny_batch_size=2, seed=1, persistent_workers=True, remote_workers=RayWorkers(1))
out = {"epochs": [], "remote": [], "victims": [], "ray_imported": []}
with loader:
    for epoch in range(3):
        loader.set_epoch(epoch)
        before = loader.stats.remote_tiny_batches
        labels = []
        for k, (_x, y) in enumerate(loader):
            labels += y.tolist()
            kind = loader._manager.board.kinds[0]
            out["ray_imported"].append("ray" in sys.modules)
            if epoch == 0 and k == 1:  # the node's process, once the gateway's instance runs it (a busy machine)
                deadline = time.time() + 120
                while not (victims := [p for s in kind.sessions for p in session_pids(s) if victim in cmdline(p)]):
                    if time.time() > deadline:
                        break
                    time.sleep(0.2)
                out["victims"] = [cmdline(p)[:40] for p in victims]
                for p in victims:
                    os.kill(p, signal.SIGKILL)
        out["epochs"].append(labels)
        out["remote"].append(loader.stats.remote_tiny_batches - before)
        if epoch == 1:  # a new gateway was tried at this epoch: let it come up before the last one
            deadline = time.time() + 90
            while kind.live < 1 and time.time() < deadline:
                time.sleep(0.1)
    out["gateways_lost"] = loader.stats.remote_gateways_lost
    sessions = list(kind.sessions)
deadline = time.time() + 15
while (left := [p for s in sessions for p in session_pids(s)]) and time.time() < deadline:
    time.sleep(0.2)
out["left"] = [cmdline(p)[:80] for p in left]
out["ray_imported"].append("ray" in sys.modules)
print("RESULT " + json.dumps(out), flush=True)
"""


def _train(tmp_path, victim: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, str(script), victim], env=env, cwd=HERE, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (
        f"training exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    )
    return json.loads(lines[0][len("RESULT ") :]), run.stderr


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["ray::DashboardAgent", "raylet --raylet_socket"])
def test_training_survives_the_node_dying_under_its_ray_driver(tmp_path, victim):
    _ray()
    out, stderr = _train(tmp_path, victim)
    assert len(out["victims"]) == 1, out["victims"]
    for labels in out["epochs"]:
        assert sorted(labels) == list(range(48))  # every sample exactly once, each epoch
    assert not any(out["ray_imported"]), "the training process imported ray"
    assert out["left"] == [], "Ray processes of the gateways outlived the loader"
    if victim == "ray::DashboardAgent":  # the raylet follows its agent, Ray ends the gateway
        assert out["gateways_lost"] == 1
        assert "the Ray gateway (pid" in stderr and "run on the local workers" in stderr
        assert out["remote"][2] > 0, "no new gateway served the last epoch"
    else:  # the actor may outlive its raylet for a while; either way nothing is lost
        assert sum(out["remote"]) > 0


@pytest.mark.ray
class TestWhatTheKindReports:
    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def local_ray(cls):
        yield from local_instance()

    @pytest.mark.filterwarnings("ignore:remote_workers without persistent_workers")
    def test_stage_times_and_trace_spans_per_actor(self, tmp_path):
        from fusionflow import RayWorkers

        path = tmp_path / "trace.json"
        # not persistent: with it, the next epoch's speculated tiny-batches may run remotely after the
        # block (counted in stats, traced by no block)
        kw = dict(stage_times=True, num_workers=1, persistent_workers=False)
        with _loader(Bytes(32), RayWorkers(2, take="front"), **kw) as loader:
            with loader.trace(str(path)):
                _x, labels = collect(loader)
                remote = loader.stats.remote_tiny_batches
            actors = {w for w in loader.stats.stage_ns if isinstance(w, str) and w.startswith("ray")}
            stage = loader.stats.stage_seconds(sorted(actors)[0]) if actors else {}
        assert sorted(torch.cat(labels).tolist()) == list(range(32))
        assert remote > 0 and actors and sum(stage.values()) > 0
        doc = json.loads(path.read_text())
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        ray_tids = {tid for tid, name in tracks.items() if "(Ray)" in name}
        spans = [e for e in events if e.get("tid") in ray_tids and e.get("ph") == "X"]
        assert ray_tids and len(spans) == remote

    def test_the_training_process_does_not_import_ray(self):
        # this test process imported ray itself (the fixture): a child training process must not
        code = (
            "import sys; from test_loader import SMALL, Bytes; from fusionflow import FusionFlowLoader, RayWorkers\n"
            "l = FusionFlowLoader(Bytes(16), batch_size=8, num_workers=1, policy=SMALL, tiny_batch_size=2,\n"
            "                     remote_workers=RayWorkers(1))\n"
            "n = sum(len(y) for _x, y in l); s = l.stats.remote_tiny_batches; l.close()\n"
            "print('OUT', n, s, 'ray' in sys.modules)\n"
        )
        env = {**os.environ, "PYTHONPATH": PYTHONPATH}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=HERE, capture_output=True, text=True, timeout=180
        )
        out = [line for line in run.stdout.splitlines() if line.startswith("OUT")]
        assert run.returncode == 0 and out, run.stderr[-3000:]
        assert out[0].split()[1] == "16" and out[0].split()[3] == "False"

    def test_failed_restarts_do_not_raise_and_retire_the_remote_workers(self, monkeypatch):
        from fusionflow import RayWorkers
        from fusionflow.remote import kind as remote_kind

        monkeypatch.setattr(remote_kind, "BACKOFF_S", 0.0)
        with _loader(Bytes(24, sleep=0.01), RayWorkers(1)) as loader:
            collect(loader)
            kind = loader._manager.board.kinds[0]
            kind._spec = b"not a spec"  # every later gateway fails at start-up
            os.kill(kind.sessions[0], 9)
            for _ in range(4):  # the gateway's death, then failed restarts, each counted once
                _x, labels = collect(loader)
                assert sorted(torch.cat(labels).tolist()) == list(range(24))
            deadline = time.time() + 30
            while kind.retired is None and time.time() < deadline:
                time.sleep(0.1)
            assert kind.retired is not None and "Ray gateways in a row failed" in kind.retired

    def test_a_dead_gateway_is_replaced_at_the_next_epoch_or_after_its_back_off(self, monkeypatch, caplog):
        """A gateway that dies mid-epoch: its work runs locally and no new gateway starts before the next epoch's
        mini-batches are queued or the back-off (a minute here) ends. One started at once (the feeding thread, woken
        by the requeue, saw a restart due before the death was accounted) while the warning said "at the next epoch";
        now the warning says when."""
        import signal

        from fusionflow import RayWorkers
        from fusionflow.remote import kind as remote_kind

        monkeypatch.setattr(remote_kind, "BACKOFF_S", 60.0)
        with _loader(Bytes(60, sleep=0.05), RayWorkers(1)) as loader:
            collect(loader)
            kind = loader._manager.board.kinds[0]
            with caplog.at_level("WARNING", logger="fusionflow.remote.kind"):
                it = iter(loader)
                labels = [next(it)[1]]
                killed_in = kind.board.queue.newest_epoch
                os.kill(kind.sessions[0], signal.SIGKILL)
                seen = []  # (gateways started, the newest epoch queued) after each batch
                for _x, y in it:
                    labels.append(y)
                    seen.append((len(kind.sessions), kind.board.queue.newest_epoch))
                # a new gateway only once the next epoch's mini-batches are queued (persistent workers run ahead)
                assert all(n == 1 or epoch > killed_in for n, epoch in seen), (killed_in, seen)
                said = "run on the local workers; a new gateway at the next epoch or in 60 s"
                deadline = time.time() + 60  # (said once the dead gateway's session is killed: seconds)
                while said not in caplog.text and time.time() < deadline:
                    time.sleep(0.1)
            assert sorted(torch.cat(labels).tolist()) == list(range(60))
            assert loader.stats.remote_gateways_lost == 1
        assert said in caplog.text

    def test_a_stopped_gateway_is_killed_past_the_call_deadline_and_its_work_runs_locally(self, caplog):
        """A gateway alive but silent (SIGSTOP here; in the field, stuck in a Ray call or alive with its
        raylet gone) holds its tiny-batches: past `call_timeout` it is killed, they run locally."""
        import signal

        from fusionflow import RayWorkers

        with _loader(Bytes(48, sleep=0.01), RayWorkers(1, call_timeout=2.0)) as loader:
            collect(loader)
            kind = loader._manager.board.kinds[0]
            assert kind.call_deadline() == 2.0 and loader.stats.remote_tiny_batches > 0
            os.kill(kind.sessions[0], signal.SIGSTOP)
            with caplog.at_level("WARNING", logger="fusionflow.remote.kind"):
                _x, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(48))  # every sample once, the epoch done
            assert loader.stats.remote_gateways_lost == 1
        assert "returned nothing for" in caplog.text and "call deadline 2 s" in caplog.text

    def test_an_idle_stopped_gateway_is_found_by_its_silence(self, monkeypatch, caplog):
        """A gateway holding nothing used to be noticed only when it was next given work; its pulse
        (a beat a second from a thread that never calls Ray) ends it while it is idle."""
        import signal

        from fusionflow import RayWorkers
        from fusionflow.remote import pulse

        monkeypatch.setattr(pulse, "SILENT_S", 3.0)
        with _loader(Bytes(24, sleep=0.01), RayWorkers(1)) as loader:
            collect(loader)
            kind = loader._manager.board.kinds[0]
            assert loader.stats.remote_tiny_batches > 0 and loader.stats.remote_gateways_lost == 0
            os.kill(kind.sessions[0], signal.SIGSTOP)
            with caplog.at_level("WARNING", logger="fusionflow.remote.kind"):
                deadline = time.monotonic() + 120  # 3 s of silence and a feeder turn; generous for a busy CI
                while loader.stats.remote_gateways_lost == 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
            assert loader.stats.remote_gateways_lost == 1  # found with no tiny-batch given to it
            _x, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(24))
        assert "said nothing for" in caplog.text

    def test_a_call_hung_on_one_actor_ends_that_actor_not_the_gateway(self, tmp_path, caplog):
        """A read that hangs on one Ray worker (a stuck network file system) ends that worker's call at
        half the call deadline: the worker is killed and replaced, its tiny-batches run locally, and the
        gateway lives on."""
        from fusionflow import RayWorkers

        flag = tmp_path / "hang"
        with _loader(HangsOnRay(48, str(flag), os.getpid()), RayWorkers(1, call_timeout=8.0)) as loader:
            collect(loader)
            assert loader.stats.remote_tiny_batches > 0
            flag.touch()
            with caplog.at_level("WARNING", logger="fusionflow.remote.kind"):
                _x, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(48))
            assert loader.stats.remote_workers_lost >= 1 and loader.stats.remote_gateways_lost == 0
        assert "returned nothing for" in caplog.text and "bound 4 s" in caplog.text


class HangsOnRay(Bytes):
    """Bytes whose reads hang for an hour in a Ray worker (not in the loader's own) once `flag` exists."""

    def __init__(self, n, flag, owner):
        super().__init__(n, sleep=0.01)
        self.flag, self.owner = flag, owner

    def __getitem__(self, i):
        if self.owner not in (os.getpid(), os.getppid()) and os.path.exists(self.flag):
            time.sleep(3600)
        return super().__getitem__(i)


def test_the_pulse_beats_and_ends_the_gateway_when_its_raylet_is_gone():
    """No Ray needed: a stand-in "raylet" (a process whose command line is a raylet's) is found by its
    socket name, the pulse beats, and when the stand-in dies the pulse ends the process (here a stub)."""
    import threading

    from fusionflow.remote.pulse import Pulse, find_raylet, silence

    sock = f"/tmp/ff-test-raylet-{os.getpid()}"
    raylet = subprocess.Popen(
        ["raylet", "-c", "import time; time.sleep(300)", f"--raylet_socket_name={sock}"], executable=sys.executable
    )
    beats, exited = [], threading.Event()
    try:
        deadline = time.monotonic() + 60
        while (pid := find_raylet(sock)) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # its command line is there once it has exec'd
        assert pid == raylet.pid and find_raylet(sock + "-other") is None and find_raylet(None) is None
        pulse = Pulse(beats.append, pid, on_raylet_gone=exited.set)
        pulse.start()
        deadline = time.monotonic() + 60
        while len(beats) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beats[:2] == [("alive",), ("alive",)] and not exited.is_set()
        raylet.kill()  # a zombie until reaped: gone all the same
        assert exited.wait(60)
    finally:
        raylet.kill()
        raylet.wait()
    assert silence(100.0, 105.0) is None and "said nothing for 11 s" in silence(100.0, 111.0)


def test_the_call_deadline_is_measured_or_given_and_checked(monkeypatch):
    _ray()
    from types import SimpleNamespace

    from fusionflow import RayWorkers
    from fusionflow.remote.kind import RemoteWorkers
    from fusionflow.remote.pulse import CALL_FACTOR, CALL_FLOOR_S

    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match="call_timeout"):
            RayWorkers(1, call_timeout=bad)
    kind = RemoteWorkers.__new__(RemoteWorkers)  # only what call_deadline reads
    kind.config, kind._round_trip = SimpleNamespace(call_timeout=None), 0.0
    assert kind.call_deadline() == CALL_FLOOR_S  # nothing measured yet
    kind._round_trip = 10.0
    assert kind.call_deadline() == CALL_FACTOR * 10.0  # slow calls: a multiple of the measured round trip
    kind.config = RayWorkers(1, call_timeout=7.5)
    assert kind.call_deadline() == 7.5


def test_a_gateway_stopped_before_it_reads_its_start_up_spec_cannot_hold_the_loader(tmp_path):
    """The spec (the dataset travels in it) is larger than the socket's buffer: a gateway stopped before
    reading it once blocked the starting thread for good, outside every deadline, and outlived the
    loader (found by experiments/chaos.py). Now the send has the start-up deadline."""
    import signal

    from fusionflow.errors import RemoteWorkerError
    from fusionflow.remote.link import GatewayLink
    from fusionflow.runtime.procs import session_pids

    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        link = GatewayLink(b"x" * (32 << 20), fd)
        os.kill(link.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RemoteWorkerError, match="did not take its start-up spec within 2 s"):
            link.wait_started(2.0)
        assert time.monotonic() - t0 < 60  # bounded (2 s here), not forever
        link.discard()
        assert link.proc.returncode is not None and session_pids(link.pid) == []
    finally:
        os.close(fd)


def test_a_gateway_that_takes_nothing_from_its_socket_is_killed_not_waited_for(monkeypatch):
    """The loader's sends to its gateway were unbounded: one that stopped reading with its socket full (hundreds of
    tasks queued on a large cluster) held the feeding thread -- which also runs the call-deadline and silence checks
    -- and close() for ever. Now a send waits SEND_BOUND_S (lowered here), then the gateway is killed (a frame cut
    short cannot be finished) and the send reports failure; its reader then requeues what it held."""
    import socket

    from fusionflow.remote import link as remote_link

    monkeypatch.setattr(remote_link, "SEND_BOUND_S", 1.0)
    ours, theirs = socket.socketpair()
    gateway = subprocess.Popen(["sleep", "120"], start_new_session=True)  # stands in for a gateway that reads nothing
    try:
        gw = remote_link.GatewayLink.__new__(remote_link.GatewayLink)
        gw.conn, gw.proc, gw.pid, gw.session_dir = remote_link.Connection(ours.detach()), gateway, gateway.pid, None
        remote_link.set_send_timeout(gw.conn, remote_link.SEND_BOUND_S)
        big = b"x" * (64 << 20)  # more than any socket buffer holds
        assert gw.send(big) is False
        assert gateway.poll() is not None  # killed and reaped
    finally:
        gateway.kill()
        gateway.wait()
        theirs.close()


@pytest.mark.ray
@pytest.mark.parametrize("ctrl_c", [False, True])
def test_close_removes_the_session_folder_of_the_ray_instance_it_started(monkeypatch, ctrl_c):
    """A loader whose gateway started a private Ray instance (none runs in this process) leaves no session folder
    (its logs and sockets, tens of MB) under /tmp/ray after close(); every run left one until session 39. A Ctrl-C
    while close() waits for the gateway to stop leaves none either (it skipped the removal until session 43)."""
    from fusionflow import RayWorkers

    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the instance's actors import the tests' dataset

    loader = _loader(Bytes(16), RayWorkers(1))
    collect(loader)
    link = loader._manager.board.kinds[0]._gw.link
    session = link.session_dir
    assert session and os.path.isdir(session)
    if ctrl_c:
        wait = link.proc.wait

        def interrupted(timeout=None):
            if timeout is not None:  # the stop's grace wait: the user presses Ctrl-C there
                raise KeyboardInterrupt
            return wait()

        monkeypatch.setattr(link.proc, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            loader.close()
    loader.close()
    assert not os.path.exists(session)
    latest = os.path.join(os.path.dirname(session), "session_latest")
    assert not (os.path.islink(latest) and os.path.basename(os.readlink(latest)) == os.path.basename(session))


STARTING = r"""
import os, time
from test_loader import SMALL, Bytes
from fusionflow import FusionFlowLoader, RayWorkers

class SlowOnActors(Bytes):  # an actor's first read (its start-up probe) takes 4 s: the gateway is still starting
    def __getitem__(self, i):
        if os.getpid() != MAIN:
            time.sleep(4)
        return super().__getitem__(i)

MAIN = os.getpid()
loader = FusionFlowLoader(SlowOnActors(16), batch_size=8, num_workers=1, policy=SMALL, remote_workers=RayWorkers(1))
next(iter(loader))
"""


@pytest.mark.ray
def test_a_training_process_ended_while_its_ray_workers_start_leaves_no_session_folder(tmp_path, monkeypatch):
    """SIGTERM while the gateway waits for its actors: its report of the start-up met a closed socket (two
    tracebacks on the user's terminal) and the private instance's folder was left for good."""
    import signal

    _ray()
    script = tmp_path / "starting.py"
    script.write_text(STARTING)
    short = tempfile.mkdtemp(prefix="ff-ray-")  # (Ray's socket paths must stay under 108 bytes: not tmp_path)
    folders = os.path.join(short, "ray", "session_2*")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RAY_TMPDIR": short}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=HERE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not glob.glob(folders) and time.time() < deadline:
            time.sleep(0.05)
        assert glob.glob(folders), "the gateway's instance never started"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        deadline = time.time() + 120
        while glob.glob(folders) and time.time() < deadline:
            time.sleep(0.2)
        assert not glob.glob(folders), "the instance's session folder was left"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(short, ignore_errors=True)


def _sessions() -> set:
    return {p for p in glob.glob("/tmp/ray/session_*") if not p.endswith("session_latest")}


def test_a_start_up_that_fails_removes_the_folder_of_the_instance_it_started(monkeypatch):
    """The actors cannot read the dataset (its files are on this node only): the start-up fails clearly, and the
    private instance's session folder went with it (it was left: the gateway said where it was only once started)."""
    from test_remote import LocalFiles

    from fusionflow import RayWorkers, RemoteWorkerError

    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the instance's actors import the tests' dataset
    before = _sessions()
    loader = _loader(LocalFiles(), RayWorkers(1))
    with pytest.raises(RemoteWorkerError, match="cannot read the dataset there"):
        next(iter(loader))
    loader.close()
    assert _sessions() - before == set()


def test_a_gateway_killed_before_it_said_where_its_instance_is_still_has_the_folder_removed(tmp_path, monkeypatch):
    """close() while a new gateway is still in ray.init: Ray names the folder after the process that started the
    instance (session_<date>_<pid>), so the loader finds it by the gateway's pid."""
    from fusionflow.remote.link import session_dir_of

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    mine = tmp_path / "ray" / "session_2026-11-29_23-00-00_000001_4242"
    (tmp_path / "ray" / "session_2026-11-29_23-00-00_000002_14242").mkdir(parents=True)  # another pid's
    mine.mkdir()
    assert session_dir_of(4242) == str(mine) and session_dir_of(99) is None


ORPHAN = r"""
import os, sys, time
from test_loader import SMALL, Bytes
from fusionflow import FusionFlowLoader, RayWorkers
loader = FusionFlowLoader(Bytes(400, sleep=0.02), batch_size=8, num_workers=1, policy=SMALL, tiny_batch_size=2,
                          persistent_workers=True, remote_workers=RayWorkers(1))
for k, _ in enumerate(loader):
    kind = loader._manager.board.kinds[0]
    if loader.stats.remote_tiny_batches and kind._gw is not None and kind._gw.link.session_dir:
        print("SESSION", kind._gw.link.session_dir, kind._gw.link.pid, flush=True)
        time.sleep(600)
"""


def test_a_training_process_ended_by_sigterm_leaves_no_session_folder(tmp_path):
    """SIGTERM (a job scheduler's stop) ends the training process without its close(): its gateway, orphaned,
    stopped Ray but left the instance's folder, which only the loader removed."""
    import signal

    _ray()
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=HERE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # once a remote tiny-batch came back
        assert line.startswith("SESSION "), line
        _, session, gateway = line.split()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        deadline = time.time() + 120
        while (os.path.exists(session) or pid_alive(int(gateway))) and time.time() < deadline:
            time.sleep(0.2)
        assert not pid_alive(int(gateway)) and not os.path.exists(session)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.ray
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_gateway_killed_or_stopped_while_it_starts_costs_seconds_not_the_first_epoch(monkeypatch, how):
    """A gateway killed during the loader's first start failed epoch 0 (the first start raised every error); one
    stopped held iter() for startup_timeout + 60 s, then failed it too (a sweep, session 50). A fault of the process
    is not the configuration's: the local workers run the epoch, and a new gateway comes at the next epoch."""
    import signal

    from fusionflow import RayWorkers
    from fusionflow.remote.link import GatewayLink

    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    hit, wait_started = [], GatewayLink.wait_started

    def faulted_first(link, timeout):
        if not hit:
            hit.append(link.pid)
            os.kill(link.pid, getattr(signal, how))
        return wait_started(link, timeout)

    monkeypatch.setattr(GatewayLink, "wait_started", faulted_first)
    with _loader(Bytes(24, sleep=0.02), RayWorkers(1)) as loader:
        t0 = time.monotonic()
        _x, labels = collect(loader)
        assert hit and sorted(torch.cat(labels).tolist()) == list(range(24))
        assert time.monotonic() - t0 < 100  # a stopped gateway: given up after STOPPED_S, not 120 s and an error
        epoch, deadline = 0, time.monotonic() + 180  # a new gateway from the next epoch on (it starts Ray: seconds)
        while not loader.stats.remote_tiny_batches and time.monotonic() < deadline:
            epoch += 1
            loader.set_epoch(epoch)
            _x, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(24))
        assert loader.stats.remote_tiny_batches > 0 and len(loader._manager.board.kinds[0].sessions) >= 2


def test_closing_beside_a_stopped_gateway_kills_it_without_waiting_out_the_grace():
    """A gateway stopped (SIGSTOP) cannot shut Ray down: close() waited STOP_GRACE_S (10 s) for it regardless (a
    sweep, session 50); now it is killed at once, its session with it."""
    import signal
    import socket

    from fusionflow.remote import link as remote_link

    ours, theirs = socket.socketpair()
    gateway = subprocess.Popen(["sleep", "120"], start_new_session=True)  # stands in for a gateway
    try:
        os.kill(gateway.pid, signal.SIGSTOP)
        gw = remote_link.GatewayLink.__new__(remote_link.GatewayLink)
        gw.conn, gw.proc, gw.pid, gw.session_dir = remote_link.Connection(ours.detach()), gateway, gateway.pid, None
        deadline = time.monotonic() + 30
        while not remote_link.is_stopped(gateway.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        gw.stop()
        assert gateway.poll() is not None and time.monotonic() - t0 < remote_link.STOP_GRACE_S / 2
    finally:
        gateway.kill()
        gateway.wait()
        theirs.close()
