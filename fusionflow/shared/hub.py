"""The producer's side of its clients: who is attached, which ring slots each still holds, and the thread that serves
their connections.

`Hub` owns the listening socket, the rendezvous record (fusionflow/shared/rendezvous.py), every client's connection,
and the slot holds: a slot published to an epoch's recipients is held by each of them until it says "release" (it
copied the batch out), says "drop" (it left the epoch), or is detached (its connection closed: close(), exit, SIGKILL
-- the kernel closes a dead process's socket, so a dead client is seen at once; or let go: a client stopped for
STOPPED_S while holding slots). Messages to a client go through its outbox (fusionflow/shared/outbox.py): written at
once where its socket has room, else by the hub's thread when it has, so a client slow to read delays only itself. A
slot that nobody holds any more goes back to the producer (`on_free`, called with the lock held). A detached client's
connection is shut down *before* its holds are released, so a client resumed later finds it hung up after copying a
batch whose slot may have been reused, and raises instead of returning it (client.py `_copy`).

Threads: the hub's thread accepts, authenticates (both ways, and the peer's uid) and reads clients; the producer's main
thread (fusionflow/shared/producer.py) begins epochs, publishes batches and ends epochs. Both work under one Condition
(`cond`), which the producer also waits on for slots; a connection is closed, and the selector changed, only by the
hub's thread (the main thread marks a client gone, or its outbox waiting, and wakes it).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field

from fusionflow.runtime.authsock import (
    HANDSHAKE_S,
    SEND_TIMEOUT_S,
    accept,
    hang_up,
    listen,
    recv_whole,
    set_receive_timeout,
)
from fusionflow.runtime.procs import is_stopped, pid_alive
from fusionflow.runtime.shm import send_fd
from fusionflow.shared import rendezvous
from fusionflow.shared.outbox import Outbox, send_plain

log = logging.getLogger("fusionflow.shared")
STOPPED_S = 10.0  # a client stopped this long while holding slots is let go (the others go on)


@dataclass(eq=False)
class Client:
    cid: int
    conn: object  # multiprocessing.connection.Connection
    pid: int
    holds: dict = field(default_factory=dict)  # slot -> (epoch, seq) this client has not released
    ready: bool = False  # it accepted the producer's terms (batch size): it counts, and gets epochs
    gone: str | None = None  # why it was detached (its connection is closed by the hub's thread)
    stopped_since: float | None = None  # monotonic time it was first seen stopped while holding slots
    seen_pid: int = 0  # its pid as the kernel tells it here (SO_PEERCRED; 0 where its pid namespace hides it)
    outbox: Outbox | None = None  # messages its socket has not taken yet
    writing: bool = False  # its outbox waits: the hub's thread watches its socket for room (or is told to)


def _weakly(method):
    """A weak handle on a bound method (None: none): called, the method, or None once its object is gone."""
    return weakref.WeakMethod(method) if method is not None else lambda: None


def address_of(name: str, uid: int) -> str:
    """A new abstract socket address for producer `name`: the name's first 32 characters only, as an abstract
    address holds 107 bytes and a uid may have 10 digits (a 64-character name did not fit past 7)."""
    return f"fusionflow-shared-{uid}-{name[:32]}-{secrets.token_hex(8)}"


def _hub_thread(ref) -> None:
    """The hub's thread: it holds its Hub only for a turn, so a SharedLoader dropped without close() is collected
    and closed (producer.py `_dropped`), where a thread running a bound method kept it, its workers and its name
    taken until the process exited."""
    while (hub := ref()) is not None and hub.turn():
        del hub


def _unpublish(name: str, pid: int) -> None:
    """Remove the record, in the process that wrote it only (a forked child inherits atexit hooks)."""
    if os.getpid() == pid:
        rendezvous.remove(name, pid)


class Hub:
    def __init__(self, name: str, ring_fd: int, hello, on_free):
        """`hello(running)`: the Hello a new client gets; `on_free(slot)`: a slot nobody holds."""
        self.name, self.cond = name, threading.Condition()
        self._hello, self._on_free = _weakly(hello), _weakly(on_free)  # the SharedLoader's: not kept alive by this
        self.clients: dict[int, Client] = {}
        self.holders: dict[int, set] = {}  # slot -> cids holding it
        self.stamps: dict[int, tuple] = {}  # slot -> (epoch, seq) it was published as
        self.recipients: set = set()  # cids the running epoch goes to
        self._to_watch: list[Client] = []  # clients whose outbox began waiting: watched for room at the turn's end
        self.running: tuple | None = None  # [epoch, published] while an epoch runs
        self._next_cid = 0
        self._stopping = False
        self._stop_check = 0.0  # when `_let_go_of_stopped` last looked
        self._ro_fd = rendezvous.read_only_fd(ring_fd)
        self._secret = secrets.token_bytes(32)
        self.address = address_of(name, os.getuid())
        self._listener = listen(self.address)
        self._wake_r, self._wake_w = os.pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:  # the look for a live producer of the name and the publish: one step, under the name's lock
            existing = rendezvous.publish(name, self.address, self._secret)
        except BaseException:  # the lock held by a stopped process past its bound, a Ctrl-C
            self._close_fds()
            raise
        if existing is not None:
            self._close_fds()
            if existing["pid"] == os.getpid():  # a notebook cell run again: the old one is still bound
                raise ValueError(
                    f"a SharedLoader named {name!r} is already serving in this process: close() it (or `del` it) "
                    "before making another of that name, or give this one another name"
                )
            raise ValueError(
                f"a SharedLoader named {name!r} is already serving on this node (pid {existing['pid']}): "
                "give this one another name, or stop that one"
            )
        self.path = rendezvous.path_of(name)
        # at close, at collection, or at interpreter exit when close() never ran
        self._unpublish = weakref.finalize(self, _unpublish, name, os.getpid())
        self._thread = threading.Thread(
            target=_hub_thread, args=(weakref.ref(self),), name=f"fusionflow-shared-{name}", daemon=True
        )
        self._thread.start()

    def _close_fds(self) -> None:  # a Hub that did not start
        self._sel.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w, self._ro_fd):
            os.close(fd)

    # ---------------------------------------------------------------- the producer's main thread (lock held)
    def live(self) -> list[Client]:
        return [c for c in self.clients.values() if c.gone is None and c.ready]

    def begin_epoch(self, epoch: int, batches: int) -> None:
        self.running = [epoch, 0]
        self.recipients = {c.cid for c in self.live()}
        for cid in list(self.recipients):
            self._send(self.clients[cid], ("epoch", epoch, batches))

    def publish(self, slot: int, n: int, targets) -> None:
        """The running epoch's next batch is in `slot`: every recipient holds it until it releases it."""
        epoch, seq = self.running
        self.running[1] += 1
        if not self.recipients:
            self._freed(slot)
            return
        self.holders[slot], self.stamps[slot] = set(self.recipients), (epoch, seq)
        for cid in self.recipients:
            self.clients[cid].holds[slot] = (epoch, seq)
        for cid in list(self.recipients):  # a client that fails here is detached: its hold goes with it
            self._send(self.clients[cid], ("batch", epoch, seq, slot, n, targets))

    def end_epoch(self) -> None:
        epoch, batches = self.running
        for cid in list(self.recipients):
            self._send(self.clients[cid], ("end", epoch, batches))
        self.running, self.recipients = None, set()

    def held_slots(self) -> set:
        return set(self.holders)

    def laggards(self) -> list[int]:
        """The pids of the live clients holding the oldest published batch."""
        if not self.stamps:
            return []
        oldest = min(self.stamps, key=self.stamps.get)
        return sorted(self.clients[cid].pid for cid in self.holders.get(oldest, ()) if cid in self.clients)

    def broadcast(self, msg) -> None:
        for c in self.live():
            self._send(c, msg)

    def close(self) -> None:
        """Stop accepting and serving, close every connection (clients see the end), remove the record. What the
        clients' outboxes hold (the last batches, the parting word) gets SEND_TIMEOUT_S to be taken first."""
        with self.cond:
            deadline = time.monotonic() + SEND_TIMEOUT_S
            while any(c.gone is None and c.outbox.pending for c in self.clients.values()):
                if (left := deadline - time.monotonic()) <= 0 or not self._thread.is_alive():
                    break
                self.cond.wait(min(left, 0.5))
            self._stopping = True
            for c in self.clients.values():
                self._detach(c, "the producer closed")
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        self._unpublish()
        for fd in (self._wake_r, self._wake_w, self._ro_fd):
            os.close(fd)

    # ---------------------------------------------------------------- holds (lock held)
    def _free(self, slot: int) -> None:
        self.holders.pop(slot, None)
        self.stamps.pop(slot, None)
        self._freed(slot)
        self.cond.notify_all()

    def _freed(self, slot: int) -> None:
        on_free = self._on_free()
        if on_free is not None:
            on_free(slot)

    def _release(self, c: Client, slot: int, stamp: tuple) -> None:
        if c.holds.get(slot) != stamp:  # a release of an older use of the slot, or of a dropped epoch
            return
        del c.holds[slot]
        held = self.holders.get(slot)
        if held is not None:
            held.discard(c.cid)
            if not held:
                self._free(slot)

    def _drop_epoch(self, c: Client, epoch: int) -> None:
        for slot, stamp in list(c.holds.items()):
            if stamp[0] == epoch:
                self._release(c, slot, stamp)
        if self.running is not None and self.running[0] == epoch:
            self.recipients.discard(c.cid)
        self.cond.notify_all()

    def _detach(self, c: Client, why: str) -> None:
        if c.gone is not None:
            return
        c.gone = why
        hang_up(c.conn)  # before its slots can be reused: a resumed client must see it (module doc)
        self.recipients.discard(c.cid)
        for slot, stamp in list(c.holds.items()):
            self._release(c, slot, stamp)
        log.info("fusionflow: SharedLoader %r: client pid %d detached (%s)", self.name, c.pid, why)
        self.cond.notify_all()
        if threading.current_thread() is not self._thread:
            os.write(self._wake_w, b"x")  # its connection is closed by the hub's thread

    def _send(self, c: Client, msg) -> None:
        if c.gone is not None:
            return
        try:
            waiting = c.outbox.put(msg)
        except OSError as exc:  # a dead client (EPIPE, ECONNRESET)
            self._detach(c, f"sending failed: {exc!r}")
            return
        if waiting and not c.writing:  # the hub's thread watches its socket from its turn's end on
            c.writing = True
            self._to_watch.append(c)
            if threading.current_thread() is not self._thread:
                os.write(self._wake_w, b"x")

    def _write(self, c: Client) -> None:
        """The hub's thread: `c`'s socket has room for what its outbox holds."""
        with self.cond:
            if c.gone is not None:
                return
            try:
                waiting = c.outbox.flush()
            except OSError as exc:
                self._detach(c, f"sending failed: {exc!r}")
                return
            if not waiting:
                c.writing = False
                self._sel.modify(c.conn, selectors.EVENT_READ, c)
                self.cond.notify_all()  # close() waits for outboxes to empty

    def _let_go_of_stopped(self) -> None:
        """Detach a client that has been stopped for STOPPED_S while holding slots: a stopped process
        never releases them, and the producer (so every other client) would wait for it forever. So would
        a dead one whose connection a child it forked still holds open (no end-of-file comes): detached."""
        now = time.monotonic()
        if now - self._stop_check < 1.0:  # once a second, not per message (each reads /proc)
            return
        self._stop_check = now
        for c in list(self.clients.values()):
            if c.gone is None and c.seen_pid > 0 and not pid_alive(c.seen_pid):
                self._detach(c, "its process is gone (a child it forked held its connection open)")
            elif c.gone is not None or not c.holds or not is_stopped(c.pid):
                c.stopped_since = None
            elif c.stopped_since is None:
                c.stopped_since = now
            elif now - c.stopped_since >= STOPPED_S:
                log.warning(
                    "fusionflow: SharedLoader %r: client pid %d has been stopped for %.0f s holding %d batches: "
                    "detached, so the producer and the other clients go on (resumed, it raises SharedLoaderError)",
                    self.name,
                    c.pid,
                    now - c.stopped_since,
                    len(c.holds),
                )
                self._detach(c, f"stopped for {now - c.stopped_since:.0f} s")

    # ---------------------------------------------------------------- the hub's thread
    def turn(self) -> bool:
        """One turn of the hub's thread (at most a second's wait); False once it stopped."""
        for key, events in self._sel.select(timeout=1.0):
            if key.data is None:
                self._admit()
            elif key.data == "wake":
                os.read(self._wake_r, 4096)
            else:
                if events & selectors.EVENT_WRITE:
                    self._write(key.data)
                if events & selectors.EVENT_READ and key.data.gone is None:
                    self._read(key.data)
        with self.cond:
            self._let_go_of_stopped()
            for c in self._to_watch:
                if c.gone is None and c.writing:
                    self._sel.modify(c.conn, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
            self._to_watch.clear()
            for c in [c for c in self.clients.values() if c.gone is not None]:
                self._sel.unregister(c.conn)
                c.conn.close()
                c.outbox.close()
                del self.clients[c.cid]
            if not self._stopping:
                return True
        self._sel.close()
        self._listener.close()
        return False

    def _admit(self) -> None:
        conn = accept(self._listener, self._secret, f"SharedLoader {self.name!r}")
        if conn is None:
            return
        try:
            with socket.socket(fileno=os.dup(conn.fileno())) as s:
                seen, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise PermissionError(f"peer uid {uid} is not this user's")
            set_receive_timeout(conn, HANDSHAKE_S)
            kind, pid = conn.recv()
            set_receive_timeout(conn, 0)
            if kind != "attach":
                raise ValueError(f"expected 'attach', got {kind!r}")
        except Exception as exc:
            log.warning("fusionflow: SharedLoader %r refused a connection: %r", self.name, exc)
            conn.close()
            return
        with self.cond:
            if self._stopping:
                conn.close()
                return
            c = Client(self._next_cid, conn, int(pid), seen_pid=seen)
            self._next_cid += 1
            hello = self._hello()
            if hello is None:  # its SharedLoader is being collected
                conn.close()
                return
            try:
                send_plain(conn, ("hello", hello(None if self.running is None else tuple(self.running))))
                send_fd(conn, self._ro_fd)
            except OSError:
                conn.close()
                return
            c.outbox = Outbox(conn)
            self.clients[c.cid] = c
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _read(self, c: Client) -> None:
        why = "its connection closed"
        try:
            msg = pickle.loads(recv_whole(c.conn))
        except TimeoutError as exc:  # stopped in the middle of a message: it would hold this thread, and every client
            stopped = f"stopped in the middle of a message ({exc})"
            msg, why = None, f"it {stopped}"
            log.warning("fusionflow: SharedLoader %r: client pid %d %s: letting it go", self.name, c.pid, stopped)
        except (EOFError, OSError, pickle.UnpicklingError):
            msg = None
        with self.cond:
            if c.gone is not None:
                return
            if msg is None:
                self._detach(c, why)
            elif msg[0] == "ready":
                c.ready = True
                log.info("fusionflow: SharedLoader %r: client pid %d attached", self.name, c.pid)
                self.cond.notify_all()
            elif msg[0] == "release":
                self._release(c, msg[3], (msg[1], msg[2]))
            elif msg[0] == "drop":
                self._drop_epoch(c, msg[1])
            elif msg[0] == "ping":
                self._send(c, ("pong",))
            else:
                self._detach(c, f"it sent {msg[0]!r}")
