"""SharedLoader / SharedLoaderClient (fusionflow/shared/): a producer process and client processes
(tests/shared_jobs.py), as co-located training jobs run them. The reference for the batches is the
producer's loader iterated in this process: every client of an epoch must get exactly its samples,
in its order, with its pixels. After each test: no process of the test's producer left, nothing
new in /dev/shm, no rendezvous record left."""

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import uuid

import pytest
import torch
from shared_jobs import Indexed, digests, make_loader
from test_global_manager import wait_until
from test_loader import SMALL, Bytes, ff_segments

from fusionflow import FusionFlowLoader, SharedLoader, SharedLoaderClient, SharedLoaderError
from fusionflow.shared import rendezvous

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "shared_jobs.py")


def processes_named(token: str) -> list[int]:
    """Pids whose command line holds `token` (a producer and its forked workers carry its name)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


class Jobs:
    """The processes of one test, all carrying its producer's unique name."""

    def __init__(self, tmp_path):
        self.tmp, self.name, self.procs = tmp_path, f"t-{uuid.uuid4().hex[:10]}", []
        self.shm_before = set(ff_segments())

    def start(self, role: str, *args, tag: str = "") -> subprocess.Popen:
        log = open(self.tmp / f"{role}{tag}.log", "w")
        p = subprocess.Popen(
            [sys.executable, JOBS, role, "--name", self.name, *map(str, args)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def serve(self, *args) -> subprocess.Popen:
        """`python -m fusionflow serve` as a user runs it."""
        log = open(self.tmp / "serve.log", "w")
        cmd = [sys.executable, "-m", "fusionflow", "serve", "--name", self.name, *map(str, args)]
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(HERE))
        self.procs.append(p)
        return p

    def client(self, tag: str, *args) -> subprocess.Popen:
        return self.start("client", "--out", self.tmp / f"{tag}.json", *args, tag=tag)

    def result(self, tag: str) -> dict:
        with open(self.tmp / f"{tag}.json") as f:
            return json.load(f)

    def log(self, role_tag: str) -> str:
        return (self.tmp / f"{role_tag}.log").read_text()

    def wait(self, p: subprocess.Popen, timeout: float = 120) -> int:
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump()
            raise

    def dump(self) -> None:
        for path in sorted(self.tmp.glob("*.log")):
            print(f"---- {path.name}\n{path.read_text()}")

    def file(self, name: str) -> str:
        return str(self.tmp / name)

    def until_exists(self, name: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while not os.path.exists(self.file(name)):
            assert time.time() < deadline, f"{name} never appeared"
            assert all(p.poll() is None for p in self.procs), self.dump() or "a process ended early"
            time.sleep(0.02)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        deadline = time.time() + 5
        while time.time() < deadline and (processes_named(self.name) or set(ff_segments()) - self.shm_before):
            time.sleep(0.05)
        assert not processes_named(self.name), f"processes left: {processes_named(self.name)}"
        assert not set(ff_segments()) - self.shm_before, "shared-memory segments left in /dev/shm"
        assert rendezvous.read(self.name) is None


@pytest.fixture
def jobs(tmp_path):
    j = Jobs(tmp_path)
    yield j
    j.close()


def reference(batch_size: int, n: int, epochs: int, drop_last: bool = False) -> list[dict]:
    """The producer's loader's epochs, iterated here: labels and pixel digests, sample by sample."""
    out = []
    with make_loader(batch_size, n, drop_last) as loader:
        for _ in range(epochs):
            got = {"labels": [], "digests": [], "sizes": []}
            for images, labels in loader:
                got["labels"] += labels.tolist()
                got["digests"] += digests(images)
                got["sizes"].append(len(labels))
            out.append(got)
    return out


def samples(epoch: dict) -> tuple:
    return epoch["labels"], epoch["digests"]


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_an_impossible_client_batch_size_is_refused_before_waiting_for_a_producer(bad):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"batch_size=.* must be an integer >= 1"):
        SharedLoaderClient(f"nobody-{uuid.uuid4().hex[:8]}", batch_size=bad, timeout=600)
    assert time.monotonic() - t0 < 300  # not after the 600 s the client would wait for a producer


def test_three_clients_get_identical_epochs_each_sample_once(jobs):
    producer = jobs.start("producer", "--batch-size", 8, "--n", 40, "--epochs", 2, "--min-clients", 3)
    clients = [jobs.client(f"c{i}", "--epochs", 2) for i in range(3)]
    for p in [*clients, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    ref = reference(8, 40, 2)
    results = [jobs.result(f"c{i}") for i in range(3)]
    for got in results:
        assert got["len"] == 5
        assert [e["epoch"] for e in got["epochs"]] == [0, 1]
        for e, r in zip(got["epochs"], ref):
            assert sorted(e["labels"]) == list(range(40))  # each sample exactly once
            assert samples(e) == samples(r)  # the producer's order and pixels
            assert e["sizes"] == r["sizes"]
    assert ref[0]["labels"] != ref[1]["labels"]  # shuffled per epoch: the comparison can tell epochs apart


def test_a_producer_that_exits_without_close_removes_its_record(jobs):
    producer = jobs.start("producer", "--batch-size", 8, "--n", 16, "--epochs", 1, "--no-close")
    client = jobs.client("c", "--epochs", 1)
    for p in (client, producer):
        assert jobs.wait(p) == 0, jobs.dump()
    assert sorted(jobs.result("c")["epochs"][0]["labels"]) == list(range(16))
    assert not os.path.exists(rendezvous.path_of(jobs.name))  # removed at exit, not left for a reader


@pytest.mark.parametrize("drop_last", [False, True])
def test_client_batch_sizes_reslice_the_producers_batches(jobs, drop_last):
    n = 100  # 3 full batches of 32 and 4 left over
    flags = ["--drop-last"] if drop_last else []
    producer = jobs.start("producer", "--batch-size", 32, "--n", n, "--epochs", 1, "--min-clients", 5, *flags)
    sizes = {"b16": 16, "b32": 32, "b64": 64, "b96": 96, "none": None}  # b96: 4 producer batches, 3 a batch
    clients = [jobs.client(tag, "--epochs", 1, *(["--batch-size", b] if b else [])) for tag, b in sizes.items()]
    for p in [*clients, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    (ref,) = reference(32, n, 1, drop_last)
    expect_sizes = {
        False: {
            "b16": [16] * 6 + [4],
            "b32": [32, 32, 32, 4],
            "b64": [64, 36],
            "b96": [96, 4],
            "none": [32, 32, 32, 4],
        },
        True: {"b16": [16] * 6, "b32": [32] * 3, "b64": [64], "b96": [96], "none": [32] * 3},
    }[drop_last]
    kept = sum(expect_sizes["b64"])  # drop_last: the last group of fewer than 2 producer batches goes
    for tag in sizes:
        got = jobs.result(tag)
        (epoch,) = got["epochs"]
        assert epoch["sizes"] == expect_sizes[tag], tag
        assert got["len"] == len(expect_sizes[tag]), tag
        m = len(epoch["labels"])
        assert (epoch["labels"], epoch["digests"]) == (ref["labels"][:m], ref["digests"][:m]), tag
        assert m == (kept if tag == "b64" else sum(ref["sizes"])), tag  # (b96 keeps all 3 with drop_last)


def test_a_producer_batch_size_above_its_samples_is_the_one_clients_are_checked_against(jobs):
    """A producer's ring holds at most its sampler's samples (40 rows at batch_size=64), but it announces the
    batch_size given: a client's 32 divides 64 and is taken (a review's find: 40 was announced and 32 refused)."""
    producer = jobs.start("producer", "--batch-size", 64, "--n", 40, "--epochs", 1, "--min-clients", 2)
    clients = [jobs.client("b32", "--epochs", 1, "--batch-size", 32), jobs.client("none", "--epochs", 1)]
    for p in [*clients, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    assert jobs.result("b32")["epochs"][0]["sizes"] == [32, 8]
    assert jobs.result("none")["epochs"][0]["sizes"] == [40]


def test_a_sigkilled_client_is_detached_and_the_others_finish(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 40, "--epochs", 2, "--min-clients", 3, "--buffer", 2)
    good = [jobs.client(f"c{i}", "--epochs", 2) for i in range(2)]
    victim = jobs.client("victim", "--epochs", 2, "--pause-after", 1, "--paused", jobs.file("paused"))
    jobs.until_exists("paused")  # it holds slots now, and with buffer=2 the producer waits for it
    t0 = time.time()
    victim.send_signal(signal.SIGKILL)
    for p in [*good, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    assert time.time() - t0 < 60
    ref = reference(4, 40, 2)
    for i in range(2):
        assert [samples(e) for e in jobs.result(f"c{i}")["epochs"]] == [samples(r) for r in ref]


def test_a_stopped_client_is_let_go_the_others_finish_and_resumed_it_raises(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 40, "--epochs", 2, "--min-clients", 3, "--buffer", 2)
    gate = ("--pause-after", 1, "--paused", jobs.file("paused_c1"), "--resume-after", jobs.file("go_c1"))
    good = [jobs.client("c0", "--epochs", 2), jobs.client("c1", "--epochs", 2, *gate)]
    victim = jobs.client(
        "victim", "--epochs", 2, "--pause-after", 1, "--paused", jobs.file("paused"), "--resume-after", jobs.file("go")
    )
    jobs.until_exists("paused")  # it holds slots now, and with buffer=2 the producer waits for it
    jobs.until_exists("paused_c1")  # c1 too, running: so the producer is still serving when the victim resumes
    victim.send_signal(signal.SIGSTOP)
    t0 = time.time()
    try:
        while "has been stopped for" not in jobs.log("producer"):
            assert time.time() - t0 < 60 and producer.poll() is None, jobs.dump()
            time.sleep(0.05)
        assert time.time() - t0 >= 9.5  # STOPPED_S = 10 s: not before
        assert f"client pid {victim.pid}" in jobs.log("producer")
    finally:
        open(jobs.file("go"), "w").close()
        victim.send_signal(signal.SIGCONT)
    assert jobs.wait(victim) != 0  # its next batch's slot was given back while it was stopped: not returned
    said = jobs.log("clientvictim")
    assert "SharedLoaderError" in said and "detached this client while it held a batch" in said, said
    assert not os.path.exists(jobs.file("victim.json"))
    open(jobs.file("go_c1"), "w").close()
    for p in [*good, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    ref = reference(4, 40, 2)
    for i in range(2):
        assert [samples(e) for e in jobs.result(f"c{i}")["epochs"]] == [samples(r) for r in ref]


def test_a_client_stopped_in_the_middle_of_a_message_is_let_go_and_the_hub_serves_on(jobs, monkeypatch, caplog):
    """The hub's one thread reads every client: a client stopped after the first bytes of a message used
    to hold it, and so every client, forever. Past authsock.REST_S (lowered from 5 s) it is let go."""
    from fusionflow.runtime import authsock

    monkeypatch.setattr(authsock, "REST_S", 1.0)
    with SharedLoader(make_loader(4, 8, False), name=jobs.name) as shared:
        stalled = SharedLoaderClient(jobs.name, timeout=60)
        assert wait_until(lambda: shared.clients == 1, 60)
        os.write(stalled._conn.fileno(), struct.pack("!i", 1000) + b"12345")  # then nothing, as if stopped
        assert wait_until(lambda: shared.clients == 0, 60)
        assert "stopped in the middle of a message (nothing more within 1 s; 5 of 1000 bytes read)" in caplog.text
        with SharedLoaderClient(jobs.name, timeout=60):  # the hub's thread is free: it admits the next one
            assert wait_until(lambda: shared.clients == 1, 60)
        stalled.close()


def test_a_dead_client_is_detached_within_a_second(jobs):
    with SharedLoader(make_loader(4, 8, False), name=jobs.name) as shared:
        victim = jobs.client("victim", "--pause-after", 1, "--paused", jobs.file("paused"))
        deadline = time.time() + 60
        while shared.clients == 0:
            assert time.time() < deadline and victim.poll() is None, jobs.dump()
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while shared.clients:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 1.0


CLIENT_WITH_A_CHILD = """
import os, signal, subprocess, sys, time
from fusionflow import SharedLoaderClient
client = SharedLoaderClient(sys.argv[1], timeout=60)
if sys.argv[2] == "fork":  # a validation DataLoader's worker, forked after the client: then the client closes
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    client.close()
    time.sleep(60)
else:  # a child given the connection some other way (no fork hook closes it), then this process is killed
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(client._conn.fileno(),))
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["fork", "killed"])
def test_a_client_gone_is_detached_though_a_child_of_it_holds_its_connection(jobs, how):
    """A client that closed (or died) while a process it forked lives: that child's copy of the connection kept it
    open, so the producer -- and every other client -- waited for the closed client for as long as the child lived
    (a helper's repro: 71 s for 3 epochs instead of 9). A forked child now closes its copy, close() shuts the
    connection down, and the hub detaches a client whose process is gone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
    with SharedLoader(make_loader(4, 8, False), name=jobs.name) as shared:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT_WITH_A_CHILD, jobs.name, how], stdout=subprocess.PIPE, text=True, env=env
        )
        child = None
        try:
            child = int(proc.stdout.readline())
            assert wait_until(lambda: shared.clients == 0, 30), "the client gone was not detached"
        finally:
            for pid in (proc.pid, child):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            proc.wait()


def test_a_producer_block_that_raises_tells_its_clients_it_failed_not_finished(jobs):
    """A `with SharedLoader` block that raises (or is interrupted) after serving: its clients were told the producer
    "finished after serving N epochs", which a training loop may take for a normal end. They are told it failed."""
    with pytest.raises(RuntimeError, match="the script's own error"):
        with SharedLoader(make_loader(4, 8, False), name=jobs.name) as shared:
            client = SharedLoaderClient(jobs.name, timeout=60)
            assert wait_until(lambda: shared.clients == 1, 60)
            raise RuntimeError("the script's own error")
    with pytest.raises(SharedLoaderError, match=r"failed: RuntimeError: the script's own error"):
        next(iter(client))
    client.close()


def test_an_epoch_every_client_left_is_not_counted(jobs):
    """serve(epochs=1): the only client leaves after one batch of sixteen (more than the ring holds), so the epoch
    ends early. It counted as served (the clients' "finished after serving N epochs" said so); it is not counted."""
    import threading

    with SharedLoader(make_loader(4, 64, False), name=jobs.name, buffer=2) as shared:
        first = SharedLoaderClient(jobs.name, timeout=60)
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=1), daemon=True)
        serving.start()
        next(iter(first))
        first.close()  # the epoch has no client left
        serving.join(60)
        assert not serving.is_alive() and shared.epochs_served == 0


def test_a_sampler_s_epoch_follows_the_epochs_served(jobs):
    """serve(epochs=N) runs the epochs itself, so nobody could call set_epoch between them: a DistributedSampler
    shuffled every served epoch as its epoch 0 (a sweep's find). Each epoch is now told to the sampler."""
    import threading

    from torch.utils.data import DistributedSampler

    def sampler():
        return DistributedSampler(Indexed(24), num_replicas=1, rank=0, shuffle=True, seed=0)

    loader = FusionFlowLoader(Indexed(24), batch_size=8, sampler=sampler(), num_workers=1, policy=SMALL)
    with SharedLoader(loader, name=jobs.name, buffer=2) as shared:
        client = SharedLoaderClient(jobs.name, timeout=60)
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=3), daemon=True)
        serving.start()
        got = [[i for _, y in client for i in y.tolist()] for _ in range(3)]
        client.close()
        serving.join(60)
    want = []
    for epoch in range(3):
        ref = sampler()
        ref.set_epoch(epoch)
        want.append(list(ref))
    assert got == want and len({tuple(order) for order in got}) == 3


def test_an_epoch_its_only_client_peeked_at_is_served_again(jobs):
    """A script that peeks one batch (next(iter(client)), for the shapes) and then trains serve(epochs=2)'s two
    epochs got one full epoch and an error: the peeked epoch, left by its only client, used up one of the two. An
    epoch left by every client who stays attached is served again; one left by clients all gone ends serve()."""
    import threading

    with SharedLoader(make_loader(8, 40, False), name=jobs.name, buffer=2) as shared:
        client = SharedLoaderClient(jobs.name, timeout=60)
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=2), daemon=True)
        serving.start()
        next(iter(client))
        full = [sorted(i for _, y in client for i in y.tolist()) for _ in range(2)]
        client.close()
        serving.join(60)
        assert not serving.is_alive() and full == [list(range(40))] * 2 and shared.epochs_served == 2


def test_removing_a_record_another_client_removed_leaves_no_lock_file(jobs):
    """Two clients of a producer that died each remove its record; the second made a new lock file, found no
    record and left the lock file behind (a sweep's find)."""
    rendezvous.remove(jobs.name, os.getpid())  # no record: another client removed it first
    assert not [f for f in os.listdir(rendezvous.directory()) if jobs.name in f]


def test_a_producer_and_a_client_meet_whatever_their_xdg_runtime_dir(jobs, tmp_path, monkeypatch):
    """A producer started from a login shell ($XDG_RUNTIME_DIR set) and a client from a batch job or `docker exec`
    (unset): the record was written in one directory and looked for in another ("no SharedLoader named ... is
    serving"). Both now use the one directory of runtime/userdir.py."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with SharedLoader(make_loader(4, 8, False), name=jobs.name) as shared:
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])
        code = f"from fusionflow import SharedLoaderClient; SharedLoaderClient({jobs.name!r}, timeout=30).close()"
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert shared.clients == 0
    assert not os.listdir(tmp_path)


class SoftLabels(Indexed):
    """Soft labels: each target a tensor (its index, then 1.0)."""

    def __getitem__(self, i):
        return super().__getitem__(i)[0], torch.tensor([float(i), 1.0])


CLIENT_OF_TENSORS = """
import sys
from fusionflow import SharedLoaderClient
with SharedLoaderClient(sys.argv[1], timeout=float(sys.argv[2])) as client:
    print(sorted(int(v) for x, y in client for v in y[:, 0].tolist()), flush=True)
"""


@pytest.mark.parametrize("timeout", ["60", "inf"])
def test_tensor_targets_reach_a_client_in_an_unrelated_process(jobs, timeout):
    """The hub pickled with multiprocessing's reducers: a tensor target went as a descriptor of its storage, which
    only a process of the producer's family may fetch -- every client's first batch raised AuthenticationError.
    (And timeout=inf was accepted, then the first batch raised OverflowError in the message read's poll.)"""
    import threading

    loader = FusionFlowLoader(SoftLabels(16), batch_size=8, num_workers=1, policy=SMALL, seed=7)
    with SharedLoader(loader, name=jobs.name) as shared:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
        client = subprocess.Popen(  # a new program, as another job is: another multiprocessing authkey
            [sys.executable, "-c", CLIENT_OF_TENSORS, jobs.name, timeout], env=env, stdout=subprocess.PIPE, text=True
        )
        jobs.procs.append(client)
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=1), daemon=True)
        serving.start()
        out, _ = client.communicate(timeout=120)
        serving.join(60)
    assert client.returncode == 0 and out.strip() == str(list(range(16)))


class WideTargets(Indexed):
    """Targets of 40 KB each (a dense soft label): a batch's message fills much of a socket's buffer."""

    def __getitem__(self, i):
        target = torch.zeros(10_000)
        target[0] = i
        return super().__getitem__(i)[0], target


CLIENT_THAT_PAUSES = """
import os, sys, time
from fusionflow import SharedLoaderClient
name, mine, other = sys.argv[1:4]
got, saw_other = [], None
with SharedLoaderClient(name, timeout=120) as client:
    for x, y in client:
        got += [int(v) for v in y[:, 0].tolist()]
        if len(got) == len(y) and other != "-":  # a validation pass after its first step: it reads nothing meanwhile
            since = time.monotonic()  # past the hub's 5 s send bound twice, and until the other client is done
            while time.monotonic() - since < 12 or not (saw_other := os.path.exists(other)):
                if time.monotonic() - since > 90:
                    break
                time.sleep(0.1)
open(mine, "w").close()
print(sorted(got), saw_other, flush=True)
"""


def test_a_client_that_pauses_with_large_targets_queued_is_not_let_go_nor_holds_the_others(jobs):
    """The producer sent each batch's message from its main thread under the hub's lock, each write bounded by 5 s: a
    client pausing (a validation pass) while batches with large targets filled its socket was detached although
    alive, and until then every other client waited too (no batch published, no ping answered). Messages now queue
    per client and the hub's thread writes them as each socket takes them."""
    import threading

    n, done = 24, [str(jobs.tmp / "slow.done"), str(jobs.tmp / "fast.done")]
    loader = FusionFlowLoader(WideTargets(n), batch_size=4, num_workers=1, policy=SMALL, seed=7)
    with SharedLoader(loader, name=jobs.name, buffer=6) as shared:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
        clients = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT_THAT_PAUSES, jobs.name, mine, other],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for mine, other in [(done[0], done[1]), (done[1], "-")]
        ]
        jobs.procs.extend(clients)
        assert wait_until(lambda: shared.clients == 2, 60)
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=1), daemon=True)
        serving.start()
        outs = [c.communicate(timeout=240)[0] for c in clients]
        serving.join(60)
    assert [c.returncode for c in clients] == [0, 0], outs
    everything = str(list(range(n)))
    assert [o.strip() for o in outs] == [f"{everything} True", f"{everything} None"]


@pytest.mark.parametrize("clients", [0, 1])
def test_close_from_another_thread_ends_serve_which_returns(jobs, clients, caplog):
    """close() from another thread (a timer, a signal handler) while serve() ran closed the hub under it: serve()
    raised AttributeError ('NoneType' object has no attribute 'cond'). serve() now ends at its next step and returns;
    a client in the middle of an epoch is told the producer finished."""
    import threading

    caplog.set_level("WARNING", logger="fusionflow.shared")
    shared = SharedLoader(make_loader(4, 64, False), name=jobs.name)  # 16 batches, 4 slots: the epoch cannot end
    raised = []

    def serve():
        try:
            shared.serve(epochs=1000)
        except BaseException as exc:
            raised.append(exc)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    if clients:
        client = SharedLoaderClient(jobs.name, timeout=60)
        batches = iter(client)
        next(batches)
    else:
        with caplog.at_level("WARNING", logger="fusionflow.shared"):
            assert wait_until(lambda: "waits for 1 client" in caplog.text, 60)
    shared.close()
    serving.join(60)
    assert not serving.is_alive() and raised == []
    if clients:
        with pytest.raises(SharedLoaderError, match="finished after serving 0 epochs"):
            for _ in range(100):
                next(batches)
        client.close()


def test_close_from_a_signal_handler_ends_serve_which_closes_as_it_ends(jobs, caplog):
    """A signal handler runs on serve()'s own thread: close() there waited for serve() to end -- which cannot go on
    until the handler returns -- for 60 s, then closed the hub and the loader under it."""
    import signal

    caplog.set_level("WARNING", logger="fusionflow.shared")
    shared = SharedLoader(make_loader(4, 16, False), name=jobs.name)
    old = signal.signal(signal.SIGALRM, lambda *_: shared.close())
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # while serve() waits for a client
        started = time.monotonic()
        shared.serve(epochs=1)  # returns: no client came, the handler closed it
        assert time.monotonic() - started < 30
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert shared.clients == 0 and "waits for 1 client" in caplog.text
    with pytest.raises(SharedLoaderError, match="is closed"):
        shared.serve(epochs=1)


def test_a_client_timeout_under_a_second_is_not_taken_for_a_silent_producer(jobs):
    """The client pinged only after waiting min(timeout, 1 s): with timeout <= 1 s the ping went at the deadline and
    a producer merely slower than that (its pong on the way) was reported as saying nothing, "not even to a ping"."""
    import threading

    loader = FusionFlowLoader(Bytes(8, sleep=0.4), batch_size=8, num_workers=1, policy=SMALL, seed=7)
    with SharedLoader(loader, name=jobs.name) as shared:
        client = SharedLoaderClient(jobs.name, timeout=0.8)  # a batch takes ~3 s: pongs keep it waiting
        serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=1), daemon=True)
        serving.start()
        assert sorted(int(v) for _, y in client for v in y.tolist()) == list(range(8))
        client.close()
        serving.join(60)


def test_a_shared_loader_dropped_without_close_is_collected_and_frees_its_name(jobs, caplog):
    """A notebook cell run again: `shared = SharedLoader(...)` a second time drops the first without close(). Its
    hub's thread held it (a bound method), so it was never collected: its workers ran on and its name stayed taken
    ("already serving on this node (pid <this process>)") with no handle left to close it. Now it is collected and
    closed: its client told, its workers ended, its name free."""
    import gc
    import multiprocessing as mp
    import weakref

    before = set(mp.active_children())
    shared = SharedLoader(make_loader(4, 8, False), name=jobs.name)
    client = SharedLoaderClient(jobs.name, timeout=60)
    deadline = time.monotonic() + 60
    while shared.clients != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared.clients == 1
    gone = weakref.ref(shared)
    with caplog.at_level("WARNING", logger="fusionflow.shared"):
        del shared
        gc.collect()
    assert gone() is None and "was dropped without close()" in caplog.text
    assert wait_until(lambda: not set(mp.active_children()) - before, 30), "its workers outlived it"
    with pytest.raises(SharedLoaderError, match="dropped without close"):
        next(iter(client))
    client.close()
    with SharedLoader(make_loader(4, 8, False), name=jobs.name) as again:  # the name is free
        assert again.clients == 0
        with pytest.raises(ValueError, match="already serving in this process: close"):  # a cell run again
            SharedLoader(make_loader(4, 8, False), name=jobs.name)


def test_a_late_client_starts_at_the_next_epoch_and_says_so(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 24, "--epochs", 3, "--min-clients", 1, "--buffer", 2)
    early = jobs.client(
        "early", "--epochs", 3, "--pause-after", 2, "--paused", jobs.file("paused"), "--resume-after", jobs.file("late")
    )
    late = jobs.client("late", "--epochs", 2, "--start-after", jobs.file("paused"), "--attached", jobs.file("late"))
    for p in [early, late, producer]:
        assert jobs.wait(p) == 0, jobs.dump()
    ref = reference(4, 24, 3)
    assert [e["epoch"] for e in jobs.result("early")["epochs"]] == [0, 1, 2]
    assert [e["epoch"] for e in jobs.result("late")["epochs"]] == [1, 2]
    assert [samples(e) for e in jobs.result("late")["epochs"]] == [samples(r) for r in ref[1:]]
    said = jobs.log("clientlate")
    assert said.count("this client starts at its next epoch") == 1, said


def test_a_sigkilled_producer_makes_clients_raise_within_their_timeout(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 40, "--epochs", 2)
    script = (
        "import sys, time\n"
        "from fusionflow import SharedLoaderClient, SharedLoaderError\n"
        f"c = SharedLoaderClient({jobs.name!r}, timeout=10)\n"
        "it = iter(c); next(it)\n"
        f"open({jobs.file('paused')!r}, 'w').close()\n"
        f"while not __import__('os').path.exists({jobs.file('killed')!r}): time.sleep(0.01)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    for _ in range(100): next(it)\n"
        "except SharedLoaderError as e:\n"
        "    print('raised after', time.monotonic() - t0, repr(e)); sys.exit(7)\n"
    )
    log = open(jobs.tmp / "killed_client.log", "w")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    jobs.procs.append(client)
    jobs.until_exists("paused")
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    open(jobs.file("killed"), "w").close()
    assert jobs.wait(client, 30) == 7, jobs.dump()
    out = jobs.log("killed_client")
    seconds = float(out.split("raised after ")[1].split()[0])
    assert seconds < 10, out
    assert jobs.name in out and f"pid {producer.pid}" in out and "is gone" in out, out
    assert not os.path.exists(rendezvous.path_of(jobs.name))  # the client that saw it end removed its record


def test_a_stopped_producer_makes_clients_raise_after_their_timeout(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 40, "--epochs", 1)
    try:
        with SharedLoaderClient(jobs.name, timeout=60) as c:
            it = iter(c)
            next(it)
            c.timeout = 2.0
            producer.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(SharedLoaderError, match="said nothing for 2 s"):
                for _ in it:
                    pass
            assert time.monotonic() - t0 < 6
    finally:
        producer.send_signal(signal.SIGCONT)


def test_no_producer_of_that_name_raises_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(SharedLoaderError, match="no SharedLoader named 'nobody-here' is serving"):
        SharedLoaderClient("nobody-here", timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_bad_arguments_are_refused_clearly(jobs):
    with pytest.raises(ValueError, match="name="):
        SharedLoaderClient("bad name!", timeout=1)
    with pytest.raises(ValueError, match="timeout="):
        SharedLoaderClient("x", timeout=0)
    with pytest.raises(ValueError, match="pin_memory="):
        SharedLoaderClient("x", pin_memory="yes", timeout=1)
    with pytest.raises(ValueError, match="SharedLoaderClient delivers to 'cpu' or 'cuda"):
        SharedLoaderClient("x", device="meta", timeout=1)
    if not torch.cuda.is_available():  # refused before it looks for the producer
        with pytest.raises(ValueError, match="CUDA is not available here"):
            SharedLoaderClient("x", device="cuda", timeout=1)
    from fusionflow import FusionFlowLoader

    with pytest.raises(ValueError, match="num_workers >= 1"):
        SharedLoader(FusionFlowLoader(make_loader(4, 8, False).dataset, batch_size=4, policy="eval"), name="x")
    with pytest.raises(ValueError, match="buffer=0"):
        SharedLoader(make_loader(4, 8, False), name="x", buffer=0)
    with pytest.raises(TypeError, match="FusionFlowLoader"):
        SharedLoader(object(), name="x")
    producer = jobs.start("producer", "--batch-size", 8, "--n", 16, "--epochs", 1)
    with pytest.raises(ValueError, match=r"batch_size=12 must be the producer's batch size \(8\)"):
        SharedLoaderClient(jobs.name, batch_size=12, timeout=60)
    with pytest.raises(ValueError, match="already serving"):
        SharedLoader(make_loader(4, 8, False), name=jobs.name)
    pin = True if not torch.cuda.is_available() else "auto"  # no CUDA: a log line, batches unpinned
    with SharedLoaderClient(jobs.name, timeout=60, pin_memory=pin) as c:  # the refused ones left nothing attached
        assert sum(len(y) for _, y in c) == 16 and c.pin_memory == torch.cuda.is_available()
    assert jobs.wait(producer) == 0


def test_the_ring_is_mapped_read_only_and_the_record_is_the_users_alone(jobs):
    producer = jobs.start("producer", "--batch-size", 4, "--n", 8, "--epochs", 1)
    with SharedLoaderClient(jobs.name, timeout=60) as c:
        assert not c._ring.images.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            c._ring.images[0, 0, 0, 0, 0] = 1
        path = rendezvous.path_of(jobs.name)
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        assert sum(len(y) for _, y in c) == 8
    assert jobs.wait(producer) == 0


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_serve_from_a_shell_gives_the_loaders_epoch(jobs, tmp_path, source):
    """The CLI over an ImageFolder and over tar shards of it: a client gets exactly the epoch of the
    same loader iterated here (samples, order, pixels)."""
    import torch
    from test_shards import write_shards

    from fusionflow import FusionFlowLoader, ImageFolder, TarShards
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=5, min_side=40, max_side=90)
    folder = ImageFolder(root)
    data = root if source == "folder" else write_shards(folder, str(tmp_path / "s"), per_shard=4)
    ds = folder if source == "folder" else TarShards(data)
    producer = jobs.serve("--data", data, "--epochs", 1, "--batch-size", 4, "--workers", 1, "--seed", 3)
    with SharedLoaderClient(jobs.name, timeout=60) as client:
        got = [(x.clone(), y.clone()) for x, y in client]
    assert jobs.wait(producer) == 0, jobs.dump()
    assert "1/1: 10 images to 1 clients" in jobs.log("serve"), jobs.dump()
    order = torch.Generator().manual_seed(3)  # --seed sets the shuffle order too: the run repeats
    with FusionFlowLoader(ds, batch_size=4, shuffle=True, num_workers=1, seed=3, generator=order) as loader:
        ref = list(loader)
    assert [y.tolist() for _, y in got] == [y.tolist() for _, y in ref]
    assert all(digests(a) == digests(b) for (a, _), (b, _) in zip(got, ref))


def test_serve_refuses_data_it_cannot_read(jobs, tmp_path):
    for data, says in ((tmp_path / "nothing", "is neither a directory"), (tmp_path / "x-*.tar", "x-*.tar")):
        p = jobs.serve("--data", data, "--epochs", 1)
        assert jobs.wait(p) == 2
        assert says in jobs.log("serve"), jobs.dump()


def test_serve_refuses_bad_arguments_with_a_usage_error_not_a_traceback(jobs, tmp_path):
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=2, min_side=40, max_side=60)
    (tmp_path / "empty").mkdir()
    for args, says in (
        (["--data", root, "--name", "bad name"], "--name 'bad name' must be 1-64 characters"),
        (["--data", root, "--buffer", 0], "--buffer must be >= 1, got 0"),
        (["--data", root, "--tiny-batch-size", 0], "--tiny-batch-size must be >= 1, got 0"),
        (["--data", root, "--policy", "nope"], "nope"),
        (["--data", tmp_path / "empty"], "has no class sub-directories"),
        (["--data", root, "--batch-size", 8, "--drop-last"], "the 4 images make no mini-batch"),  # epochs of nothing
        (["--data", root, "--image-key", "png"], f"--image-key name tar shard members; --data {root!r} is an Imag"),
        (["--data", root, "--target-key", "none"], "--target-key name tar shard members"),  # ignored, it was
    ):
        p = jobs.serve("--epochs", 1, *args)
        assert jobs.wait(p) == 2, jobs.dump()
        out = jobs.log("serve")
        assert says in out and "Traceback" not in out and "python -m fusionflow serve: error:" in out, out


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_serve_on_a_corrupt_image_says_which_in_a_line_or_skips_it(jobs, tmp_path, on_error):
    """One corrupt JPEG: `serve` printed three tracebacks and advised on_error='skip', which it had no option for."""
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=4, min_side=40, max_side=60)
    victim = sorted(os.scandir(sorted(os.scandir(root), key=lambda e: e.name)[0].path), key=lambda e: e.name)[0]
    with open(victim.path, "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not a JPEG")
    producer = jobs.serve("--data", root, "--epochs", 1, "--batch-size", 2, "--workers", 1, "--on-error", on_error)
    with SharedLoaderClient(jobs.name, timeout=60) as client:
        if on_error == "skip":
            assert sum(len(y) for _, y in client) == 7
        else:
            with pytest.raises(SharedLoaderError, match=victim.name):
                list(client)
    code, out = jobs.wait(producer), jobs.log("serve")
    if on_error == "skip":
        assert code == 0, out
    else:
        assert code == 1 and "Traceback" not in out and "--on-error skip drops such" in out, out


def test_serve_of_a_name_already_served_is_a_usage_error_not_a_traceback(jobs, tmp_path):
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=2, min_side=40, max_side=60)
    with SharedLoader(make_loader(4, 8, False), name=jobs.name):
        p = jobs.serve("--data", root, "--epochs", 1)
        assert jobs.wait(p) == 2, jobs.dump()
    out = jobs.log("serve")
    assert "is already serving on this node" in out and "Traceback" not in out, out
    assert "python -m fusionflow serve: error:" in out, out


def test_serve_with_an_unusable_runtime_directory_says_so_in_a_line(jobs, tmp_path):
    """FUSIONFLOW_RUNTIME_DIR naming a file (or a directory others may enter) ended `serve` with a traceback around
    the message that says what to fix (a sweep, session 50)."""
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=2, min_side=40, max_side=60)
    (tmp_path / "a-file").write_text("")
    before = os.environ.get("FUSIONFLOW_RUNTIME_DIR")
    os.environ["FUSIONFLOW_RUNTIME_DIR"] = str(tmp_path / "a-file")  # the server's only: `jobs` checks at its end
    try:
        p = jobs.serve("--data", root, "--epochs", 1)
    finally:
        os.environ.pop("FUSIONFLOW_RUNTIME_DIR")
        if before is not None:
            os.environ["FUSIONFLOW_RUNTIME_DIR"] = before
    assert jobs.wait(p) == 1, jobs.dump()
    out = jobs.log("serve")
    assert "Traceback" not in out and "python -m fusionflow serve:" in out and "a-file" in out, out


def test_the_producer_derives_its_config_and_holds_slots_through_the_loaders_parts(jobs):
    """In this process, no client: the SharedLoader runs the loader's runtime on a configuration of its
    own (buffer slots, persistent workers) and leaves `loader.config` as built; an epoch held slot by
    slot through `loader.parts.held_epoch` (wait_next / give_back, two slots held at once as slow clients
    hold them) gives the loader's own epoch; after close() the loader iterates on its own ring depth."""
    from fusionflow.runtime.slots import SlotPool

    want = reference(8, 40, 1)[0]["labels"]
    loader = make_loader(8, 40, False)
    built = loader.config
    shared = SharedLoader(loader, name=jobs.name, buffer=3)
    try:
        assert loader.config is built and built.prefetch_factor != 3
        assert (shared.config.prefetch_factor, shared.config.persistent_workers) == (3, True)
        mgr = loader.parts.runtime.manager
        assert mgr.spec.layout.depth == 3
        it = loader.parts.held_epoch(shared.config, SlotPool(range(3)))

        def step():
            flight = it.in_flight()
            if flight is None:
                raise StopIteration
            assert flight, "at most two slots are held: a third mini-batch is in flight"
            return it.wait_next()

        got, held = [], []
        while True:
            try:
                state = it.advance(step)
            except StopIteration:
                break
            got += mgr.board.ring.labels[state.slot][: state.size].tolist()
            held.append(state.slot)
            if len(held) == 2:
                it.give_back(held.pop(0))
        it.close()
        assert got == want
    finally:
        shared.close()
    assert loader.config is built
    epoch = iter(loader)
    labels = [next(epoch)[1]]
    assert loader.parts.runtime.manager.spec.layout.depth == built.prefetch_factor  # its own ring again
    labels += [y for _, y in epoch]
    assert sorted(torch.cat(labels).tolist()) == list(range(40))
    loader.close()


@pytest.mark.parametrize("batch_size", [4, 8])  # a piece of the producer's batch held, or whole ones
def test_a_client_whose_producer_was_stopped_gets_its_last_word_and_serve_ends_on_sigterm(jobs, tmp_path, batch_size):
    """`serve` stopped by SIGTERM (kill, docker stop) tells its clients it was interrupted and removes its record;
    a client that holds a batch meanwhile raises that (it used to say the producer detached it)."""
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=24, min_side=40, max_side=90)
    producer = jobs.serve("--data", root, "--epochs", 2, "--batch-size", 8, "--workers", 1, "--buffer", 2)
    with SharedLoaderClient(jobs.name, batch_size=batch_size, timeout=60) as c:
        it = iter(c)
        next(it)
        producer.send_signal(signal.SIGTERM)
        assert jobs.wait(producer) == 143, jobs.dump()  # (the shell's status for SIGTERM)
        with pytest.raises(SharedLoaderError, match=r"Stopped: stopped by SIGTERM"):
            for _ in it:
                pass
    assert not os.path.exists(rendezvous.path_of(jobs.name)), "the record outlived a SIGTERMed serve"


def test_serve_sigtermed_while_it_starts_its_workers_ends_with_143(jobs, tmp_path):
    """A SIGTERM right after the loader is built, as SharedLoader forks its workers: the handler's Stopped, raised in
    the fork's at-fork hook (logging's), was printed and dropped by CPython; serve went on waiting for clients (for
    10 minutes in a helper's run, until a second SIGTERM) or ended with a traceback and status 1."""
    from fusionflow.tools.synthetic import make_image_folder

    root = make_image_folder(str(tmp_path / "f"), num_classes=2, per_class=4, min_side=40, max_side=60)
    for _ in range(3):
        producer = jobs.serve("--data", root, "--epochs", 1, "--batch-size", 4, "--workers", 2)
        assert wait_until(lambda: "no policy= given" in jobs.log("serve"), 120), jobs.dump()
        producer.send_signal(signal.SIGTERM)
        assert jobs.wait(producer, 60) == 143, jobs.log("serve")
        assert not os.path.exists(rendezvous.path_of(jobs.name))


def test_a_closed_client_says_so_when_iterated_in_the_middle_of_a_piece(jobs):
    producer = jobs.start("producer", "--batch-size", 8, "--n", 16, "--epochs", 1)
    c = SharedLoaderClient(jobs.name, batch_size=4, timeout=60)
    it = iter(c)
    next(it)  # the first half of the producer's first batch: its slot is held for the second
    c.close()
    with pytest.raises(SharedLoaderError, match="was closed"):
        next(it)
    assert jobs.wait(producer) == 0, jobs.dump()


def test_two_producers_of_one_name_starting_together_one_is_refused(tmp_path):
    """The look for a live producer of the name and the publishing of the record are one step under the name's
    lock: of two started at the same moment one serves, the other is refused (both used to publish, the second
    record replacing the first)."""
    import threading

    from fusionflow.shared.hub import Hub

    fd = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT, 0o600)

    def one(name, start, out):
        start.wait()
        try:
            out.append(Hub(name, fd, None, None))
        except ValueError as e:
            out.append(e)

    try:
        for _ in range(10):
            name, start, out = f"race-{uuid.uuid4().hex[:8]}", threading.Barrier(2), []
            threads = [threading.Thread(target=one, args=(name, start, out)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            hubs = [h for h in out if isinstance(h, Hub)]
            for h in hubs:
                h.close()
            assert len(hubs) == 1 and "already serving" in str(next(e for e in out if isinstance(e, ValueError)))
            assert not os.path.exists(rendezvous.path_of(name))
    finally:
        os.close(fd)


def test_a_producer_whose_publish_fails_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """The name's lock held past its bound (a stopped process), a Ctrl-C: the Hub's socket, pipes and ring
    descriptor are closed before the error propagates."""
    from fusionflow.shared.hub import Hub

    def stuck(*args):
        raise TimeoutError("the shared loader name's lock stayed locked over 10 s (its holder stopped?)")

    monkeypatch.setattr(rendezvous, "publish", stuck)
    fd = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(TimeoutError, match="stayed locked"):
            Hub(f"stuck-{uuid.uuid4().hex[:8]}", fd, None, None)
        assert set(os.listdir("/proc/self/fd")) <= before
    finally:
        os.close(fd)


def test_a_producer_stopped_in_the_middle_of_a_message_fails_the_client_within_its_timeout():
    """A message begun and not finished (a producer SIGSTOPped while sending a batch with large targets, more than
    the socket holds): the client waited in recv() for ever, whatever its timeout. Now the rest must come within it.
    The producer's end here writes a frame's length and ten of its bytes, then nothing."""
    import multiprocessing
    from types import SimpleNamespace

    mine, producers = multiprocessing.Pipe()
    try:
        os.write(producers.fileno(), struct.pack("!i", 1 << 20) + b"x" * 10)
        client = SimpleNamespace(_conn=mine, producer=SimpleNamespace(pid=os.getpid()), timeout=0.5, name="half")
        with pytest.raises(SharedLoaderError, match=r"'half' .* stopped in the middle of a message .*10 of 1048576"):
            SharedLoaderClient._recv(client)
    finally:
        mine.close()
        producers.close()


def test_a_seedless_loader_keeps_the_seed_it_was_served_with(jobs):
    """seed=None: the producer draws the loader's seed as its first epoch would (it starts ahead of it) and records
    it as the loader's: loader.seed and its state_dict carry it, its later epochs and another SharedLoader over it
    keep it (the producer used to keep its draw to itself: the state said None, a plain epoch drew another)."""
    import threading

    from shared_jobs import SMALL, Indexed

    from fusionflow import FusionFlowLoader

    def make(**kw):
        return FusionFlowLoader(Indexed(8), batch_size=4, num_workers=1, policy=SMALL, global_manager=None, **kw)

    with make() as loader:
        with SharedLoader(loader, name=jobs.name) as shared:
            client = SharedLoaderClient(jobs.name, timeout=60)
            serving = threading.Thread(target=shared.serve, kwargs=dict(epochs=1), daemon=True)
            serving.start()
            served = {int(t): d for x, y in client for t, d in zip(y, digests(x))}
            client.close()
            serving.join(60)
        seed = loader.seed
        assert seed is not None and loader.state_dict()["seed"] == seed and len(served) == 8
        for _ in loader:  # a plain epoch after serving
            pass
        assert loader.seed == seed
        with SharedLoader(loader, name=jobs.name + "-2") as again:
            assert again.config.seed == seed
    with make(seed=seed) as reference:
        first = {int(t): d for x, y in reference for t, d in zip(y, digests(x))}
    assert first == served  # (epoch 0, either order: pixels follow (seed, epoch, index))


def test_a_longest_name_fits_the_socket_address_of_any_uid():
    """`serve --name` of 64 characters (the longest allowed) failed with 'AF_UNIX path too long' for a user whose
    uid has 8 or more digits: the whole name went into the producer's abstract address."""
    import socket

    from fusionflow.shared.hub import address_of

    name = rendezvous.check_name("n" * 64)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + address_of(name, 2**32 - 2))  # the largest uid Linux gives
    finally:
        sock.close()


def test_a_producer_named_cores_keeps_its_record_when_a_loader_claims_cores(tmp_path, monkeypatch):
    """The record of a producer named 'cores' was the node's core-claims file: the next loader's claim rewrote it
    and clients found no producer. The records now have a name of their own."""
    from fusionflow.runtime import cores
    from fusionflow.shared.hub import Hub

    monkeypatch.setenv("FUSIONFLOW_RUNTIME_DIR", str(tmp_path / "fusionflow"))  # not the user's own claims
    fd = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        hub = Hub("cores", fd, None, None)
        try:
            with cores._claims():  # what a loader with pin_workers does at start: the file rewritten
                pass
            rec = rendezvous.read("cores")
            assert rec is not None and rec["address"] == hub.address
        finally:
            hub.close()
        assert rendezvous.read("cores") is None
    finally:
        os.close(fd)


def test_a_client_that_stops_iterating_is_named_by_the_producer(jobs, caplog, monkeypatch):
    """A client that keeps its connection and stops iterating (a validation pass) holds every ring slot: the producer
    and the other clients waited without a word (their timeouts never fire: the producer answers them). The
    producer now says which client holds the oldest batch."""
    import threading

    from fusionflow.shared import producer

    monkeypatch.setattr(producer, "HELD_WARN_S", 1.0)
    with SharedLoader(make_loader(4, 24, False), name=jobs.name, buffer=2) as shared:
        client = SharedLoaderClient(jobs.name, timeout=60)
        served = threading.Thread(target=shared.serve, kwargs=dict(epochs=1, min_clients=1))
        with caplog.at_level("WARNING", logger="fusionflow.shared"):
            served.start()
            it = iter(client)
            next(it)  # and no further: it holds the ring
            assert wait_until(lambda: "hold the oldest batch" in caplog.text, 60), caplog.text
        assert f"client pid(s) {os.getpid()} hold" in caplog.text
        assert sum(1 for _ in it) == 24 // 4 - 1  # iterating again, it gets the rest
        served.join(60)
        client.close()
    assert not served.is_alive()
