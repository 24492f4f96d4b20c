"""The Ray gateway: the process that is Ray's driver for one loader's remote workers, so that the
training process never imports ray and never shares a fate with a raylet (`python -m
fusionflow.remote.gateway SOCKET_FD RING_FD PARENT_PID`, started by remote/link.py).

It connects to Ray (remote/config.py `connect`), starts the actors (remote/actors.py), and serves
its loader over one socket, as a CPU worker serves its pipe: TASK in (the tiny-batches the loader's
worker kind, remote/kind.py, took from its board), DONE out once the result is written into the
loader's batch ring (mapped from the descriptor the loader passed, as workers map it), and EVENT out
for the rest: ("session", folder) then ("started", info) or ("error", type name, message) at start-up,
("actors", table) when the actors change, ("back", task ids, why) for tiny-batches the local workers
must run, ("lost", actor, host, error), ("retired", why), and ("log", level, logger, message) for
FusionFlow's log records, which the loader logs as its own.

No polling: each Ray call's future wakes the main loop through a pipe, and the loop waits on that
pipe and the socket at once (`multiprocessing.connection.wait`), in slices of `WATCHDOG_S`: a
gateway whose loader is gone (its parent changed) shuts down like an orphaned worker.

Shutdown (STOP, the socket closing, orphaned): kill the actors, ray.shutdown() (stops a local instance it
started; orphaned, it removes that instance's folder too), exit. What it cannot stop itself (it was SIGKILLed,
Ray ended it) its loader stops: the gateway leads its own session, which the loader kills (runtime/procs.py).
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait

from fusionflow.remote.link import remove_session_dir
from fusionflow.remote.pulse import ACTOR_SHARE, CALL_FACTOR, Pulse, call_deadline, find_raylet, running_mean
from fusionflow.runtime.procs import parent_gone, parent_gone_within
from fusionflow.runtime.stuck import overslept

WATCHDOG_S = 0.5
MAINTAIN_S = 2.0  # how often missing actors are asked for again (replacements, nodes that joined)
log = logging.getLogger("fusionflow.remote.kind")


class _Forward(logging.Handler):
    """FusionFlow's log records, sent to the loader, which logs them under the same logger."""

    def __init__(self, send):
        super().__init__()
        self._send = send

    def emit(self, record) -> None:
        try:
            self._send(("log", record.levelno, record.name, record.getMessage()))
        except Exception:  # the loader is gone: nobody to tell
            pass


class Gateway:
    """One loader's Ray driver: its actors, the tiny-batches queued on them, the ring they go into."""

    def __init__(self, conn, ring, spec: dict, parent_pid: int):
        from fusionflow.runtime import messages as m

        self.m, self.conn, self.ring, self.spec, self.parent_pid = m, conn, ring, spec, parent_pid
        self.config, self.ray, self.actors = spec["config"], None, None
        self.session_dir, self.orphaned = None, False  # its own Ray instance's folder; the loader gone without a STOP
        self.fifo: collections.deque = collections.deque()  # tasks received, not yet on an actor
        self.calls: dict = {}  # ObjectRef -> (actor, [task, ...]) of one Ray call
        self.probes: dict = {}  # ObjectRef -> actor still starting (after start-up)
        self.finished: collections.deque = collections.deque()  # (ref, future) whose result is there
        self.failures_in_a_row, self.retired = 0, None  # retired: why no call is made any more
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        fcntl.fcntl(self._wake_w, fcntl.F_SETFL, os.O_NONBLOCK)
        self._next_maintain = time.monotonic() + MAINTAIN_S
        self.call_started: dict = {}  # ObjectRef -> when its call was made (monotonic), for the same calls
        self.call_mean, self.pulse = 0.0, None  # running mean of a call's time (made -> result), seconds

    def send(self, event: tuple) -> None:
        with self._send_lock:
            self.conn.send_bytes(self.m.pack_control(self.m.EVENT, event))

    # ---------------------------------------------------------------- start-up
    def start(self) -> None:
        """Connect, put the dataset into the object store, start the actors that fit, wait for their
        probes (remote/actors.py start_up: its errors go to the loader, which raises them)."""
        from fusionflow.remote import config as remote_config
        from fusionflow.remote.actors import RemoteActors

        spec = self.spec
        self.ray, started, self.session_dir = remote_config.connect(self.config, spec["joined"])
        self.send(("session", self.session_dir))  # first: a start-up that fails below still has it removed
        self.actors = RemoteActors(self.ray, self.config, spec)
        self.actors.start_up()
        self._watch_probes()
        self.send(("started", {"started_instance": started, "session_dir": self.session_dir, "actors": self.table()}))
        self.pulse = Pulse(self.send, find_raylet(_raylet_socket(self.ray)))
        self.pulse.start()

    def table(self) -> list:
        return [(a.number, a.name, a.host, a.pid, a.ready) for a in self.actors]

    def _watch(self, ref) -> None:
        """`ref`'s result wakes the main loop when it is there (Ray's thread runs the callback)."""

        def finished(future, ref=ref):
            self.finished.append((ref, future))
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):  # full: the loop is awake already; closed: shutting down
                pass

        ref.future().add_done_callback(finished)

    def _watch_probes(self) -> None:
        for a in self.actors:
            if not a.ready and a.probe_ref not in self.probes:
                self.probes[a.probe_ref] = a
                self._watch(a.probe_ref)

    # ---------------------------------------------------------------- the loop
    def serve(self) -> None:
        """Until STOP, the loader's socket closing, or the loader's death."""
        m = self.m
        while True:
            timeout, waited_from = max(0.0, min(WATCHDOG_S, self._next_maintain - time.monotonic())), time.monotonic()
            ready = mp_wait([self.conn, self._wake_r], timeout)
            if lost := overslept(time.monotonic() - waited_from, timeout):  # the whole job was stopped: no call was
                self.call_started = {ref: made + lost for ref, made in self.call_started.items()}  # away meanwhile
            if parent_gone(self.parent_pid):  # the loader's process is gone: no one else removes the session folder
                self.orphaned = True
                return
            if self.conn in ready:
                while self.conn.poll():
                    msg = self.conn.recv_bytes()  # EOFError: the loader closed
                    kind = m.kind_of(msg)
                    if kind == m.STOP:
                        return
                    if kind == m.TASK:
                        self.fifo.append(m.unpack_task(msg))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            while self.finished:
                self._on_finished(*self.finished.popleft())
            self._end_hung_calls()
            if time.monotonic() >= self._next_maintain:
                self._next_maintain = time.monotonic() + MAINTAIN_S
                if not self.retired:
                    n = len(self.actors)
                    self.actors.maintain()
                    self._watch_probes()
                    if len(self.actors) != n:
                        self.send(("actors", self.table()))
            self._fill()

    def _fill(self) -> None:
        """Queue calls on every ready actor with room (in turns, so each gets some); a call carries
        up to `per_call` tiny-batches (Ray's cost is per call). With no actor ready (the loader sent work
        before it heard of a loss), what is queued goes back at once: a replacement may never come up."""
        if self.retired:  # what the loader sent before it heard: back at once, not left to its call deadline
            if self.fifo:
                queued, self.fifo = list(self.fifo), collections.deque()
                self.send(("back", [t.task_id for t in queued], "retired"))
            return
        ready = [a for a in self.actors if a.ready]
        if not ready and self.fifo:
            queued, self.fifo = list(self.fifo), collections.deque()
            self.send(("back", [t.task_id for t in queued], "no Ray worker ready"))
            return
        for depth in range(1, self.config.in_flight + 1):
            for a in ready:
                if not self.fifo:
                    return
                if a.inflight >= depth:
                    continue
                tasks = [self.fifo.popleft() for _ in range(min(self.config.per_call, len(self.fifo)))]
                ref = a.handle.run_many.remote([(t.epoch, t.positions, t.indices, t.copies) for t in tasks])
                self.calls[ref] = (a, tasks)
                self.call_started[ref] = time.monotonic()
                a.inflight += 1
                self._watch(ref)

    def _on_finished(self, ref, future) -> None:
        actor = self.probes.pop(ref, None)
        if actor is not None:
            if actor in self.actors:
                self.actors.on_probe(actor, ref, at_start=False)
                self.send(("actors", self.table()))
            return
        entry = self.calls.pop(ref, None)
        made = self.call_started.pop(ref, None)
        if entry is None:  # its actor was lost meanwhile: its tiny-batches went back then
            return
        self.call_mean = running_mean(self.call_mean, time.monotonic() - made)
        actor, tasks = entry
        actor.inflight -= 1
        try:
            results, stage_ns = future.result()
            if not isinstance(results, list) or len(results) != len(tasks):  # another FusionFlow on the node?
                raise TypeError(f"{len(tasks)} tiny-batches sent, {type(results).__name__} back")
        except self.ray.exceptions.RayActorError as exc:
            self._lost(actor, tasks, exc)
            return
        except Exception as exc:  # the object was lost, or a bug on the actor: the local workers take it
            log.warning(
                "remote_workers: tiny-batches %s failed on Ray worker %s: %r; running them locally",
                [t.indices for t in tasks],
                actor.name,
                exc,
            )
            self._give_back(tasks, failed=True)
            return
        self._deliver(actor, tasks, results, stage_ns)

    def _deliver(self, actor, tasks, results, stage_ns) -> None:
        """Each result into its ring positions, then DONE (traced back to back over the call's compute
        time); one that cannot be written runs locally."""
        from fusionflow.runtime import targets

        end = time.monotonic_ns()
        start = end - sum(int(r[3] * 1e9) for r in results)
        failed = []
        for task, (images, labels, failures, seconds) in zip(tasks, results):
            side, bad = {}, {f.position for f in failures}
            where = f" on Ray worker {actor.name} (host {actor.host})"  # a file missing there only, say
            failures = [dataclasses.replace(f, what=f.what + where) for f in failures]
            try:
                for k, (pos, target) in enumerate(zip(task.positions, labels)):
                    if pos not in bad:
                        self.ring.images[task.slot, pos] = images[k]
                        targets.store(self.ring.labels[task.slot], pos, target, side)
            except Exception as exc:  # e.g. another FusionFlow version on the node returned another shape
                log.warning(
                    "remote_workers: the result of tiny-batch %s from Ray worker %s could not be written "
                    "(%r); running it locally",
                    task.indices,
                    actor.name,
                    exc,
                )
                failed.append(task)
                continue
            took = int(seconds * 1e9)
            msg = self.m.pack_done(
                task.task_id,
                task.generation,
                failures,
                start,
                start + took,
                stage_ns,
                targets=side,
                worker=actor.number,
            )
            stage_ns = ()  # the call's totals go with its first tiny-batch
            start += took
            with self._send_lock:
                self.conn.send_bytes(msg)
        if failed:
            self._give_back(failed, failed=True)
        elif tasks:
            self.failures_in_a_row = 0

    def _lost(self, actor, tasks, exc) -> None:
        """An actor died or its node went away: `tasks` (the call that found out) and every other
        tiny-batch queued on it go back (the local workers run them: it may have died of one), and a
        replacement is asked for later."""
        tasks = list(tasks) + [t for a, ts in self.calls.values() if a is actor for t in ts]
        for ref in [ref for ref, (a, _t) in self.calls.items() if a is actor]:
            del self.calls[ref]
            self.call_started.pop(ref, None)
        if actor in self.actors:
            self.actors.remove(actor)
        self.send(("back", [t.task_id for t in tasks], "lost"))
        self.send(("lost", actor.name, actor.host, type(exc).__name__, len(tasks)))
        self.send(("actors", self.table()))
        self.actors.kill(actor)

    def _give_back(self, tasks, failed: bool) -> None:
        """Tiny-batches that failed on the remote path (not a sample's fault) run locally; after
        MAX_FAILURES failed calls in a row the remote workers retire."""
        self.send(("back", [t.task_id for t in tasks], "failed"))
        if failed:
            self._failed_call()

    def _failed_call(self) -> None:
        """A call failed on the remote path or hung: MAX_FAILURES in a row retire the remote workers."""
        from fusionflow.remote.actors import MAX_FAILURES

        self.failures_in_a_row += 1
        if self.failures_in_a_row >= MAX_FAILURES and not self.retired:
            self.retired = f"{self.failures_in_a_row} calls in a row failed on the Ray workers"
            queued, self.fifo = list(self.fifo), collections.deque()
            self.send(("back", [t.task_id for t in queued], "retired"))
            self.send(("retired", self.retired))

    def _end_hung_calls(self) -> None:
        """A call away longer than ACTOR_SHARE of the call deadline (a stuck read, a stopped actor
        process) ends its actor, not this gateway: the actor is killed and replaced, and the call's
        tiny-batches, with the rest queued on that actor, run locally (as for a lost actor)."""
        if not self.call_started:
            return
        ref, made = next(iter(self.call_started.items()))  # the oldest call
        bound = ACTOR_SHARE * call_deadline(self.config.call_timeout, self.call_mean)
        away = time.monotonic() - made
        if ref not in self.calls:  # its actor was lost meanwhile
            del self.call_started[ref]
            return
        if away <= bound:
            return
        actor, tasks = self.calls[ref]
        log.warning(
            "remote_workers: a call on Ray worker %s returned nothing for %.0f s (bound %.0f s); that worker is "
            "killed and replaced, its tiny-batches run locally",
            actor.name,
            away,
            bound,
        )
        self.calls.pop(ref)
        self.call_started.pop(ref)
        actor.inflight -= 1
        # a call may be slow, not hung (nothing measured yet, or slower samples): the next bound is twice this one,
        # as the loader's call deadline doubles at this loss (remote/kind.py): an actor's bound stays half of it
        self.call_mean = max(self.call_mean, 2 * bound / (ACTOR_SHARE * CALL_FACTOR))
        self._lost(actor, tasks, TimeoutError(f"a call hung {away:.0f} s"))
        self._failed_call()  # hung calls in a row retire the remote workers (each killed an actor)

    def shutdown(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
        if self.actors is not None:
            self.actors.kill_all()
        if self.ray is not None and self.ray.is_initialized():
            self.ray.shutdown()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


def _raylet_socket(ray) -> str | None:
    """The socket of the raylet this driver is connected to (None if Ray does not say)."""
    try:
        here = ray.get_runtime_context().get_node_id()
        return next((n.get("RayletSocketName") for n in ray.nodes() if n.get("NodeID") == here), None)
    except Exception:
        return None


def _error(exc: BaseException) -> tuple:
    name = type(exc).__name__
    text = str(exc) if name in ("RemoteWorkerError", "TypeError", "ConnectionError") else traceback.format_exc()
    return ("error", name, text)


def main(argv) -> int:
    sock_fd, ring_fd, parent_pid = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    os.set_inheritable(sock_fd, False)  # Ray's processes started from here must not hold the loader's socket
    conn = Connection(sock_fd)
    head = pickle.loads(conn.recv_bytes())
    sys.path[:0] = [p for p in head["sys_path"] if p not in sys.path]  # the training process's modules
    gateway = ring = None
    try:
        spec = pickle.loads(head["spec"])  # cloudpickle's output (remote/link.py)
        logging.getLogger("fusionflow").setLevel(spec["log_level"])
        from fusionflow.runtime.shm import BatchRing

        ring = BatchRing(spec["layout"], fd=ring_fd)
        os.close(ring_fd)
        gateway = Gateway(conn, ring, spec, parent_pid)
        logging.getLogger("fusionflow").addHandler(_Forward(gateway.send))
        logging.getLogger("fusionflow").propagate = False
        gateway.start()
    except BaseException as exc:
        from fusionflow.runtime import messages as m

        try:
            conn.send_bytes(m.pack_control(m.EVENT, _error(exc)))
        except OSError:  # the loader is gone (a SIGTERM or SIGKILL while its Ray workers started): its folder is ours
            if gateway is not None:
                gateway.orphaned = parent_gone_within(parent_pid, 5.0)
        if gateway is not None:
            gateway.shutdown()
            remove_session_dir(gateway.session_dir if gateway.orphaned else None)  # (else its loader's to remove)
        return 1
    try:
        gateway.serve()
    except (EOFError, OSError):  # the loader's end closed without a STOP: its process is ending (SIGTERM, SIGKILL)
        gateway.orphaned = parent_gone_within(parent_pid, 5.0)
    finally:
        gateway.shutdown()
        ring.close()
        remove_session_dir(gateway.session_dir if gateway.orphaned else None)  # (its loader's to remove, if alive)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
