"""SharedLoaderClient: a training job's end of a SharedLoader (fusionflow/shared/producer.py).

    loader = SharedLoaderClient("sweep1", batch_size=64, device="cuda:0")
    for epoch in range(90):
        for images, labels in loader:      # one producer epoch per iter(), as a DataLoader
            ...

Attaching: the client waits (up to `timeout`) for a producer of that name to appear, connects and
authenticates (fusionflow/shared/rendezvous.py), and maps the producer's ring from the read-only
descriptor it is handed. It starts at the producer's next epoch: one that is already under way is
not joined half-way (a log line says so once).

A batch: each producer mini-batch announced on the connection is copied out of the ring into a
tensor this process owns (page-locked with `pin_memory`, then moved to `device`) and released at
once, so the producer can reuse its slot; a client batch is `batch_size // producer's` whole
mini-batches, or a piece of one when batch_size divides the producer's (the slot is released after
its last piece). The last partial batch follows the producer's drop_last.

Faults: an iterator dropped mid-epoch tells the producer it left the epoch ("drop"; the next iter()
is the next epoch); a producer that exits, is killed, closes or fails raises SharedLoaderError at
once; one that says nothing -- not even to a ping sent every second of waiting -- for `timeout`
seconds raises it too. A client stopped (SIGSTOP, a debugger) for hub.STOPPED_S while holding batches
is let go by the producer so the other clients go on; resumed, it raises SharedLoaderError at its next
batch (never a batch whose slot was reused).
"""

from __future__ import annotations

import logging
import pickle
import select
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from fusionflow.errors import SharedLoaderError
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.authsock import recv_whole
from fusionflow.runtime.counters import append_bounded
from fusionflow.runtime.host import Host, resolve_device, resolve_pin_memory
from fusionflow.runtime.procs import pid_alive
from fusionflow.shared import rendezvous
from fusionflow.shared.hub import STOPPED_S

log = logging.getLogger("fusionflow.shared")
PING_S = 1.0  # a waiting client asks the producer whether it is there this often


@dataclass
class ClientStats:
    batches: int = 0
    samples: int = 0
    epochs: int = 0  # epochs iterated to their end
    wait_seconds: list = field(default_factory=list)  # per batch: time blocked waiting for the producer


def _check_batch_size(batch_size, producer: int) -> int:
    if batch_size is None:
        return producer
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1, or None (the producer's)")
    if batch_size % producer and producer % batch_size:
        fits = [d for d in range(1, producer + 1) if producer % d == 0][-3:] + [2 * producer, 4 * producer]
        raise ValueError(
            f"batch_size={batch_size} must be the producer's batch size ({producer}), a multiple of it or a "
            f"divisor of it, e.g. one of {fits}: client batches are whole producer batches or even pieces of one"
        )
    return batch_size


class SharedLoaderClient:
    """The batches of SharedLoader `name` on this node, as a DataLoader would give them.

    `batch_size`: None (the producer's), or the producer's times or divided by a whole number.
    `device`: where batches are delivered ("cpu", "cuda", "cuda:N"). `pin_memory`: "auto" (page-locked
    when CUDA is available), True or False. `timeout`: seconds to wait for the producer to appear, and
    for a word from it while waiting for a batch. Attaches at construction."""

    def __init__(self, name: str, batch_size: int | None = None, *, device="cpu", pin_memory="auto", timeout=30.0):
        self.name = rendezvous.check_name(name)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0")
        self.device = resolve_device(device, Host(), "SharedLoaderClient")
        if pin_memory == "auto":
            pin_memory = torch.cuda.is_available()
        if not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory={pin_memory!r} must be 'auto', True or False")
        notes: list[str] = []  # pinning is of the CPU staging tensor, whatever the device: the loader's rule
        pin_memory = resolve_pin_memory(pin_memory, torch.device("cpu"), torch.cuda.is_available, notes)
        for note in notes:
            log.warning("fusionflow: %s", note)
        self.timeout, self.pin_memory = float(timeout), pin_memory
        self.stats = ClientStats()
        if batch_size is not None:  # what needs no producer is checked before waiting for one
            _check_batch_size(batch_size, batch_size if isinstance(batch_size, int) and batch_size > 0 else 1)
        self._conn, self.producer, self._ring = rendezvous.attach(self.name, self.timeout)
        try:
            self.batch_size = _check_batch_size(batch_size, self.producer.batch_size)
        except ValueError:
            rendezvous.release(self._conn, self._ring)
            raise
        self._send(("ready",))
        self._finalizer = weakref.finalize(self, rendezvous.release, self._conn, self._ring)
        self._dropped: set = set()  # producer epochs this client left before their end
        self._iterator = None  # weakref to the newest iterator
        self.epoch = None  # the producer's epoch of the newest iteration
        if self.producer.running is not None:
            epoch, published = self.producer.running
            log.warning(
                "fusionflow: SharedLoader %r is in epoch %d (%d of %d batches published): this client starts at "
                "its next epoch, and iter() waits until then",
                self.name,
                epoch,
                published,
                self.producer.batches,
            )

    def __len__(self) -> int:
        p, b = self.producer, self.batch_size
        if b >= p.batch_size:
            k = b // p.batch_size
            return p.batches // k if p.drop_last else -(-p.batches // k)
        k = p.batch_size // b
        if p.drop_last:
            return p.batches * k
        return (p.samples // p.batch_size) * k + -(-(p.samples % p.batch_size) // b)

    def __iter__(self):
        old = self._iterator() if self._iterator is not None else None
        if old is not None:
            old.close()  # a newer iteration abandons the older one's epoch
        it = _ClientEpoch(self)
        self._iterator = weakref.ref(it)
        return it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Detach from the producer (its slots held by this client are released) and unmap its ring."""
        self._finalizer()

    # ---------------------------------------------------------------- the connection
    def _recv(self):
        """The next message from the producer, waiting at most `timeout` s for any word from it, and as long for the
        rest of a message once it began (a producer stopped part-way through a large one -- its targets, a batch's
        soft labels -- held the client in recv() for ever, whatever `timeout`)."""
        conn, pid = self._conn, self.producer.pid
        if conn.closed:
            raise SharedLoaderError(f"this client of SharedLoader {self.name!r} was closed")
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SharedLoaderError(
                    f"SharedLoader {self.name!r} (pid {pid}) said nothing for {self.timeout:g} s, not even to a "
                    "ping: it hangs or is stopped"
                )
            try:
                if not conn.poll(min(left / 2, PING_S)):  # (a ping at the deadline had no time for its pong)
                    conn.send(("ping",))
                    continue
                msg = pickle.loads(recv_whole(conn, rest_s=self.timeout))  # (the hub's outbox: pickled by value)
            except TimeoutError as exc:  # (before OSError: it is one)
                raise SharedLoaderError(
                    f"SharedLoader {self.name!r} (pid {pid}) stopped in the middle of a message ({exc}): it hangs "
                    "or is stopped"
                ) from None
            except (EOFError, OSError):
                raise self._gone() from None
            if msg[0] == "pong":
                deadline = time.monotonic() + self.timeout
            elif msg[0] in ("error", "finished"):
                raise self._parting(msg)
            else:
                return msg

    def _parting(self, msg) -> SharedLoaderError:
        """The producer's last word: it failed (`error`) or served all its epochs (`finished`)."""
        head = f"SharedLoader {self.name!r} (pid {self.producer.pid})"
        if msg[0] == "error":
            return SharedLoaderError(f"{head} failed: {msg[1]}")
        return SharedLoaderError(
            f"{head} finished after serving {msg[1]} epochs; this client iterated {self.stats.epochs}"
        )

    def _last_word(self) -> SharedLoaderError | None:
        """After a hang-up: the producer's last word, if it said one (it hangs up on every client as it ends)."""
        try:
            while self._conn.poll(0):
                msg = self._conn.recv()
                if msg[0] in ("error", "finished"):
                    return self._parting(msg)
        except (EOFError, OSError):
            pass
        return None

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except OSError:  # the producer is gone: the next receive says so
            pass

    def _copy(self, slot: int, rows: slice, out, out_labels, at: int) -> int:
        """Rows `rows` of ring slot `slot` into out[at:], out_labels[at:]; the number copied. Raises
        if the producer had detached this client by the end of the copy: it shuts the connection down
        before giving the client's slots back (hub.py), so the slot may hold another batch by now."""
        if self._conn.closed:
            raise SharedLoaderError(f"this client of SharedLoader {self.name!r} was closed")
        src = self._ring.images[slot][rows]
        np.copyto(out.numpy()[at : at + len(src)], src)
        np.copyto(out_labels.numpy()[at : at + len(src)], self._ring.labels[slot][rows])
        if self._hung_up() and (word := self._last_word() or (None if pid_alive(self.producer.pid) else self._gone())):
            raise word  # it ended (failed, finished, killed or exited): what it wrote last may be incomplete
        if self._hung_up():
            raise SharedLoaderError(
                f"SharedLoader {self.name!r} (pid {self.producer.pid}) detached this client while it held a "
                f"batch (a client stopped for {STOPPED_S:g} s or more is let go so the others go on): that "
                "batch's slot may hold other data by now, so it is not returned; attach a new client to go on"
            )
        return len(src)

    def _gone(self) -> SharedLoaderError:
        pid = self.producer.pid
        how = "exited" if not pid_alive(pid) else "closed its connection"
        if how == "exited":  # a SIGTERMed or SIGKILLed producer left its record: the client that saw it end removes it
            rendezvous.remove(self.name, pid)
        return SharedLoaderError(f"SharedLoader {self.name!r} (pid {pid}) is gone: it {how}")

    def _hung_up(self) -> bool:
        poll = select.poll()
        poll.register(self._conn.fileno(), select.POLLRDHUP | select.POLLHUP)
        return bool(poll.poll(0))

    def _alloc(self, rows: int):
        layout = self.producer.layout
        dtype = torch.from_numpy(np.empty(0, layout.dtype)).dtype
        images = torch.empty((rows, *layout.sample_shape), dtype=dtype, pin_memory=self.pin_memory)
        return images, torch.empty(rows, dtype=torch.int64, pin_memory=self.pin_memory)

    def _out(self, images, labels, objs):
        """A finished client batch: to the device, targets collated when they are not all ints."""
        if self.device.type == "cuda":
            images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        if objs is not None:
            labels = ff_targets.collate(objs, self.device if self.device.type == "cuda" else None, self.pin_memory)
        self.stats.batches += 1
        self.stats.samples += len(images)
        return ff_targets.batch_of(images, labels)  # as default_collate shapes the samples: [images, targets]


class _ClientEpoch:
    """One producer epoch as this client's batches (an iterator; `close()` leaves the epoch)."""

    def __init__(self, client: SharedLoaderClient):
        self._c = client
        self.epoch = None
        self._ended = self._end_seen = False  # the epoch is over for this iterator; its "end" was read already
        self._piece = None  # [batch message, next row] of a producer batch given out in pieces
        self._wait = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        if self._ended:
            raise StopIteration
        try:
            self._wait = 0.0
            if self.epoch is None:
                self._begin()
            out = self._whole() if self._c.batch_size >= self._c.producer.batch_size else self._piece_of()
        except StopIteration:
            self._ended = True
            self._c.stats.epochs += 1
            raise
        except BaseException:
            self.close()
            raise
        append_bounded(self._c.stats.wait_seconds, self._wait)
        return out

    def close(self) -> None:
        """Leave the epoch: the producer stops counting on this client for it (its slots are released)."""
        if not self._ended and self.epoch is not None:
            self._c._dropped.add(self.epoch)
            self._c._send(("drop", self.epoch))
        self._ended = True

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _recv(self):
        t0 = time.perf_counter()
        try:
            return self._c._recv()
        finally:
            self._wait += time.perf_counter() - t0

    def _begin(self) -> None:
        while True:
            msg = self._recv()
            if msg[0] == "epoch" and msg[1] not in self._c._dropped:
                self.epoch = self._c.epoch = msg[1]
                return
            # anything else is what was on the way from an epoch this client left: ignored

    def _next_batch(self):
        """The epoch's next producer batch message, or None at its end."""
        while True:
            msg = self._recv()
            if msg[1] != self.epoch:
                continue
            if msg[0] == "end":
                return None
            if msg[0] == "batch":
                return msg

    def _release(self, msg) -> None:
        _, epoch, seq, slot, _, _ = msg
        self._c._send(("release", epoch, seq, slot))

    def _whole(self):
        """Whole producer batches, copied one by one as they come (each released at once)."""
        c = self._c
        k = c.batch_size // c.producer.batch_size
        images = labels = None
        got, objs, complete = 0, [], True
        for _ in range(k if not self._end_seen else 0):
            msg = self._next_batch()
            if msg is None:  # the last, short batch goes out now: the next call ends the epoch
                complete, self._end_seen = False, True
                break
            _, _, _, slot, n, targets = msg
            if images is None:
                images, labels = c._alloc(k * c.producer.batch_size)
            got += c._copy(slot, slice(0, n), images, labels, got)
            self._release(msg)
            if targets is not None:
                objs.extend(targets)
        if got == 0 or (not complete and c.producer.drop_last):
            raise StopIteration
        return c._out(images[:got], labels[:got], objs if objs else None)

    def _piece_of(self):
        """The next `batch_size` rows of the current producer batch (released after its last piece)."""
        c = self._c
        while self._piece is None or self._piece[1] >= self._piece[0][4]:
            if self._piece is not None:
                self._release(self._piece[0])
                self._piece = None
            msg = self._next_batch()
            if msg is None:
                raise StopIteration
            self._piece = [msg, 0]
        msg, row = self._piece
        _, _, _, slot, n, targets = msg
        stop = min(row + c.batch_size, n)
        images, labels = c._alloc(stop - row)
        c._copy(slot, slice(row, stop), images, labels, 0)
        self._piece[1] = stop
        if stop >= n:
            self._release(msg)
            self._piece = None
        return c._out(images, labels, None if targets is None else list(targets[row:stop]))
