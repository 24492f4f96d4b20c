"""The Ray actors of the remote worker kind (runtime/remote.py, a mixin of its RemoteWorkers): how
many to ask for, starting them, their start-up probe (can this node read the dataset?), replacing
lost ones and adding more as nodes join, and killing them. The attributes it uses (`ray`, `config`,
`actors`, `_cls`, `_dataset_ref`, ...) are RemoteWorkers'."""
from __future__ import annotations

import logging
import time

from fusionflow.errors import RemoteWorkerError

log = logging.getLogger("fusionflow.runtime.remote")
MAX_FAILURES = 4  # failed calls in a row before the remote workers retire; failed probes before no more are asked for


class Actor:
    """One Ray actor of the remote worker kind, as the training process tracks it."""

    def __init__(self, name: str, handle, probe_ref):
        self.name, self.handle, self.probe_ref = name, handle, probe_ref
        self.ready, self.host, self.inflight = False, "?", 0  # inflight: calls queued on it


class RemoteActors:
    def _wanted(self) -> int:
        """How many more actors to ask for now: up to the target, and no more than the free CPUs allow."""
        n = self.config.num_workers
        free = self.ray.available_resources().get("CPU", 0.0)
        fit = int(free // self.config.cpus_per_worker + 1e-9)
        if n == "auto":
            return fit if not any(not a.ready for a in self.actors) else 0
        return max(0, min(n - len(self.actors), fit))

    def _spawn(self) -> None:
        k = self._spawned
        self._spawned += 1
        options = {"num_cpus": self.config.cpus_per_worker, "max_restarts": 0}
        if self.config.runtime_env is not None:
            options["runtime_env"] = self.config.runtime_env
        handle = self._cls.options(**options).remote(self._dataset_ref, self.policy, self.seed,
                                                     self.first_worker_id + k, self.worker_init_fn)
        self.actors.append(Actor(f"ray{k}", handle, handle.probe.remote(0)))

    def _on_probe(self, actor: Actor, ref, at_start: bool) -> None:
        ray = self.ray
        try:
            info = ray.get(ref)
        except Exception as exc:  # it died before it came up (its node left), or its set-up failed
            if at_start:  # unpickling the dataset or the policy, worker_init_fn, the runtime_env, ...
                raise RemoteWorkerError(f"remote_workers: Ray worker {actor.name} failed to start:\n{exc}") from None
            log.warning("remote_workers: Ray worker %s did not start (%s)", actor.name, type(exc).__name__)
            self._drop(actor)
            self._probe_failed()
            return
        actor.host = info["host"]
        if info["error"] is not None:
            msg = (f"remote_workers: Ray worker {actor.name} on node {info['host']} cannot read the dataset there: "
                   f"{info['error'].splitlines()[0]}. Every Ray node must be able to read the dataset's files at "
                   f"the same path (a shared filesystem), or the dataset must carry its bytes; "
                   f"worker traceback:\n{info['error']}")
            if at_start:
                raise RemoteWorkerError(msg)
            if info["host"] not in self._bad_hosts:  # once per node, not at every replacement
                self._bad_hosts.add(info["host"])
                log.error("%s\n(this worker is left out)", msg)
            self._drop(actor)
            self._probe_failed()
            return
        actor.ready = True
        log.info("remote_workers: Ray worker %s ready on %s (pid %s)", actor.name, info["host"], info["pid"])

    def _probe_failed(self) -> None:
        """A worker asked for after start-up did not come up: after MAX_FAILURES of them, ask for no
        more (Ray may keep placing them on a node that cannot run them); those that run go on."""
        self._probe_failures += 1
        if self._probe_failures == MAX_FAILURES:
            log.warning("remote_workers: %d Ray workers asked for after start-up did not come up; asking for no "
                        "more (%d running)", self._probe_failures, self.live)

    def _drop(self, actor: Actor) -> None:
        if actor in self.actors:
            self.actors.remove(actor)
        self._kill(actor)

    def _kill(self, actor: Actor) -> None:
        try:
            self.ray.kill(actor.handle)
        except Exception:  # already gone with its node
            pass

    def _maintain(self) -> None:
        self._last_maintain = time.monotonic()
        if self.retired or self._stopped or self._probe_failures >= MAX_FAILURES:
            return
        try:
            for _ in range(self._wanted()):
                self._spawn()
        except Exception as exc:  # the cluster is unreachable for now: try again later
            log.info("remote_workers: could not ask for more Ray workers: %r", exc)
