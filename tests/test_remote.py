"""Remote CPU workers on Ray (fusionflow/remote/config.py, fusionflow/remote/kind.py): same pixels
and labels as local-only, every sample exactly once, an actor killed and a node removed mid-epoch,
start-up errors, clean shutdown. On one local Ray instance per class and a simulated multi-node
cluster (ray.cluster_utils.Cluster); skipped only when ray is not installed."""

import dataclasses
import glob
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
from test_loader import SMALL, Bytes, _our_tree, collect, no_leaks  # noqa: F401  (autouse: no process or segment left)
from torch.utils.data import BatchSampler, DistributedSampler

from fusionflow import FusionFlowLoader, RemoteWorkerError
from fusionflow.ops.pipeline import CpuPipeline
from fusionflow.runtime.procs import pid_alive

HERE = os.path.dirname(os.path.abspath(__file__))
# Ray's worker processes must import this checkout's fusionflow and these test datasets
PYTHONPATH = os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])


def _ray():
    return pytest.importorskip("ray", reason="ray is not installed (pip install 'fusionflow[ray]')")


def _init_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")


RAY_MARKS = (
    "raylet",
    "gcs_server",
    "ray::",
    "/ray/_private/",
    "/ray/dashboard/",
    "/ray/autoscaler/",
    "default_worker.py",
    "/ray/core/",
)


def _ray_processes() -> list[str]:
    """Processes of this test run (descendants) that belong to Ray."""
    out = []
    for pid in _our_tree() - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmd for mark in RAY_MARKS):
            out.append(f"{pid}: {cmd[:120]}")
    return out


@pytest.fixture(autouse=True, scope="module")
def no_ray_sessions_left():
    """Ray keeps each instance's logs and sockets under /tmp/ray/session_*: the instances these tests
    start are theirs to remove (tens of MB a run otherwise)."""
    before = set(glob.glob("/tmp/ray/session_*"))
    yield
    for path in set(glob.glob("/tmp/ray/session_*")) - before:
        if os.path.islink(path):  # session_latest
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cpus_free():
    """Start each test with every CPU of the cluster free: a previous test's actors give theirs back a
    moment after its loader closed (the loader waits for them only briefly, then adds workers later)."""
    import ray

    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0) and time.time() < deadline:
        time.sleep(0.1)


def local_instance():
    """A class's own local Ray instance of 2 CPUs, in this (the test) process, as an application's."""
    ray = _ray()
    mp = pytest.MonkeyPatch()
    _init_env(mp)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
    mp.undo()
    assert _wait_gone() == [], "Ray processes left after ray.shutdown()"


def _wait_gone(deadline_s=15.0) -> list[str]:
    deadline = time.time() + deadline_s
    while (left := _ray_processes()) and time.time() < deadline:
        time.sleep(0.2)
    return left


class Unpicklable(Bytes):
    def __init__(self):
        super().__init__(8)
        self.lock = threading.Lock()


class LocalFiles(Bytes):
    """Files only this machine's processes can read: the training process and its forked workers read
    them, a Ray actor (started by Ray, not forked from us) gets FileNotFoundError, as it would on a
    node without the dataset's disk."""

    def __init__(self):
        super().__init__(8)
        self.owner = os.getpid()

    def __getitem__(self, i):
        if self.owner not in (os.getpid(), os.getppid()):
            raise FileNotFoundError(2, "No such file or directory", self.describe(i))
        return super().__getitem__(i)


class FloatTargets(Bytes):
    def __getitem__(self, i):
        sample, index = super().__getitem__(i)
        return sample, index + 0.5


class WorkerIds(Bytes):
    """The label says which worker read the sample: worker id * 1000 + index."""

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return self.data[i], info.id * 1000 + i


class SlowOnActors(Bytes):
    """3 s a sample on a Ray actor (a worker id past the one local worker's), 0.2 s locally."""

    def __getitem__(self, i):
        time.sleep(3 if torch.utils.data.get_worker_info().id >= 1 else 0.2)
        return super().__getitem__(i)


class FailsOnActors(Bytes):
    """Sample 5 cannot be read on the Ray actors (worker ids past the one local worker's)."""

    def __getitem__(self, i):
        if i == 5 and torch.utils.data.get_worker_info().id >= 1:
            raise FileNotFoundError(2, "No such file or directory", "/data/img_5.jpg")
        return super().__getitem__(i)


class PicklesOnce(Bytes):
    """Its pickle fails once `broken` is set (as a cluster gone between epochs makes the Ray workers' start fail)."""

    broken = False

    def __getstate__(self):
        if PicklesOnce.broken:
            raise TypeError("this dataset no longer pickles")
        return self.__dict__


def _needs_worker_info(worker_id):
    assert torch.utils.data.get_worker_info().id == worker_id


def _loader(ds, remote=None, **kw):
    args = dict(
        batch_size=8,
        shuffle=True,
        num_workers=1,
        policy=SMALL,
        tiny_batch_size=2,
        seed=1,
        generator=torch.Generator().manual_seed(3),
        persistent_workers=True,
    )
    args.update(kw)
    return FusionFlowLoader(ds, remote_workers=remote, **args)


def dataloaders_order(n: int) -> list:
    """The batches DataLoader draws with _loader's batch size, shuffle and generator."""
    loader = torch.utils.data.DataLoader(range(n), 8, shuffle=True, generator=torch.Generator().manual_seed(3))
    return [b.tolist() for b in loader]


def _expected_pixels(ds, images, batches, epoch, copy=0):
    """`copy`: a DistributedSampler's rank (fusionflow.scheduling.tiny_batches.Copies)."""
    pipe = CpuPipeline(SMALL)
    for x, idx in zip(images, batches):
        for k, i in enumerate(idx):
            assert np.array_equal(x[k].numpy(), pipe(ds.data[i], i, seed=1, epoch=epoch, copy=copy)), (i, epoch)


def test_without_ray_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    from fusionflow import RayWorkers

    with pytest.raises(ImportError, match=r"pip install 'fusionflow\[ray\]'"):
        RayWorkers(2)


def test_argument_errors():
    _ray()
    from fusionflow import RayWorkers

    with pytest.raises(TypeError, match="remote_workers='ray' must be None or fusionflow.RayWorkers"):
        FusionFlowLoader(Bytes(8), num_workers=1, remote_workers="ray")
    with pytest.raises(ValueError, match="remote_workers needs num_workers >= 1"):
        FusionFlowLoader(Bytes(8), num_workers=0, remote_workers=RayWorkers(1))
    with pytest.raises(ValueError, match="num_workers=0 must be"):
        RayWorkers(0)
    with pytest.raises(ValueError, match="take='middle'"):
        RayWorkers(1, take="middle")
    with pytest.raises(ValueError, match="in_flight=0"):
        RayWorkers(1, in_flight=0)
    with pytest.raises(ValueError, match="per_call=0"):
        RayWorkers(1, per_call=0)
    for bad in ("10", None, float("nan")):
        with pytest.raises(ValueError, match=r"startup_timeout=.* must be a number of seconds > 0"):
            RayWorkers(1, startup_timeout=bad)
    with pytest.raises(ValueError, match=r"call_timeout=nan must be None \(measured\)"):
        RayWorkers(1, call_timeout=float("nan"))
    with pytest.raises(TypeError, match=r"init_kwargs=\[1, 2\] must be None or a dict"):
        RayWorkers(1, init_kwargs=[1, 2])
    with pytest.raises(TypeError, match="runtime_env='py_modules' must be None or a dict"):
        RayWorkers(1, runtime_env="py_modules")
    with pytest.raises(TypeError, match="address='' must be None"):
        RayWorkers(1, address="")
    for bad in (float("nan"), float("inf"), 0, True):  # nan and inf failed later, in the gateway, with a traceback
        with pytest.raises(ValueError, match="cpus_per_worker=.* must be a finite number > 0"):
            RayWorkers(1, cpus_per_worker=bad)


@pytest.mark.ray
class TestFusionFlowOwnsRay:
    """No Ray in this process: FusionFlow starts a local instance and stops it at close()."""

    def test_starts_a_local_instance_and_leaves_nothing_running(self, monkeypatch):
        ray = _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        assert not ray.is_initialized()
        ds = Bytes(24)
        loader = _loader(ds, RayWorkers(1))
        _images, labels = collect(loader)
        assert sorted(torch.cat(labels).tolist()) == list(range(24))
        assert loader.stats.remote_tiny_batches > 0
        loader.close()
        assert not ray.is_initialized()
        assert _wait_gone() == [], "Ray processes left after close()"

    def test_more_workers_than_cores_without_a_cluster_get_the_cores_and_a_warning(self, monkeypatch, caplog):
        """RayWorkers(N) with no cluster started a local instance of N CPUs, whatever the machine had: RayWorkers(64)
        put 64 actors of ~600 MB on the training machine, without a word."""
        _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        cores = len(os.sched_getaffinity(0))
        with caplog.at_level("WARNING", logger="fusionflow"), _loader(Bytes(24), RayWorkers(cores + 2)) as loader:
            _images, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(24))
        assert f"gets this machine's {cores} cores (room for {cores} Ray workers)" in caplog.text
        assert _wait_gone() == [], "Ray processes left after close()"

    def test_a_named_address_where_nothing_listens_raises_connection_error_soon(self, monkeypatch):
        """ray.init retries an address for minutes: the gateway looks first, and the error names the address."""
        _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"address='127.0.0.1:1'\): no Ray cluster there \(nothing answers"):
            collect(_loader(Bytes(8), RayWorkers(1, address="127.0.0.1:1", startup_timeout=5)))
        assert time.monotonic() - t0 < 100  # (it used to say "did not start within 120 s", after 121 s)
        assert _wait_gone() == [], "Ray processes left"

    def test_an_address_ray_cannot_parse_is_refused_in_one_line(self, monkeypatch):
        """The message was the gateway's traceback, ending in Ray's 'Invalid address format'."""
        _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        with pytest.raises(ConnectionError, match=r"address='garbage'\): Ray does not take this address") as info:
            collect(_loader(Bytes(8), RayWorkers(1, address="garbage", startup_timeout=5)))
        assert "Traceback" not in str(info.value)
        assert _wait_gone() == [], "Ray processes left"

    def test_two_loaders_start_an_instance_each_and_one_s_close_leaves_the_other_s(self, monkeypatch):
        """A second loader (validation beside training) does not join the first's private instance (sized for
        the first, and stopped with it): it starts its own, and keeps its remote workers when the first closes."""
        ray = _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        a, b = _loader(Bytes(16), RayWorkers(1)), _loader(Bytes(24), RayWorkers(1))
        for epoch in range(20):  # on a busy machine a local worker may run a whole epoch alone
            for ld in (a, b):
                ld.set_epoch(epoch)
                assert sorted(torch.cat(collect(ld)[1]).tolist()) == list(range(len(ld.dataset)))
            if b.stats.remote_tiny_batches > 0:
                break
        assert b.stats.remote_tiny_batches > 0
        a.close()
        before = b.stats.remote_tiny_batches
        for epoch in range(20, 40):
            b.set_epoch(epoch)
            assert sorted(torch.cat(collect(b)[1]).tolist()) == list(range(24))
            if b.stats.remote_tiny_batches > before:
                break
        assert b.stats.remote_tiny_batches > before and b.stats.remote_gateways_lost == 0
        b.close()
        assert not ray.is_initialized() and _wait_gone() == [], "Ray processes left after close()"

    def test_auto_address_without_a_cluster_starts_a_local_instance(self, monkeypatch, caplog):
        ray = _ray()
        from fusionflow import RayWorkers

        _init_env(monkeypatch)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        loader = _loader(Bytes(12), RayWorkers(1, address="auto"))
        with caplog.at_level("WARNING", logger="fusionflow.remote.config"):
            _images, labels = collect(loader)
        assert sorted(torch.cat(labels).tolist()) == list(range(12))
        assert "no running Ray cluster found" in caplog.text
        loader.close()
        assert not ray.is_initialized()
        assert _wait_gone() == [], "Ray processes left after close()"


@pytest.mark.ray
@pytest.mark.usefixtures("cpus_free")
class TestLocalRay:
    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def local_ray(cls):
        yield from local_instance()

    @pytest.mark.parametrize("take,per_call", [("back", 2), ("front", 2), ("back", 1), ("front", 3)])
    def test_same_pixels_and_labels_as_local_only(self, take, per_call):
        from fusionflow import RayWorkers

        ds = Bytes(40)
        with _loader(ds) as local:
            local.set_epoch(2)
            want_x, want_y = collect(local)
        with _loader(ds, RayWorkers(2, take=take, per_call=per_call)) as both:
            both.set_epoch(2)
            got_x, got_y = collect(both)
            assert both.stats.remote_tiny_batches > 0
            assert both.stats.remote_workers_lost == 0
        assert [y.tolist() for y in got_y] == [y.tolist() for y in want_y]
        assert all(torch.equal(a, b) for a, b in zip(got_x, want_x))

    def test_with_the_decoded_cache_actors_render_as_a_cached_sample_is_rendered(self):
        """docs/cache.md's recipe for repeatable runs (fill_share=None, a budget that holds the set) holds with
        Ray: an actor has no store, but it renders from the cache's resolution, so a run's pixels do not
        depend on which samples went remote."""
        from fusionflow import DecodedCache, RayWorkers

        ds, cache = Bytes(40), DecodedCache("16MB", max_side=28, fill_share=None)  # below the images' sides
        with _loader(ds, cache=cache) as local:
            local.set_epoch(2)
            want_x, want_y = collect(local)
        with _loader(ds, RayWorkers(2, take="front"), cache=cache) as both:
            both.set_epoch(2)
            got_x, got_y = collect(both)
            assert both.stats.remote_tiny_batches > 0
        assert [y.tolist() for y in got_y] == [y.tolist() for y in want_y]
        assert all(torch.equal(a, b) for a, b in zip(got_x, want_x))

    def test_results_that_cannot_be_written_run_locally_and_retire_the_remote_workers(self, monkeypatch):
        # an actor of another FusionFlow version would return another shape: stand in for it with a
        # policy of another output size on the actors; nothing it returns may reach a batch
        from fusionflow import RayWorkers
        from fusionflow.policy import load_policy
        from fusionflow.remote import kind as remote

        init = remote.RemoteWorkers.__init__
        other = load_policy(SMALL, size=16)

        def mismatched(self, board, config, dataset, spec, *args, **kwargs):  # the actors get the other policy
            init(self, board, config, dataset, dataclasses.replace(spec, policy=other), *args, **kwargs)

        monkeypatch.setattr(remote.RemoteWorkers, "__init__", mismatched)
        ds = Bytes(40)
        with _loader(ds, RayWorkers(2, take="front"), shuffle=False) as loader:
            images, labels = collect(loader)
            assert loader.stats.remote_tiny_batches == 0
            kind = loader._manager.board.kinds[0]
            assert kind.retired is not None and "in a row failed" in kind.retired
        assert sorted(torch.cat(labels).tolist()) == list(range(40))
        _expected_pixels(ds, images, [y.tolist() for y in labels], epoch=0)

    def test_actors_have_dataloaders_worker_info_after_the_local_workers(self):
        """get_worker_info() in a Ray actor (DataLoader's pattern: a handle per worker in worker_init_fn, or in
        the dataset) gives its id, after the local workers' ids, and its seed, base_seed + id."""
        from fusionflow import RayWorkers

        with _loader(WorkerIds(24), RayWorkers(2), shuffle=False, worker_init_fn=_needs_worker_info) as loader:
            for epoch in range(20):  # on a busy machine the local worker may run a whole epoch alone
                loader.set_epoch(epoch)
                labels = torch.cat(collect(loader)[1]).tolist()
                assert sorted(y % 1000 for y in labels) == list(range(24))
                if loader.stats.remote_tiny_batches > 0:
                    break
        ids = {y // 1000 for y in labels}
        assert loader.stats.remote_tiny_batches > 0 and ids - {0} and ids <= {0, 1, 2}, ids

    def test_calls_that_hang_in_a_row_retire_the_remote_workers(self):
        """Each call away past half of call_timeout ends its actor; such calls in a row retire the remote workers
        (they used to replace actors for ever), and every sample is delivered once."""
        from fusionflow import RayWorkers

        # a call (a tiny-batch of 2) takes 6 s on an actor: ended at 3 s, half the call deadline
        with _loader(SlowOnActors(16), RayWorkers(1, call_timeout=6, per_call=1), shuffle=False) as loader:
            deadline, epoch = time.monotonic() + 300, 0  # a replaced actor starts in seconds: an epoch may miss it
            while time.monotonic() < deadline:
                loader.set_epoch(epoch)
                assert sorted(torch.cat(collect(loader)[1]).tolist()) == list(range(16))
                kind, epoch = loader._manager.board.kinds[0], epoch + 1
                if kind.retired is not None:
                    break
            assert kind.retired is not None and "in a row failed" in kind.retired
            assert loader.stats.remote_tiny_batches == 0 and loader.stats.remote_gateways_lost == 0

    def test_targets_that_are_not_ints(self):
        from fusionflow import RayWorkers

        ds = FloatTargets(16)
        with _loader(ds, RayWorkers(2), shuffle=False) as loader:
            for epoch in range(20):  # on a busy machine the local worker may run a whole epoch of 16 alone
                loader.set_epoch(epoch)
                _x, labels = collect(loader)
                got = torch.cat(labels)
                assert got.dtype == torch.float64 and got.tolist() == [i + 0.5 for i in range(16)]
                if loader.stats.remote_tiny_batches > 0:
                    break
            assert loader.stats.remote_tiny_batches > 0  # the targets came through the Ray path too

    def test_every_sample_once_with_distributed_sampler_across_epochs(self):
        from fusionflow import RayWorkers

        ds = Bytes(45)
        union = []
        for rank in range(2):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=4)
            with _loader(ds, RayWorkers(2), sampler=sampler, shuffle=None, generator=None, batch_size=5) as loader:
                for epoch in (0, 1):
                    sampler.set_epoch(epoch)
                    loader.set_epoch(epoch)
                    images, labels = collect(loader)
                    expected = list(BatchSampler(list(sampler), 5, False))
                    assert [y.tolist() for y in labels] == expected
                    _expected_pixels(ds, images, expected, epoch, copy=rank)
                    if epoch == 0:
                        union += torch.cat(labels).tolist()
                assert loader.stats.remote_tiny_batches > 0
        assert len(union) == 46 and sorted(set(union)) == list(range(45))  # padded to 46: one index twice

    def test_actor_killed_mid_epoch(self):
        from fusionflow import RayWorkers

        ds = Bytes(48, sleep=0.01)
        with _loader(ds, RayWorkers(2)) as loader:
            expected = dataloaders_order(len(ds))
            it = iter(loader)
            first = next(it)
            kind = loader._manager.board.kinds[0]
            os.kill(kind.actors[0].pid, signal.SIGKILL)  # the actor's process, as the OOM killer would
            rest = list(it)
            images, labels = [first[0]] + [x for x, _ in rest], [first[1]] + [y for _, y in rest]
            assert [y.tolist() for y in labels] == expected  # every sample exactly once, in order
            _expected_pixels(ds, images, expected, 0)
            assert loader.stats.remote_workers_lost == 1
            deadline = time.time() + 20  # a replacement comes up (the CPU it held is free again)
            while kind.live < 2 and time.time() < deadline:
                time.sleep(0.1)
            assert kind.live == 2
            before = loader.stats.remote_tiny_batches
            _x, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(48))
            assert loader.stats.remote_tiny_batches > before

    def test_a_replacement_actor_takes_the_worker_id_its_predecessor_left(self):
        """A replacement's get_worker_info().id was a count of every actor asked for: past num_workers (1 local + 1
        Ray: id 2, 3, ...), so a worker_init_fn that shards by id, or checks it, failed on each replacement until
        the remote workers were given up. It takes the id its predecessor left now."""
        from fusionflow import RayWorkers

        with _loader(WorkerIds(24), RayWorkers(1), shuffle=False, worker_init_fn=_needs_worker_info) as loader:
            collect(loader)
            kind = loader._manager.board.kinds[0]
            os.kill(kind.actors[0].pid, signal.SIGKILL)
            deadline = time.time() + 60
            while not (loader.stats.remote_workers_lost == 1 and kind.live == 1) and time.time() < deadline:
                collect(loader)  # (the death is seen when a call fails; then a replacement comes up)
            assert loader.stats.remote_workers_lost == 1 and kind.live == 1
            before, ids = loader.stats.remote_tiny_batches, set()
            for epoch in range(20):  # on a busy machine the local worker may run a whole epoch alone
                loader.set_epoch(epoch)
                labels = torch.cat(collect(loader)[1]).tolist()
                assert sorted(y % 1000 for y in labels) == list(range(24))
                ids |= {y // 1000 for y in labels}
                if loader.stats.remote_tiny_batches > before:
                    break
        assert loader.stats.remote_tiny_batches > before and ids == {0, 1}, ids

    def test_ray_workers_that_cannot_start_for_a_later_epoch_leave_it_to_the_local_workers(self, caplog):
        """Without persistent workers each epoch starts its Ray workers anew: one whose start failed (the cluster
        gone since the epoch before) raised from iter() and ended training, where persistent workers carried on.
        Only the loader's first start raises now; a later one's epoch runs on the local workers."""
        from fusionflow import RayWorkers

        ds = PicklesOnce(24)
        try:
            with _loader(ds, RayWorkers(1), persistent_workers=False) as loader:
                collect(loader)
                assert loader.stats.remote_tiny_batches > 0
                PicklesOnce.broken = True
                for epoch in (1, 2):
                    loader.set_epoch(epoch)
                    assert sorted(torch.cat(collect(loader)[1]).tolist()) == list(range(24))
        finally:
            PicklesOnce.broken = False
        assert caplog.text.count("did not start for this epoch") == 2 and "the next epoch tries again" in caplog.text

    def test_a_sample_failing_on_a_ray_worker_says_where(self):
        """A file missing on a Ray node only: the error names the actor and its host, not only the path."""
        from fusionflow import RayWorkers, SampleError

        with _loader(FailsOnActors(16), RayWorkers(2), shuffle=False) as loader:
            for epoch in range(30):  # until an actor, not the local worker, reads sample 5
                loader.set_epoch(epoch)
                try:
                    collect(loader)
                except SampleError as e:
                    assert "sample 5 (/data/img_5.jpg) on Ray worker ray" in str(e) and "(host " in str(e), e
                    return
        pytest.fail("no Ray worker read sample 5 in 30 epochs")

    def test_a_failing_sample_travels_as_data(self, local_ray):
        from fusionflow.remote.task import actor_class

        ds = Bytes(8, bad={3})
        actor = actor_class(local_ray).options(num_cpus=1).remote(local_ray.put(ds), SMALL, 1, (0, 0, 1))
        try:
            images, labels, failures, _s = local_ray.get(actor.run.remote(0, (5, 6), (2, 3), ()), timeout=60)
        finally:
            local_ray.kill(actor)
        assert labels == [2, None]
        assert np.array_equal(images[0], CpuPipeline(SMALL)(ds.data[2], 2, seed=1, epoch=0))
        [f] = failures
        assert (f.position, f.index, f.what, f.exc_type) == (6, 3, "sample 3 (/data/img_3.jpg)", "DecodeError")
        assert "Traceback" in f.traceback

    def test_unpicklable_dataset_fails_at_start_naming_it(self):
        from fusionflow import RayWorkers

        loader = _loader(Unpicklable(), RayWorkers(1))
        with pytest.raises(TypeError, match="the dataset Unpicklable cannot be pickled"):
            next(iter(loader))
        loader.close()

    def test_files_missing_on_the_remote_node_fail_at_start(self):
        from fusionflow import RayWorkers

        loader = _loader(LocalFiles(), RayWorkers(1))
        with pytest.raises(
            RemoteWorkerError,
            match=r"cannot read the dataset there: sample 0 \(/data/img_0.jpg\): "
            r"FileNotFoundError",
        ):
            next(iter(loader))
        loader.close()

    def test_close_releases_the_actors_but_not_an_instance_it_did_not_start(self, local_ray):
        from fusionflow import RayWorkers

        loader = _loader(Bytes(16), RayWorkers(2))
        collect(loader)
        kind = loader._manager.board.kinds[0]
        pids = [a.pid for a in kind.actors]
        assert len(pids) == 2 and all(pids)
        loader.close()
        assert local_ray.is_initialized()
        deadline = time.time() + 20
        while any(pid_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), "the actors outlived close()"
        deadline = time.time() + 20
        while local_ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert local_ray.available_resources().get("CPU", 0) == 2


@pytest.mark.ray
@pytest.mark.usefixtures("cpus_free")
class TestSimulatedCluster:
    """A head without CPUs and two 1-CPU worker nodes on this machine (Ray's own test utility)."""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def cluster(cls):
        ray = _ray()
        from ray.cluster_utils import Cluster

        mp = pytest.MonkeyPatch()
        _init_env(mp)
        small = {"object_store_memory": 80 * 2**20}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **small})
        for _ in range(2):
            cluster.add_node(num_cpus=1, **small)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
        ray.shutdown()
        cluster.shutdown()
        mp.undo()
        assert _wait_gone() == [], "Ray processes left after the cluster's shutdown"

    def test_node_removed_mid_epoch_then_a_node_joins(self, cluster):
        from fusionflow import RayWorkers

        ds = Bytes(48, sleep=0.01)
        with _loader(ds, RayWorkers(2)) as loader:
            expected = dataloaders_order(len(ds))
            it = iter(loader)
            first = next(it)
            kind = loader._manager.board.kinds[0]
            assert kind.live == 2
            worker_nodes = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
            cluster.remove_node(worker_nodes[0])
            rest = list(it)
            images, labels = [first[0]] + [x for x, _ in rest], [first[1]] + [y for _, y in rest]
            assert [y.tolist() for y in labels] == expected
            _expected_pixels(ds, images, expected, 0)
            deadline = time.time() + 30  # the node's death may be noticed after the epoch is done
            while loader.stats.remote_workers_lost < 1 and time.time() < deadline:
                time.sleep(0.1)
            assert loader.stats.remote_workers_lost == 1
            cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)  # a node joins: a worker comes back
            deadline = time.time() + 30
            while kind.live < 2 and time.time() < deadline:
                time.sleep(0.1)
            assert kind.live == 2
            before = loader.stats.remote_tiny_batches
            images, labels = collect(loader)
            assert sorted(torch.cat(labels).tolist()) == list(range(48))
            assert loader.stats.remote_tiny_batches > before

    def test_auto_uses_the_free_cpus_of_every_node(self, cluster):
        from fusionflow import RayWorkers

        ds = Bytes(24)
        with _loader(ds, RayWorkers("auto"), shuffle=False) as loader:
            images, labels = collect(loader)
            kind = loader._manager.board.kinds[0]
            assert kind.live == 2  # both 1-CPU worker nodes, none on the head
            assert sorted(torch.cat(labels).tolist()) == list(range(24))
            _expected_pixels(ds, images, [y.tolist() for y in labels], 0)
            cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)  # a node joins: one more worker
            deadline = time.time() + 30
            while kind.live < 3 and time.time() < deadline:
                time.sleep(0.1)
            assert kind.live == 3


def test_address_none_joins_only_a_cluster_started_as_ray_init_address_none_finds_one(monkeypatch, tmp_path):
    """RayWorkers() (address=None) joined any Ray instance a process on the machine ran (ray.init(address="auto")'s
    legacy scan): another job's own ray.init(), in another Python environment, whose workers could not import the
    dataset, so every epoch failed (a sweep, session 50). Now RAY_ADDRESS or `ray start`'s address file, else a
    private local instance; "auto" keeps Ray's scan. In the gateway's `connect`, with a stand-in ray module."""
    import types

    from fusionflow import RayWorkers
    from fusionflow.remote import config

    inits = []

    def init(address=None, **kw):
        inits.append(address)
        return types.SimpleNamespace(address_info={"session_dir": None})

    fake = types.SimpleNamespace(init=init, shutdown=lambda: None, cluster_resources=lambda: {"CPU": 2.0})
    monkeypatch.setattr(config, "import_ray", lambda: fake)
    monkeypatch.setattr(config, "_reachable", lambda address, seconds: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # `ray start`'s address file goes there: none yet
    monkeypatch.setenv("RAY_worker_niceness", "0")  # (connect sets it for a local instance)
    assert config.started_cluster() is None
    assert config.connect(RayWorkers(1))[1] is True and inits == ["local"]  # a foreign instance is never asked
    inits.clear()
    assert config.connect(RayWorkers(1, address="auto"))[1] is False and inits == ["auto"]  # Ray's scan: joined
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379\n")
    assert config.started_cluster() == "10.0.0.7:6379"
    inits.clear()
    assert config.connect(RayWorkers(1))[1] is False and inits == ["10.0.0.7:6379"]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    assert config.started_cluster() == "10.0.0.8:6379"


def test_a_lost_gateway_is_due_again_at_the_next_epoch_with_persistent_workers_too():
    """With persistent workers one iterator serves every epoch (its generation stays), so "a new gateway at the next
    epoch" never came: only the back-off's (10 s, 20, 40, ...) restarted it (a sweep, session 50: epochs 2-4 ran
    without Ray workers). A later epoch queued is the next epoch too."""
    import types

    from fusionflow.remote.kind import RemoteWorkers
    from fusionflow.scheduling.queue import TinyBatchQueue

    kind = RemoteWorkers.__new__(RemoteWorkers)  # its restart bookkeeping alone
    kind.board = types.SimpleNamespace(generation=3, queue=TinyBatchQueue())
    kind._deaths_in_a_row, kind.retired = 0, None
    kind.board.queue.add(3, 10, 0, 1, [], 0, 0.0)  # epoch 1's mini-batch 10
    kind._failed("the Ray gateway was killed by SIGKILL", 3)
    assert not kind._restart_due() and kind._retry_in() > 5  # the same epoch, within the back-off
    kind.board.queue.add(3, 11, 1, 1, [], 0, 0.0)
    assert not kind._restart_due()
    kind.board.queue.add(3, 12, 0, 2, [], 0, 0.0)  # epoch 2, the same iterator
    assert kind._restart_due()
    kind.board.generation = 4  # a new iterator (without persistent workers), as before
    kind._failed("again", 4)
    assert not kind._restart_due()
    kind.board.generation = 5
    assert kind._restart_due()
