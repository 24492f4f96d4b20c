"""Worker pinning agreed between co-located loaders (runtime/cores.py): claims in the user's node
directory keep jobs and local ranks off each other's cores; 'auto' pins only with a whole claim free."""

import json
import multiprocessing
import os

import pytest
from test_loader import SMALL, Bytes

from fusionflow import FusionFlowLoader
from fusionflow.runtime import cores
from fusionflow.runtime.cores import CoreClaim


@pytest.fixture
def node(tmp_path, monkeypatch):
    """An 8-core process affinity and a fresh user directory."""
    monkeypatch.setenv("FUSIONFLOW_RUNTIME_DIR", str(tmp_path / "fusionflow"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    return tmp_path


def test_auto_claims_disjoint_cores_and_leaves_one_to_each_trainer(node):
    a = CoreClaim(3, "auto")
    assert a.cores == [0, 1, 2]  # core 3 left to a's training process
    assert a.core_of(2) == 2 and a.core_of(3) is None  # a 4th worker (an elastic target's) runs unpinned
    b = CoreClaim(3, "auto")
    assert b.cores == [4, 5, 6]  # core 7 left to b's
    c = CoreClaim(1, "auto")
    assert c.cores == [None]  # nothing free: unpinned rather than stacked onto a's or b's cores
    a.release()
    a.release()  # idempotent
    assert CoreClaim(1, "auto").cores == [0]
    assert CoreClaim(8, "auto").cores == [None] * 8  # 8 workers + a trainer > 8 cores
    assert CoreClaim(2, False).cores == [None, None]
    assert os.stat(node / "fusionflow" / cores.FILE).st_mode & 0o777 == 0o600


def test_an_accelerators_dali_threads_get_cores_of_the_claim_too(node):
    """DALI's threads run in the training process: 'auto' claims a core for each beside the trainer's,
    and pins only when all of them are free."""
    a = CoreClaim(3, "auto", trainer_cores=3)
    assert a.cores == [0, 1, 2]  # cores 3-5 left to the trainer and two DALI threads
    assert CoreClaim(2, "auto").cores == [None, None]  # cores 6-7 cannot hold 2 workers + a trainer
    c = CoreClaim(1, "auto")
    assert c.cores == [6]
    c.release()
    assert CoreClaim(6, "auto", trainer_cores=3).cores == [None] * 6  # 6 + 3 > 8 cores
    assert CoreClaim(1, True, trainer_cores=3).cores == [6]  # forced: pinned with what is free


def test_a_loader_with_an_accelerator_claims_its_dali_threads_cores(node):
    pytest.importorskip("nvidia.dali")
    from fusionflow import DaliAccelerator

    loader = FusionFlowLoader(
        Bytes(8), batch_size=4, num_workers=1, policy=SMALL, accelerator=DaliAccelerator("cpu", threads=2)
    )
    try:
        it = iter(loader)  # kept: the claim lives as long as the run
        next(it)
        with open(node / "fusionflow" / cores.FILE) as f:
            (claim,) = json.load(f).values()
        assert claim["cores"] == [0, 1, 2, 3]  # the worker's, the trainer's, two DALI threads'
    finally:
        loader.close()


def test_forced_pinning_takes_free_cores_first_then_wraps(node):
    CoreClaim(5, "auto")  # cores 0-5 claimed
    assert CoreClaim(4, True).cores == [6, 7, 0, 1]


def test_local_ranks_get_their_own_cores_and_auto_needs_room_for_all(node, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert CoreClaim(3, "auto").cores == [0, 1, 2]  # (3 + 1) * 2 ranks <= 8 cores
    assert CoreClaim(3, "auto").cores == [4, 5, 6]
    assert CoreClaim(4, "auto").cores == [None] * 4  # (4 + 1) * 2 > 8: no rank pins


def _claim_and_die(tmp, conn):
    os.environ["FUSIONFLOW_RUNTIME_DIR"] = os.path.join(tmp, "fusionflow")
    os.sched_getaffinity = lambda pid: set(range(8))
    conn.send(CoreClaim(3, "auto").cores)
    os._exit(0)  # no release: the claim must free itself with the process


def test_claims_of_a_process_that_is_gone_are_dropped(node):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_claim_and_die, args=(str(node), child))
    p.start()
    assert parent.poll(30) and parent.recv() == [0, 1, 2]
    p.join(timeout=30)
    assert CoreClaim(3, "auto").cores == [0, 1, 2]


def test_claims_of_a_reused_pid_or_damaged_are_dropped(node):
    import json

    path = os.path.join(str(node), "fusionflow", cores.FILE)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as f:  # this pid, but a start time that is not this process's
        json.dump({"old": {"pid": os.getpid(), "start": -1, "cores": [0, 1, 2, 3]}}, f)
    assert CoreClaim(2, "auto").cores == [0, 1]
    with open(path, "w") as f:  # a damaged file: nothing in it counts, nothing fails
        json.dump({"a": {"pid": "x"}, "b": [1], "c": {"pid": os.getpid(), "start": 0, "cores": "0-3"}}, f)
    assert CoreClaim(2, "auto").cores == [0, 1]
    with open(path, "w") as f:
        f.write("[1, 2]")
    assert CoreClaim(2, "auto").cores == [0, 1]


def test_an_unusable_claims_directory_leaves_auto_unpinned(node, monkeypatch, caplog):
    (node / "fusionflow").write_text("not a directory")
    assert CoreClaim(2, "auto").cores == [None, None]
    assert "core claims file is unusable" in caplog.text
    assert CoreClaim(2, True).cores == [0, 1]


def test_two_loaders_in_one_process_do_not_pin_onto_the_same_core(tmp_path, monkeypatch):
    """Real workers: the first loader pins its worker, the second finds no free core and leaves its
    worker to the scheduler; the claim goes with the first loader's workers."""
    monkeypatch.setenv("FUSIONFLOW_RUNTIME_DIR", str(tmp_path / "fusionflow"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs 2 cores to have one to spare")
    loaders = [FusionFlowLoader(Bytes(8), batch_size=4, num_workers=1, policy=SMALL, persistent_workers=True)
               for _ in range(2)]  # fmt: skip
    try:
        for loader in loaders:
            next(iter(loader))
        affinity = [os.sched_getaffinity(ld._manager.pool.workers[0].process.pid) for ld in loaders]
        assert len(affinity[0]) == 1 and affinity[0] < cpus
        assert affinity[1] == cpus if len(cpus) < 4 else affinity[1].isdisjoint(affinity[0])
    finally:
        for loader in loaders:
            loader.close()
    with open(os.path.join(str(tmp_path), "fusionflow", cores.FILE)) as f:
        assert f.read() == "{}"  # both released at close


def test_a_stopped_holder_of_the_claims_file_costs_the_pinning_not_the_run(node, monkeypatch, caplog):
    """Another loader stopped (SIGSTOP) while it holds the claims file's lock: this one gives up once it sees the
    holder stopped (at most LOCK_S), then runs unpinned ('auto', logged) or pinned without a claim (True) -- it never
    hangs."""
    import contextlib
    import fcntl

    from stopped_holder import held_by_a_stopped_process

    monkeypatch.setattr(cores, "LOCK_S", 0.3)
    CoreClaim(1, "auto").release()  # the file exists
    path = node / "fusionflow" / cores.FILE

    @contextlib.contextmanager
    def locked():
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    with held_by_a_stopped_process(locked):
        with caplog.at_level("WARNING", logger="fusionflow"):
            assert CoreClaim(3, "auto").cores == [None, None, None]
        said = caplog.messages  # (its holder seen stopped: given up at once, since session 40)
        assert any("unpinned" in m and "locked by stopped process" in m for m in said), said
        assert CoreClaim(2, True).cores == [0, 1]
