"""Remote CPU workers: Ray actors as a third kind of worker beside the local CPU processes and the
accelerator (configuration: remote/config.py; the actors: remote/actors.py; the actor's body:
remote/task.py, the local workers' per-sample code, so the same bytes). README "More CPUs than the node has" and its
measurements say why the defaults are what they are.

A thread in the training process ("fusionflow-remote") keeps `in_flight` calls of up to `per_call`
tiny-batches queued on each ready actor, waits on all of them at once (`ray.wait`), writes each
result into its ring positions and completes it on the board: take under `cond`, wait and write
outside it, complete under it, as the accelerator does. `take="back"` takes the oldest mini-batch's
largest tiny-batches (as the accelerator does), "front" the smallest (as the local workers do).

Faults: an actor that dies, or whose node goes away (`RayActorError`), loses nothing: its
tiny-batches in flight go back to the front of their mini-batches for the local workers, the loss is
counted (`counters.remote_workers_lost`) and logged once, and a replacement is asked for (Ray places it
when the cluster has room; with `num_workers="auto"` actors are added as nodes join). A result for an
abandoned iterator is dropped, never written; one that cannot be written runs locally.

Start-up (`start`): the dataset must pickle (a TypeError naming it), and every actor reads one sample
where it runs before it gets work (a RemoteWorkerError naming the node, the sample and the exception).
Shutdown (`stop`, idempotent; the manager's shutdown calls it first): stop and join the thread, give
back what is in flight, kill the actors, release Ray (the last user shuts down an instance FusionFlow
started or connected).
"""

from __future__ import annotations

import logging
import threading
import time

from fusionflow.errors import RemoteWorkerError
from fusionflow.remote import config as remote_config
from fusionflow.remote.actors import MAX_FAILURES, Actor, RemoteActors
from fusionflow.runtime import targets

log = logging.getLogger(__name__)
POLL_S = 0.005  # longest wait for a result before looking for new work again
MAINTAIN_S = 2.0  # how often missing actors are asked for again (replacements, nodes that joined)


class RemoteWorkers:
    """The Ray worker kind on a board (runtime/board.py WorkerKind: start(), stop(), busy_with_stale());
    its actors are `self.actors` (remote/actors.py), from start() on. It counts remote tiny-batches
    and lost actors into `counters` (runtime/counters.py; the board's own when None)."""

    def __init__(
        self, board, config, dataset, policy, seed: int, counters=None, first_worker_id: int = 0, worker_init_fn=None
    ):
        self.board, self.config, self.dataset, self.policy, self.seed = board, config, dataset, policy, seed
        self.counters = counters if counters is not None else board.counters
        self.first_worker_id, self.worker_init_fn = first_worker_id, worker_init_fn
        self.ray = None
        self.actors: RemoteActors | None = None  # from start() on
        self.inflight: dict = {}  # ObjectRef -> (actor, [work, ...] of one call, sent at ns), in submission order
        self.failures_in_a_row = 0
        self.retired: str | None = None
        self._writing = None  # the works whose results are being written into the ring
        self._counted = False  # this kind holds a use of FusionFlow's Ray connection (remote/config.py connect)
        self._last_maintain = 0.0
        self._started = self._stopped = False
        self._thread = threading.Thread(target=self._run, name="fusionflow-remote", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Connect, put the dataset into the object store, start the actors that fit and wait until
        each has read a sample where it runs. Raises TypeError (dataset cannot be pickled),
        RemoteWorkerError (an actor cannot read the dataset), ConnectionError (no cluster at address)."""
        if self._started:
            return
        self._started = True
        self.ray, self._counted = remote_config.connect(self.config)
        try:
            self.actors = RemoteActors(
                self.ray, self.config, self.dataset, self.policy, self.seed, self.first_worker_id, self.worker_init_fn
            )
            self.actors.start_up()
        except BaseException:
            self.stop()
            raise
        self._thread.start()

    def stop(self) -> None:
        """Idempotent: stop the thread, kill the actors, release Ray."""
        if self._stopped:
            return
        board = self.board
        with board.cond:
            self._stopped = True
            board.cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                log.warning(
                    "remote_workers: the remote worker thread did not stop within 10 s (stuck in a Ray "
                    "call); its actors are killed and Ray released without it"
                )
        ray = self.ray
        if ray is None:
            return
        with board.cond:
            lost = [work for _a, works, _t in self.inflight.values() for work in works]
            self.inflight.clear()
            board.requeue(lost)
        if self.actors is not None:
            self.actors.kill_all()
        if self._counted:
            remote_config.release()
            self._counted = False
        self.ray = None

    def busy_with_stale(self, generation: int) -> bool:
        """Lock held. Results of older iterators are dropped, not written: only a write under way counts."""
        return any(work.generation != generation for work in self._writing or ())

    @property
    def live(self) -> int:
        """Actors ready for work."""
        return self.actors.live if self.actors is not None else 0

    # ---------------------------------------------------------------- actors
    def _lost(self, actor: Actor, exc) -> bool:
        """Lock held: an actor died; its tiny-batches go back, counted and logged once. True: the
        caller kills it (once the lock is released)."""
        if actor not in self.actors:
            return False
        works = [work for a, ws, _t in self.inflight.values() if a is actor for work in ws]
        for ref in [ref for ref, (a, _w, _t) in self.inflight.items() if a is actor]:
            del self.inflight[ref]
        for work in works:  # it may have died of one of them: local workers run them, where a sample that
            work.cpu_only = True  # kills processes is isolated and counted against max_retries
        self.board.requeue(works)
        self.counters.remote_workers_lost += 1
        log.warning(
            "remote_workers: Ray worker %s on %s was lost (%s); re-running its %d tiny-batches, and asking "
            "the cluster for a replacement",
            actor.name,
            actor.host,
            type(exc).__name__,
            len(works),
        )
        self.actors.remove(actor)
        return True  # the caller kills it, without the lock (a Ray call)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        board, ray = self.board, self.ray
        try:
            while True:
                with board.cond:
                    if self._stopped:
                        return
                    if not self.retired:
                        self._fill()
                    refs = list(self.inflight)
                starting = [a.probe_ref for a in self.actors if not a.ready]
                if time.monotonic() - self._last_maintain > MAINTAIN_S:
                    self._last_maintain = time.monotonic()
                    if not self.retired and not self._stopped:
                        self.actors.maintain()
                if not refs and not starting:
                    with board.cond:
                        if not self._stopped:
                            board.cond.wait(0.1)  # submit() notifies
                    continue
                ready, _ = ray.wait(refs + starting, num_returns=1, timeout=POLL_S)
                if ready:  # everything else already there too
                    ready, _ = ray.wait(refs + starting, num_returns=len(refs) + len(starting), timeout=0)
                for ref in ready:
                    actor = next((a for a in self.actors if a.probe_ref is ref and not a.ready), None)
                    if actor is not None:
                        self.actors.on_probe(actor, ref, at_start=False)
                    elif ref in self.inflight:
                        self._on_result(ref)
        except Exception:  # a bug here must not hang training: give everything back to the local workers
            log.exception("remote_workers: the remote worker thread failed; local workers take over")
            with board.cond:
                self.retired = "the remote worker thread failed"
                board.requeue([work for _a, works, _t in self.inflight.values() for work in works])
                self.inflight.clear()
            board.wake()

    def _fill(self) -> None:
        """Lock held: queue calls on every ready actor with room (in turns, so each gets some); a call
        carries up to `per_call` tiny-batches (Ray's cost is per call: README, remote workers measured)."""
        board = self.board
        if board.draining():
            return
        if self.config.take == "back":  # one tiny-batch per take (max_images 0), the largest left
            take = lambda: next(iter(board.take_accel(largest_first=True)), None)  # noqa: E731
        else:
            take = board.take_cpu
        ready = [a for a in self.actors if a.ready]
        for depth in range(1, self.config.in_flight + 1):
            for a in ready:
                if a.inflight >= depth:
                    continue
                works = []
                while len(works) < self.config.per_call:
                    work = take()
                    if work is not None and work.cpu_only:  # given back by a remote path or the accelerator:
                        board.requeue([work])  # the local workers' own
                        work = None
                    if work is None:
                        break
                    works.append(work)
                if works:
                    try:
                        ref = a.handle.run_many.remote([(w.epoch, w.positions, w.indices, w.copies) for w in works])
                    except BaseException:  # e.g. Ray was shut down under us: the work must not vanish
                        board.requeue(works)
                        raise
                    self.inflight[ref] = (a, works, time.monotonic_ns())
                    a.inflight += 1
                if len(works) < self.config.per_call:
                    return  # nothing more to take now

    def _on_result(self, ref) -> None:
        """One finished call: its results written into the ring and completed on the board, or its
        tiny-batches given back to the local workers when the call failed."""
        actor, works, _sent = self.inflight[ref]
        results = self._fetch(ref, actor, works)
        if results is not None:
            todo = self._accept(ref, actor, works, results)
            if todo is not None:
                self._complete(actor, *self._write_all(actor, todo))
        self.board.wake()

    def _fetch(self, ref, actor, works):
        """The call's results, or None when it failed (the actor is counted lost, or its tiny-batches
        go back to the local workers)."""
        ray, board = self.ray, self.board
        try:
            results = ray.get(ref)
            if not isinstance(results, list) or len(results) != len(works):  # another FusionFlow on the node?
                raise RemoteWorkerError(f"{len(works)} tiny-batches sent, {type(results).__name__} back")
            return results
        except ray.exceptions.RayActorError as exc:
            with board.cond:
                kill = self._lost(actor, exc)
                board.cond.notify_all()
            if kill:
                self.actors.kill(actor)
        except Exception as exc:  # the object was lost, or a bug on the actor: the local workers take it
            log.warning(
                "remote_workers: tiny-batches %s failed on Ray worker %s: %r; running them locally",
                [w.indices for w in works],
                actor.name,
                exc,
            )
            with board.cond:
                if not self._stopped and self.inflight.pop(ref, None) is not None:  # stopped: stop() gives back
                    actor.inflight -= 1
                    self._give_back(works)
        return None

    def _accept(self, ref, actor, works, results):
        """Lock taken: the call leaves the in-flight table; returns the (work, result) pairs of the
        current generation to write (an abandoned iterator's are dropped, never written), or None
        when stop() has taken the call back."""
        board = self.board
        with board.cond:
            if self._stopped or self.inflight.pop(ref, None) is None:  # stopped: stop() gives them back
                return None
            actor.inflight -= 1
            todo = [(w, r) for w, r in zip(works, results) if w.generation == board.generation]
            self._writing = [w for w, _r in todo]
        return todo

    def _write_all(self, actor, todo):
        """Without the lock: each result into its ring positions; returns (done, failed)."""
        done, failed = [], []
        for work, result in todo:
            try:
                done.append((work, result, self._write(work, result)))
            except Exception as exc:  # e.g. another FusionFlow version on the node returned another shape
                log.warning(
                    "remote_workers: the result of tiny-batch %s from Ray worker %s could not be written "
                    "(%r); running it locally",
                    work.indices,
                    actor.name,
                    exc,
                )
                failed.append(work)
        return done, failed

    def _complete(self, actor, done, failed) -> None:
        """Lock taken: written tiny-batches complete on the board (traced back to back over the call's
        compute time); unwritten ones run locally."""
        board = self.board
        with board.cond:
            self._writing = None
            if done:
                self.failures_in_a_row = 0
            if failed:
                self._give_back(failed)
            start = time.monotonic_ns() - sum(int(r[3] * 1e9) for _w, r, _s in done)  # the call's compute, back to back
            for work, (_images, _labels, failures, seconds), side in done:
                self.counters.remote_tiny_batches += 1
                if board.trace is not None:
                    board.trace.tiny_batch(actor.name, work, start, start + int(seconds * 1e9), board.sizes)
                start += int(seconds * 1e9)
                board.complete(work, failures, on_accelerator=False, targets=side)
            board.cond.notify_all()

    def _write(self, work, result) -> dict:
        """A tiny-batch's result into its ring positions (without the lock: the positions are this
        work's alone); returns its targets that are not ints (runtime/targets.py)."""
        images, labels, failures, _seconds = result
        side, bad = {}, {f.position for f in failures}
        ring = self.board.ring
        for k, (pos, target) in enumerate(zip(work.positions, labels)):
            if pos in bad:
                continue
            ring.images[work.slot, pos] = images[k]
            targets.store(ring.labels[work.slot], pos, target, side)
        return side

    def _give_back(self, works) -> None:
        """Lock held: a call's tiny-batches that failed on the remote path (not a sample's fault) run
        locally; after MAX_FAILURES failed calls in a row the remote workers retire."""
        for work in works:
            work.cpu_only = True
        self.board.requeue(works)
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= MAX_FAILURES and not self.retired:
            self._retire(f"{self.failures_in_a_row} calls in a row failed on the Ray workers")

    def _retire(self, why: str) -> None:
        """Lock held: the actors take no more work."""
        self.retired = why
        log.warning(
            "remote_workers: retired for the rest of this loader's run (%s); the local workers take every tiny-batch",
            why,
        )
