"""`RayWorkers`: CPU workers on other machines, through Ray (`remote_workers=` of FusionFlowLoader).

A tiny-batch's pixels are a pure function of (dataset, policy, seed, epoch, index, copy), so a Ray
actor anywhere in the cluster computes the same bytes as a local CPU worker. This module is the
public configuration (read by the training process, which never imports ray) and the gateway
process's connection to the cluster (`connect`, run in remote/gateway.py only); the worker kind is
remote/kind.py.

Ray is an optional dependency: `pip install 'fusionflow[ray]'`. Every Ray node needs FusionFlow
importable (the same version), e.g. installed in the nodes' image, or shipped with
`runtime_env={"py_modules": [fusionflow]}`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import sys

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "remote_workers=RayWorkers(...) needs Ray and cloudpickle: pip install 'fusionflow[ray]' "
    "(or pip install 'ray[client]==2.60.0' cloudpickle==3.1.2)"
)
TAKE = ("back", "front")
PROBE_S = 10.0  # the longest a named cluster's address is waited for before ray.init (which retries for minutes)
PRIVATE = "fusionflow_private_instance"  # a resource marking a local Ray instance a gateway started for its loader


def ray_installed() -> bool:
    """Whether ray and cloudpickle can be imported, found without importing them (importing ray
    costs a training process ~1 s of modules and threads; only the gateway process imports it)."""
    for name in ("ray", "cloudpickle"):
        if name in sys.modules:
            if sys.modules[name] is None:  # blocked (tests do this)
                return False
            continue
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return ray


def app_address() -> str | None:
    """The GCS address of a Ray instance this (training) process already uses, without importing
    ray: the application's own, which the gateway joins and leaves running."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().gcs_address


class RayWorkers:
    """Remote CPU workers: `num_workers` Ray actors of `cpus_per_worker` CPUs each.

    num_workers: an int, or "auto": as many as the cluster's free CPUs allow, at start-up and as
        nodes join later.
    address: None or "auto" -- join the Ray instance the training process already uses, else a
        running cluster (RAY_ADDRESS, or one started with `ray start` on this machine; "auto" also any
        Ray instance a process on this machine runs, Ray's own scan), else start a private local one
        (stopped when the loader's workers stop: at close(), or at each epoch's end without
        persistent_workers; "auto" logs a warning that it found no cluster);
        "host:port" or "ray://host:port" -- connect to that running cluster (a ConnectionError if
        there is none).
    in_flight: calls queued on each actor. 1 (the default) holds the fewest of a mini-batch's
        tiny-batches away from the local workers (measured best on one node: experiments/README.md,
        remote workers); 2 lets an actor start its next call while a result travels back, for
        networks whose round trip is long against a call's compute.
    per_call: tiny-batches sent in one call (at most; fewer when the queue holds fewer): Ray's cost
        -- the training process's CPU above all -- is per call, so 2 halves it per tiny-batch.
    take: which end of the size-sorted queue the actors take from: "back" (the largest tiny-batches,
        as the accelerator does: the most compute per byte sent back) or "front" (the smallest).
    runtime_env: passed to the actors (e.g. {"py_modules": [fusionflow]}), None for the cluster's.
    startup_timeout: seconds to wait for the actors that fit in the cluster to come up.
    init_kwargs: extra keyword arguments for `ray.init` (e.g. num_cpus of a local instance).
    call_timeout: seconds a tiny-batch may be away at the gateway (sent, not back) before the gateway
        counts as unresponsive: it is killed, what it held runs on the local workers, and a new one is
        tried at the next epoch or after a back-off (10 s, doubling). None (the default): 20x the mean round trip
        measured, at least 10 s.
        A call on one actor away for half of it ends that actor only (killed and replaced, its tiny-batches
        run locally; measured: the next bound is twice that call's time, so slow calls are not ended for
        ever); MAX_FAILURES such calls in a row retire the remote workers for the loader's run.

    In an actor, `torch.utils.data.get_worker_info()` and the RNGs are set as in a local worker: ids follow the
    local workers', num_workers is the local workers' plus `num_workers` (with "auto": the actor's id + 1), the
    seed is the loader's base seed + id; then `worker_init_fn(id)` runs.
    """

    def __init__(
        self,
        num_workers: int | str = "auto",
        address: str | None = None,
        cpus_per_worker: float = 1,
        in_flight: int = 1,
        take: str = "back",
        runtime_env: dict | None = None,
        startup_timeout: float = 60.0,
        init_kwargs: dict | None = None,
        per_call: int = 2,
        call_timeout: float | None = None,
    ):
        if not ray_installed():  # fail here, with the install hint, not when the loader starts
            raise ImportError(INSTALL_HINT)
        if num_workers != "auto" and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1
        ):
            raise ValueError(f"{num_workers=} must be an integer >= 1 or 'auto'")
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise TypeError(f"address={address!r} must be None, 'auto', 'host:port' or 'ray://host:port'")
        if not _seconds(cpus_per_worker):  # (a finite number > 0: nan and inf failed in the gateway, in Ray's hands)
            raise ValueError(f"{cpus_per_worker=} must be a finite number > 0")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"{in_flight=} must be an integer >= 1")
        if isinstance(per_call, bool) or not isinstance(per_call, int) or per_call < 1:
            raise ValueError(f"{per_call=} must be an integer >= 1")
        if take not in TAKE:
            raise ValueError(f"take={take!r} must be one of {TAKE}")
        if not _seconds(startup_timeout):
            raise ValueError(f"{startup_timeout=} must be a number of seconds > 0")
        if call_timeout is not None and not _seconds(call_timeout):
            raise ValueError(f"{call_timeout=} must be None (measured) or a number of seconds > 0")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise TypeError(f"init_kwargs={init_kwargs!r} must be None or a dict of ray.init's keyword arguments")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise TypeError(f"runtime_env={runtime_env!r} must be None or a dict (Ray's runtime_env)")
        self.num_workers, self.address, self.cpus_per_worker = num_workers, address, cpus_per_worker
        self.in_flight, self.take, self.runtime_env, self.per_call = in_flight, take, runtime_env, per_call
        self.startup_timeout, self.init_kwargs = startup_timeout, dict(init_kwargs or {})
        self.call_timeout = call_timeout

    def __repr__(self) -> str:
        return (
            f"RayWorkers({self.num_workers!r}, address={self.address!r}, cpus_per_worker={self.cpus_per_worker}, "
            f"in_flight={self.in_flight}, per_call={self.per_call}, take={self.take!r})"
        )


def _reachable(address: str, seconds: float) -> None:
    """ConnectionError unless something listens at the address's host:port (a `ray://` one's too)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return  # no port given: Ray's own default and error apply
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=seconds).close()  # [IPv6]
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {host}:{port}: {exc}") from None


def _join_running(ray, config: RayWorkers, kwargs: dict) -> bool:
    """address None: RAY_ADDRESS or `ray start`'s cluster, as ray.init(address=None) finds one; "auto" also any Ray
    instance a process on this machine runs (Ray's legacy scan; with None too before session 50: a job's own
    ray.init() in another Python environment was joined, and its workers could not import the dataset). False:
    none, or a loader's private instance (left alone: it stops with that loader)."""
    try:
        found = started_cluster() if config.address is None else "auto"
        if found is None:
            raise ConnectionError("no cluster started with `ray start` and no RAY_ADDRESS")
        if found != "auto":
            _reachable(found, min(PROBE_S, config.startup_timeout))  # `ray start`'s file outlives its cluster
        ray.init(address=found, **kwargs)
        if PRIVATE not in ray.cluster_resources():
            return True
        ray.shutdown()  # another loader's gateway started it for itself (and stops it with that loader)
    except ConnectionError:  # no cluster is running: start a local one
        if config.address == "auto":
            log.warning(
                "RayWorkers(address='auto'): no running Ray cluster found (RAY_ADDRESS, or `ray "
                "start` on this machine); starting a local Ray instance for the remote workers"
            )
    return False


def started_cluster() -> str | None:
    """The cluster ray.init(address=None) joins: RAY_ADDRESS, else the address the last `ray start` on this machine
    wrote into Ray's temp folder (its file stays after `ray stop`'s cluster is gone: the caller probes it); None."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env
    try:
        from ray._private.utils import read_ray_address  # Ray's own reader of `ray start`'s address file
    except ImportError:  # another Ray's layout: where Ray 2.60 keeps it
        temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        path = os.path.join(temp, "ray", "ray_current_cluster")
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError:
            return None
    return read_ray_address() or None


def _seconds(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def connect(config: RayWorkers, joined: str | None = None):
    """In the gateway process: ray.init as `config.address` says (`joined`: the address of the
    training process's own Ray instance, joined first). Returns (the ray module, whether this
    started a local instance)."""
    ray = import_ray()
    kwargs = {"include_dashboard": False, "logging_level": logging.WARNING, **config.init_kwargs}
    if joined is not None and config.address in (None, "auto"):
        ray.init(address=joined, **kwargs)
        return ray, False, None
    if config.address not in (None, "auto"):  # a named cluster: it must be there
        try:
            _reachable(config.address, min(PROBE_S, config.startup_timeout))  # ray.init retries for minutes
            ray.init(address=config.address, **kwargs)
        except ConnectionError as exc:
            raise ConnectionError(
                f"RayWorkers(address={config.address!r}): no Ray cluster there ({exc}). "
                "Start one (`ray start --head` / your cluster launcher), or pass "
                "address=None to start a local one"
            ) from exc
        except ValueError as exc:  # Ray's word on an address it cannot parse, without its traceback
            raise ConnectionError(
                f"RayWorkers(address={config.address!r}): Ray does not take this address ({exc}); give "
                "'host:port' of a cluster's head, 'ray://host:port', 'auto', or None for a local instance"
            ) from exc
        return ray, False, None
    if _join_running(ray, config, kwargs):
        return ray, False, None
    if config.num_workers != "auto" and "num_cpus" not in kwargs:
        want, cores = int(-(-config.num_workers * config.cpus_per_worker // 1)), len(os.sched_getaffinity(0))
        if want > cores:  # RayWorkers(64) without a cluster put 64 actors (~600 MB each) on the training machine
            log.warning(
                "RayWorkers(%d) found no Ray cluster: the local Ray instance it starts gets this machine's %d cores "
                "(room for %d Ray workers); name a cluster (address=...) for more",
                config.num_workers,
                cores,
                max(1, int(cores // config.cpus_per_worker)),
            )
        kwargs["num_cpus"] = max(min(want, cores), math.ceil(config.cpus_per_worker))  # (room for one at least)
    # the local instance's actors are this job's data workers: at Ray's default worker niceness (15) any
    # busy process on the node starves them (beside two busy loops an actor took ~95 s to start)
    os.environ.setdefault("RAY_worker_niceness", "0")
    kwargs["resources"] = {**kwargs.get("resources", {}), PRIVATE: 1}  # marked: no other loader joins it
    context = ray.init(address="local", **kwargs)
    log.info(
        "fusionflow started a local Ray instance for its remote workers (%s CPUs)",
        ray.cluster_resources().get("CPU"),
    )
    return ray, True, context.address_info.get("session_dir")
