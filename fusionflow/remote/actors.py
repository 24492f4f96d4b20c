"""The Ray actors of one Ray gateway (remote/gateway.py holds them as `self.actors`; runs in the
gateway process only): the dataset in the object store, how many actors to ask for, starting them,
their start-up probe (can this node read the dataset?), replacing lost ones and adding more as nodes
join, and killing them. The gateway keeps what is in flight on them and decides when they take work."""

from __future__ import annotations

import itertools
import logging
import time

from fusionflow.errors import RemoteWorkerError
from fusionflow.remote.task import actor_class

log = logging.getLogger("fusionflow.remote.kind")
MAX_FAILURES = 4  # failed calls in a row before the remote workers retire; failed probes before no more are asked for
SETTLE_S = 3.0  # start-up: how long to wait for CPUs that are being released to fit the asked-for actors


class Actor:
    """One Ray actor of the remote worker kind, as the training process tracks it."""

    def __init__(self, number: int, handle, probe_ref, worker_id: int):
        self.number, self.name, self.handle, self.probe_ref = number, f"ray{number}", handle, probe_ref
        self.worker_id = worker_id  # get_worker_info().id on it: a replacement takes the id its predecessor left
        self.ready, self.host, self.pid, self.inflight = False, "?", None, 0  # inflight: calls queued on it


class RemoteActors:
    """The actors asked for so far and not lost: iterate, index, `len()` and `in` see them (ready or
    still probing), in the order they were asked for. Used by the kind's thread (and by its stop()
    once that thread has ended)."""

    def __init__(self, ray, config, spec: dict):
        """Put the `spec`'s dataset into Ray's object store (a TypeError naming it if it cannot be pickled); no
        actor is asked for yet (`start_up`). `spec`: remote/kind.py's (dataset, policy, seed, first_worker_id,
        worker_init_fn, base_seed, stages: the stage names actors time, or None, cache_side: the decoded-image
        cache's max_side, rendered without its store, or None)."""
        self.ray, self.config, self.spec, dataset = ray, config, spec, spec["dataset"]
        try:
            self._dataset_ref = ray.put(dataset)
        except Exception as exc:
            raise TypeError(
                f"remote_workers: the dataset {type(dataset).__name__} cannot be pickled to send it "
                f"to the Ray workers ({type(exc).__name__}: {exc}). Keep no open files, locks or "
                "lambdas in its attributes (open them lazily in __getitem__), or use "
                "remote_workers=None"
            ) from exc
        self._cls = actor_class(ray)
        self._actors: list[Actor] = []
        self._spawned = 0  # actors asked for, ever: names them (ray0, ray1, ...)
        self._probe_failures = 0  # actors asked for after start-up that did not come up
        self._bad_hosts: set = set()  # nodes where an actor could not read the dataset

    def __iter__(self):
        return iter(list(self._actors))

    def __len__(self) -> int:
        return len(self._actors)

    def __getitem__(self, k: int) -> Actor:
        return self._actors[k]

    def __contains__(self, actor) -> bool:
        return actor in self._actors

    @property
    def live(self) -> int:
        """Actors that passed their probe."""
        return sum(1 for a in self._actors if a.ready)

    # ---------------------------------------------------------------- start-up
    def start_up(self) -> None:
        """Ask for the actors that fit now and wait until each has read a sample where it runs: a
        RemoteWorkerError names the actor, node and exception of one that cannot, or says that none
        came up within `config.startup_timeout`. With no free CPU at all, only a warning: they are
        asked for again as the cluster frees CPUs (`maintain`)."""
        ray, config = self.ray, self.config
        for _ in range(self.wanted()):
            self.spawn()
        # CPUs a loader closed a moment ago (this one's previous epoch, without persistent_workers) come
        # back within a second or so: wait for them briefly rather than start short of workers
        settle = time.monotonic() + min(SETTLE_S, config.startup_timeout)
        while config.num_workers != "auto" and len(self._actors) < config.num_workers and time.monotonic() < settle:
            time.sleep(0.05)
            for _ in range(self.wanted()):
                self.spawn()
        if not self._actors:
            log.warning(
                "remote_workers: the Ray cluster has no free CPU for a worker of %s CPUs now; local workers "
                "run everything until one frees up",
                config.cpus_per_worker,
            )
            return
        deadline = time.monotonic() + config.startup_timeout
        pending = {a.probe_ref: a for a in self._actors}
        while pending and time.monotonic() < deadline:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                actor = pending.pop(ref)
                self.on_probe(actor, ref, at_start=True)
        if not any(a.ready for a in self._actors):
            raise RemoteWorkerError(
                f"remote_workers: none of the {len(self._actors)} Ray workers started within "
                f"startup_timeout={config.startup_timeout} s (cluster resources: "
                f"{ray.cluster_resources()}); check the cluster, or raise startup_timeout"
            )

    def wanted(self) -> int:
        """How many more actors to ask for now: up to the target, and no more than the free CPUs allow."""
        n, cpus = self.config.num_workers, self.config.cpus_per_worker
        # the free CPUs less those of actors still probing: Ray counts an actor's CPUs only once it is placed, so one
        # asked for a moment ago looked free, a second was asked for that could never fit, and start-up waited for
        # its probe the whole startup_timeout (a placed one counted twice only delays an actor to `maintain`)
        free = self.ray.available_resources().get("CPU", 0.0) - cpus * sum(not a.ready for a in self._actors)
        fit = int(max(0.0, free) // cpus + 1e-9)
        if n == "auto":
            return fit if not any(not a.ready for a in self._actors) else 0
        return max(0, min(n - len(self._actors), fit))

    def spawn(self) -> None:
        k = self._spawned
        self._spawned += 1
        options = {"num_cpus": self.config.cpus_per_worker, "max_restarts": 0}
        if self.config.runtime_env is not None:
            options["runtime_env"] = self.config.runtime_env
        s, held = self.spec, {a.worker_id for a in self._actors}
        # the lowest id no actor holds: within first + range(num_workers), as a local replacement keeps its slot's id
        # (a count of every actor asked for gave the replacements ids past num_workers: a worker_init_fn sharding
        # by id, or checking it, failed on each and the remote workers were given up)
        worker_id = next(i for i in itertools.count(s["first_worker_id"]) if i not in held)
        auto = self.config.num_workers == "auto"  # (then as many as there are, a replacement's id among them)
        workers = max([worker_id, *held]) + 1 if auto else s["first_worker_id"] + self.config.num_workers
        seeding = (s["base_seed"], worker_id, workers)  # as a local worker's (DataLoader's): RNGs and worker info
        handle = self._cls.options(**options).remote(
            self._dataset_ref, s["policy"], s["seed"], seeding, s["worker_init_fn"], s["stages"], s["cache_side"]
        )
        self._actors.append(Actor(k, handle, handle.probe.remote(0), worker_id))

    def on_probe(self, actor: Actor, ref, at_start: bool) -> None:
        """`actor`'s probe answered: it is ready, or (at start-up) a RemoteWorkerError, or (later) it is
        dropped and logged (once per node that cannot read the dataset)."""
        ray = self.ray
        try:
            info = ray.get(ref)
        except Exception as exc:  # it died before it came up (its node left), or its set-up failed
            if at_start:  # unpickling the dataset or the policy, worker_init_fn, the runtime_env, ...
                raise RemoteWorkerError(f"remote_workers: Ray worker {actor.name} failed to start:\n{exc}") from None
            log.warning("remote_workers: Ray worker %s did not start (%s)", actor.name, type(exc).__name__)
            self.drop(actor)
            self._probe_failed()
            return
        actor.host, actor.pid = info["host"], info["pid"]
        if info["error"] is not None:
            msg = (
                f"remote_workers: Ray worker {actor.name} on node {info['host']} cannot read the dataset there: "
                f"{info['error'].splitlines()[0]}. Every Ray node must be able to read the dataset's files at "
                f"the same path (a shared filesystem), or the dataset must carry its bytes; "
                f"worker traceback:\n{info['error']}"
            )
            if at_start:
                raise RemoteWorkerError(msg)
            if info["host"] not in self._bad_hosts:  # once per node, not at every replacement
                self._bad_hosts.add(info["host"])
                log.error("%s\n(this worker is left out)", msg)
            self.drop(actor)
            self._probe_failed()
            return
        actor.ready = True
        log.info("remote_workers: Ray worker %s ready on %s (pid %s)", actor.name, info["host"], info["pid"])

    def _probe_failed(self) -> None:
        """An actor asked for after start-up did not come up: after MAX_FAILURES of them, ask for no
        more (Ray may keep placing them on a node that cannot run them); those that run go on."""
        self._probe_failures += 1
        if self._probe_failures == MAX_FAILURES:
            log.warning(
                "remote_workers: %d Ray workers asked for after start-up did not come up; asking for no "
                "more (%d running)",
                self._probe_failures,
                self.live,
            )

    def maintain(self) -> None:
        """Ask for missing actors (replacements, nodes that joined), unless too many did not come up."""
        if self._probe_failures >= MAX_FAILURES:
            return
        try:
            for _ in range(self.wanted()):
                self.spawn()
        except Exception as exc:  # the cluster is unreachable for now: try again later
            log.info("remote_workers: could not ask for more Ray workers: %r", exc)

    # ---------------------------------------------------------------- losing and killing
    def remove(self, actor: Actor) -> None:
        """Forget `actor` (lost: its node went away or it died); the caller kills it."""
        self._actors.remove(actor)

    def drop(self, actor: Actor) -> None:
        if actor in self._actors:
            self._actors.remove(actor)
        self.kill(actor)

    def kill(self, actor: Actor) -> None:
        try:
            self.ray.kill(actor.handle)
        except Exception:  # already gone with its node
            pass

    def kill_all(self) -> None:
        """Kill every actor and forget them, and the dataset's object reference."""
        actors, self._actors = self._actors, []
        for a in actors:
            self.kill(a)
        self._dataset_ref = None
