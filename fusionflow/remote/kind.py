"""Remote CPU workers: Ray actors as a third kind of worker beside the local CPU processes and the
accelerator (configuration: remote/config.py). The training process never imports ray: a gateway
process (remote/gateway.py, started and ended by remote/link.py) is Ray's driver, starts and feeds
the actors and writes their results into the ring itself; this kind, in the training process, only
moves tiny-batches between the board and the gateway's socket, as the worker pool does with a
worker's pipe. README "More CPUs than the node has" says why the defaults are what they are.

Two threads: "fusionflow-remote" takes work from the board (under `cond`; `take="back"` takes the
oldest mini-batch's largest tiny-batches, as the accelerator does, "front" the smallest, as the
local workers do) up to what the gateway's ready actors can hold (`in_flight` calls of `per_call`
tiny-batches each) and sends it; "fusionflow-gateway-reader" blocks on the socket and completes what
comes back (DONE), requeues what the gateway gives back (a lost actor, a failed call) and logs the
gateway's log records as its own.

Faults: an actor that dies or whose node goes away loses nothing (the gateway gives its tiny-batches
back for the local workers, counted in `counters.remote_workers_lost`, and asks for a replacement).
The gateway may die (its raylet died: the OOM killer's usual pick is its dashboard agent) or be
killed by this kind when its pulse falls silent or it holds a tiny-batch past the call deadline
(remote/pulse.py). Then what it held goes back to the local workers as a dead worker's does, one
warning says how it ended and its last Ray error, its session (its Ray instance, what Ray left) is
killed, the epoch goes on, and a new gateway is started at the next epoch or after a back-off; after
`MAX_GATEWAY_FAILURES` in a row with nothing delivered between them the remote workers retire.

Start-up (`start`, on the training thread): the dataset must pickle (a TypeError naming it), and every actor reads
one sample where it runs before it gets work (the gateway's RemoteWorkerError naming the node, the sample and the
exception); a gateway killed or stopped meanwhile is a GatewayLost, restarted as after a death. Shutdown (`stop`):
stop the threads, STOP the gateway (it kills its actors and a Ray instance it started), kill its session.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from fusionflow.remote.link import GatewayLink, GatewayLost, GatewayState, forward_log, pickle_spec
from fusionflow.remote.pulse import CALL_FACTOR, call_deadline, running_mean, silence
from fusionflow.runtime import messages as m
from fusionflow.runtime.spec import RuntimeSpec
from fusionflow.runtime.stuck import overslept

log = logging.getLogger(__name__)
_LOST = "remote_workers: Ray worker %s on %s was lost (%s); its %d tiny-batches run again, a replacement is asked for"
MAX_GATEWAY_FAILURES = 3  # gateway deaths (or failed restarts) in a row before the remote workers retire
BACKOFF_S = 10.0  # a new gateway after this long (doubling with each failure), or at the next epoch


class ActorInfo(NamedTuple):
    """One Ray actor as the gateway last reported it."""

    number: int
    name: str
    host: str
    pid: int | None
    ready: bool


class RemoteWorkers:
    """The Ray worker kind on a board (runtime/board.py WorkerKind: start(), stop(), busy_with_stale()).
    `actors` and `live`: the gateway's actors as it last reported them; `retired`: why the kind takes
    no more work, or None; `sessions`: the pid of every gateway started (each led its own session)."""

    def __init__(
        self,
        board,
        config,
        dataset,
        spec: RuntimeSpec,
        counters=None,
        on_stage_times=None,
    ):
        """`config`: the RayWorkers; `spec`: the local runtime's (the actors augment with its policy,
        seed, worker_init_fn, base_seed and stage names; their worker ids follow the local workers')."""
        self.board, self.config, self.dataset, self.spec = board, config, dataset, spec
        self.counters = counters if counters is not None else board.counters
        self.on_stage_times = on_stage_times  # callback(actor name, stage ns totals) under the lock
        self.actors, self.retired = [], None  # list[ActorInfo]; why the remote workers stopped taking work
        self.sessions: list[int] = []
        self._spec: bytes | None = None
        self._gw: GatewayState | None = None  # the running gateway, if any
        self._starting: GatewayLink | None = None  # a gateway in its start-up handshake
        self._task_ids = 0
        self._round_trip = 0.0  # running mean of a tiny-batch's time away (sent -> DONE), seconds
        self._deaths_in_a_row = 0
        self._restart_gen, self._retry_at = None, 0.0  # when a new gateway is due (after a death)
        self._restart_epoch = None  # the newest epoch queued at that death: a later one is the next epoch
        self._started = self._stopped = False
        self._thread = threading.Thread(target=self._feed, name="fusionflow-remote", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Pickle the spec, start the gateway and wait until its actors are up. Raises TypeError
        (dataset cannot be pickled), RemoteWorkerError (an actor cannot read the dataset, or none
        came up), ConnectionError (no cluster at address), GatewayLost (the gateway killed or stopped while it
        started: the kind runs on and starts another at the next epoch or after the back-off)."""
        if self._started:
            return
        self._started = True
        from fusionflow.remote.config import app_address

        self._spec = pickle_spec(
            {
                "config": self.config,
                "dataset": self.dataset,
                "policy": self.spec.policy,
                "seed": self.spec.seed,
                "first_worker_id": self.spec.num_workers,
                "worker_init_fn": self.spec.worker_init_fn,
                "base_seed": self.spec.base_seed,
                "stages": self.spec.stages,
                "cache_side": self.spec.cache.max_side if self.spec.cache is not None else None,  # its rendering
                "layout": self.board.ring.layout,
                "joined": app_address(),
                "log_level": logging.getLogger("fusionflow.remote").getEffectiveLevel(),
            }
        )
        try:
            self._launch()  # raises the start-up errors
        except GatewayLost as exc:  # a fault, not the configuration's: a new gateway later, as after a death
            with self.board.cond:
                self._failed(str(exc).removeprefix("remote_workers: "), self.board.generation)
            self._thread.start()
            raise
        self._thread.start()

    def _launch(self) -> bool:
        """Start a gateway, wait for its actors (raises its start-up's errors); False: stopped or retired meanwhile."""
        link = GatewayLink(self._spec, self.board.ring.fd)
        with self.board.cond:
            self.sessions.append(link.pid)
            if self._stopped:
                link.discard()
                return False
            self._starting = link
        try:
            info = link.wait_started(self.config.startup_timeout + 60.0)  # + connecting, starting Ray
        except BaseException:
            link.discard()
            raise
        finally:
            with self.board.cond:
                self._starting = None
        gw, link.session_dir = GatewayState(link), info.get("session_dir") or link.session_dir
        gw.reader = threading.Thread(target=self._read, args=(gw,), name="fusionflow-gateway-reader", daemon=True)
        with self.board.cond:
            if self._stopped or self.retired:  # stop() (or retirement) came during the handshake
                link.discard()
                return False
            self._gw = gw
            self._set_actors(info["actors"])
            self.board.cond.notify_all()
            gw.reader.start()  # before stop() can find `gw` (it joins the reader)
        return True

    def stop(self) -> None:
        """Idempotent: stop the threads and the gateway (and its session), give back what it held."""
        board = self.board
        with board.cond:
            if self._stopped:
                return
            self._stopped = True
            gw, starting = self._gw, self._starting
            board.cond.notify_all()
        if starting is not None:
            starting.kill()  # its handshake ends with an error the feeder thread drops
        if gw is not None:
            gw.link.stop()  # the reader sees the socket close and gives back what was in flight
            gw.reader.join(timeout=10.0)
            gw.link.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def busy_with_stale(self, generation: int) -> bool:
        """Lock held: the gateway writes every tiny-batch it holds (it knows no generations), so an
        older iterator's tiny-batches count until they are back."""
        gw = self._gw
        return gw is not None and any(w.generation != generation for w in gw.outstanding.values())

    @property
    def live(self) -> int:
        """Actors ready for work."""
        return sum(1 for a in self.actors if a.ready)

    def _set_actors(self, table) -> None:
        self.actors = [ActorInfo(*row) for row in table]

    # ---------------------------------------------------------------- the feeding thread
    def _feed(self) -> None:
        board = self.board
        try:
            while True:
                with board.cond:
                    while True:
                        if self._stopped:
                            return
                        gw = self._gw
                        overdue = gw is not None and self._overdue(gw)
                        if overdue:
                            break
                        if gw is not None and not self.retired:
                            works = self._take(gw)
                            if works:
                                break
                        elif gw is None and not self.retired and self._restart_due():
                            works = None
                            break
                        waited_from = time.monotonic()
                        board.cond.wait(1.0)
                        if gw is not None and (lost := overslept(time.monotonic() - waited_from, 1.0)):
                            gw.skip(lost)  # the whole job was stopped: its silence and calls skip the pause
                if overdue:  # its reader sees the socket close and requeues what it held
                    gw.link.kill()
                    continue
                if works is None:
                    self._restart()
                    continue
                for task_id, w in works:
                    gw.link.send(
                        m.pack_task(m.Task(task_id, w.generation, w.slot, w.epoch, w.positions, w.indices, w.copies))
                    )
        except Exception:  # a bug here must not hang training: the local workers take everything
            log.exception("remote_workers: the remote worker thread failed; local workers take over")
            with board.cond:
                self.retired = "the remote worker thread failed"
                gw = self._gw
            if gw is not None:  # killed first (its calls in flight write into the ring); its reader requeues its work
                gw.link.kill()
            board.wake()

    def _take(self, gw: GatewayState) -> list:
        """Lock held: (task id, work) for the gateway, up to what its ready actors can hold."""
        board, config = self.board, self.config
        room = self.live * config.in_flight * config.per_call - len(gw.outstanding)
        if room <= 0 or board.draining():
            return []
        if config.take == "back":  # one tiny-batch per take (max_images 0), the largest left
            take = lambda: next(iter(board.take_accel(largest_first=True)), None)  # noqa: E731
        else:
            take = board.take_cpu
        works, now = [], time.monotonic()
        while len(works) < room:
            work = take()
            if work is not None and work.cpu_only:  # given back by a remote path or the accelerator:
                board.requeue([work])  # the local workers' own
                work = None
            if work is None:
                break
            self._task_ids += 1
            gw.outstanding[self._task_ids] = work
            gw.sent_at[self._task_ids] = now
            works.append((self._task_ids, work))
        return works

    def call_deadline(self) -> float:
        """Seconds a tiny-batch may be away at the gateway before the gateway counts as unresponsive:
        RayWorkers(call_timeout=...), or a multiple of the mean round trip (remote/pulse.py)."""
        return call_deadline(self.config.call_timeout, self._round_trip)

    def _overdue(self, gw: GatewayState) -> bool:
        """Lock held: whether `gw` fell silent (no pulse) or held a tiny-batch past the call deadline
        (it is marked, once)."""
        if gw.unresponsive is not None:
            return False
        now = time.monotonic()
        gw.unresponsive = silence(gw.heard_at, now)
        if gw.unresponsive is None and gw.sent_at:
            away, deadline = now - min(gw.sent_at.values()), self.call_deadline()
            if away > deadline:
                gw.unresponsive = f"returned nothing for {away:.0f} s (call deadline {deadline:.0f} s) and was killed"
        return gw.unresponsive is not None

    def _restart_due(self) -> bool:  # at the next epoch (iterator, or with persistent workers a later epoch queued)
        board = self.board  # or after the back-off, whichever comes first
        new_epoch = board.generation != self._restart_gen or board.queue.newest_epoch != self._restart_epoch
        return new_epoch or self._retry_in() <= 0

    def _retry_in(self) -> float:
        return self._retry_at - time.monotonic()

    def _restart(self) -> None:
        """A new gateway (on this thread: a fresh process, no fork of the training process)."""
        generation = self.board.generation
        try:
            up = self._launch()
        except Exception as exc:
            with self.board.cond:
                if self._stopped:
                    return
                why = f"a new Ray gateway could not start ({type(exc).__name__}: {str(exc).splitlines()[0]})"
                log.warning("remote_workers: %s", why)
                self._failed(why, generation)
            return
        if up:
            log.warning("remote_workers: a new Ray gateway is up (%d Ray workers ready)", self.live)

    def _failed(self, why: str, generation: int) -> None:
        """Lock held: a gateway died or failed to start in iterator `generation`: retire, or retry (`_restart_due`)."""
        self._deaths_in_a_row += 1
        if self._deaths_in_a_row >= MAX_GATEWAY_FAILURES:
            self._retire(f"{why}; {self._deaths_in_a_row} Ray gateways in a row failed")
            return
        self._restart_gen, self._restart_epoch = generation, self.board.queue.newest_epoch
        self._retry_at = time.monotonic() + BACKOFF_S * 2 ** (self._deaths_in_a_row - 1)

    def _retire(self, why: str) -> None:
        """Lock held: no more work for the remote workers this run (their calls failed, or gateways did)."""
        self.retired = why
        log.warning(
            "remote_workers: retired for the rest of this loader's run (%s); the local workers take every tiny-batch",
            why,
        )

    # ---------------------------------------------------------------- the reading thread
    def _read(self, gw: GatewayState) -> None:
        board, conn = self.board, gw.link.conn
        try:
            while True:
                msg = conn.recv_bytes()
                with board.cond:
                    self._on_message(gw, msg)
        except (EOFError, OSError):
            pass  # the gateway ended (stopped, or died)
        except Exception:
            log.exception("remote_workers: a message from the Ray gateway could not be read; it is stopped")
            gw.link.kill()  # first: alive, its calls in flight would write into slots reused once requeued
        with board.cond:  # first of all, what it held goes to the local workers
            died_in = board.generation
            works = list(gw.outstanding.values())
            gw.outstanding.clear()
            board.requeue(works)
            if self._gw is gw:
                self._gw = None
                self.actors = []
            lost = not self._stopped  # counted now: stop() may come while its session is killed below
            self.counters.remote_gateways_lost += lost
            if lost:  # no new gateway before this death is accounted below (the feeding thread started one at once)
                self._restart_gen, self._retry_at = died_in, float("inf")
                self._restart_epoch = board.queue.newest_epoch
        board.wake()
        gw.link.kill()  # whatever ended it: its Ray processes go with it (this may take seconds)
        with board.cond:
            if lost:
                why = f"the Ray gateway (pid {gw.link.pid}) {gw.unresponsive or gw.link.how_it_ended()}"
                if gw.last_error:
                    why += f"; its last Ray error: {gw.last_error}"
                if gw.delivered:  # failures in a row: gateways that died with nothing delivered
                    self._deaths_in_a_row = 0
                if not self.retired:  # (retired meanwhile: nothing to restart)
                    self._failed(why, died_in)
                then = "" if self.retired else f"; a new gateway at the next epoch or in {self._retry_in():.0f} s"
                log.warning("remote_workers: %s; its %d tiny-batches run on the local workers%s", why, len(works), then)
            board.cond.notify_all()

    def _on_message(self, gw: GatewayState, msg: bytes) -> None:
        """Lock held: a DONE (complete it on the board) or an EVENT from the gateway (its pulse, too)."""
        board, gw.heard_at = self.board, time.monotonic()
        if m.kind_of(msg) == m.DONE:
            task_id, _gen, failures, side = m.unpack_done(msg)
            work = gw.outstanding.pop(task_id, None)
            if work is None:
                return
            away = time.monotonic() - gw.sent_at.pop(task_id)
            self._round_trip = running_mean(self._round_trip, away)
            gw.delivered += 1
            self.counters.remote_tiny_batches += 1
            if board.trace is not None or self.on_stage_times is not None:
                started, ended, stage_ns = m.unpack_done_times(msg)
                name = f"ray{m.unpack_done_worker(msg)}"
                if board.trace is not None:
                    board.trace.tiny_batch(name, work, started, ended, board.sizes)
                if stage_ns and self.on_stage_times is not None:
                    self.on_stage_times(name, stage_ns)
            board.complete(work, failures, on_accelerator=False, targets=side)
            return
        event = m.unpack_control(msg)
        what = event[0]
        if what == "log":
            forward_log(event)
            if event[1] >= logging.WARNING:
                gw.last_error = event[3].splitlines()[0]
        elif what == "actors":
            self._set_actors(event[1])
            board.cond.notify_all()
        elif what == "back":
            works = [w for w in (gw.outstanding.pop(t, None) for t in event[1]) if w is not None]
            for t in event[1]:
                gw.sent_at.pop(t, None)
            for work in works:  # a lost actor may have died of one: the local workers isolate such samples
                work.cpu_only = True
            board.requeue(works)
        elif what == "lost":
            _what, name, host, error, n = event
            self.counters.remote_workers_lost += 1
            gw.last_error = f"Ray worker {name} on {host} lost ({error})"
            if error == "TimeoutError":  # a call ended as hung: the gateway doubled its bound, the deadline doubles
                self._round_trip = max(self._round_trip, 2 * self.call_deadline() / CALL_FACTOR)
            log.warning(_LOST, name, host, error, n)
        elif what == "retired":
            self._retire(event[1])
