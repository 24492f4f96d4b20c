"""SharedLoader: one FusionFlowLoader's batches served to the training jobs of one node.

    loader = FusionFlowLoader(ds, batch_size=32, shuffle=True, num_workers=8, policy="randaugment", seed=0)
    with SharedLoader(loader, name="sweep1") as shared:
        shared.serve(epochs=90, min_clients=4)

Each epoch runs on the loader's own runtime (its workers, worker lending, remote workers) as an
iteration of it (`_HeldEpoch`), except that a completed mini-batch is not copied out and its ring
slot is not reused at once: it is published to every client attached when the epoch began (the
epoch's recipients, fusionflow/shared/hub.py), and its slot returns to the iteration only when the
last of them released it. The ring has `buffer` slots, so the producer is at most `buffer`
mini-batches ahead of the slowest client; the loader's next-epoch speculation fills slots freed in
an epoch's last batches, as in a plain loader.

Shutdown (`close()`, the `with` block's end): the clients are told the producer finished (after an
error or an interrupt, in serve() or in the block: that it failed, and no more), their connections
closed, the rendezvous record removed, the loader closed (its configuration was never changed: the
producer runs with its own, derived from it). Collected without close(), it is closed as it goes.
SIGKILLed instead, the kernel closes the socket (clients raise SharedLoaderError at once), the
workers' watchdogs end them, and the ring's memory goes with the last process that maps it; its name
was never in /dev/shm after creation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

from fusionflow.errors import EmptyBatch, FusionFlowError, SharedLoaderError
from fusionflow.runtime import targets as ff_targets
from fusionflow.runtime.slots import SlotPool
from fusionflow.runtime.spec import next_base_seed
from fusionflow.shared import rendezvous
from fusionflow.shared.hub import Hub

log = logging.getLogger("fusionflow.shared")
CLOSING_S = 60.0  # close() from another thread waits this long at most for serve() to end (a batch's wait)
HELD_WARN_S = 10.0  # every ring slot held by clients this long: the producer says which clients hold it back


class _Closing(Exception):
    """close() was called from another thread while serve() ran: serve() ends at its next step and returns."""


class _Unwanted(Exception):
    """Every recipient of the running epoch left it: the epoch is not worth finishing."""


def _say_held(hub, seconds: float) -> None:
    """Every slot held by clients for `seconds`: say which hold the oldest batch. A client that stopped iterating
    (validating, checkpointing) holds back the producer and every other client, whose own timeout never fires (the
    producer answers them): without this line nothing told them why."""
    log.warning(
        "fusionflow: SharedLoader %r: every ring slot has been held by clients for %.0f s; client pid(s) %s hold "
        "the oldest batch, so the producer and the other clients wait for them (a client that pauses, e.g. to "
        "validate, holds the others back: close it, keep it iterating, or give the SharedLoader a larger buffer)",
        hub.name,
        seconds,
        ", ".join(map(str, hub.laggards())) or "-",
    )


class _HeldEpoch:
    """One epoch of the producer's loader whose mini-batches stay in their ring slots until released:
    a WorkerIterator (loader/epoch.py) driven through its slot-holding methods. Runs with the hub's
    lock held (`cond`), except in `wait_next` (the wait for workers, and counting it in stats and
    trace); `release` is called with it held, from either thread."""

    def __init__(self, it, cond, unwanted, hub=None):
        self.it, self.epoch = it, it.epoch  # a WorkerIterator of the loader (LoaderParts.held_epoch)
        self._cond, self._unwanted, self._hub = cond, unwanted, hub
        self._said = hub is None  # `_say_held` once an epoch (a client that trains slowly is not nagged each batch)

    def next_held(self):
        """The next completed mini-batch's state (its slot stays taken until `release`)."""
        return self.it.advance(self._next_held)

    def release(self, slot: int) -> None:
        self.it.give_back(slot)

    def close(self) -> None:
        self.it.close()

    def _next_held(self):
        held_since = time.monotonic()
        while not (flight := self.it.in_flight()):
            if flight is None:
                raise StopIteration
            if self._unwanted():
                raise _Unwanted
            self._cond.wait(0.5)  # every slot is held by clients: a release refills
            if not self._said and time.monotonic() - held_since >= HELD_WARN_S:
                _say_held(self._hub, time.monotonic() - held_since)
                self._said = True
        if self._unwanted():
            raise _Unwanted
        self._cond.release()
        try:
            return self.it.wait_next()
        finally:
            self._cond.acquire()


def _dropped(hub, loader, name: str) -> None:
    """A SharedLoader collected without close() (`del`, or its name rebound): its clients are told, its hub and loader
    closed, so its name is free and its workers end -- in a thread of its own: the collection may happen on the hub's
    thread (its last reference let go there) or the loader's, which cannot join themselves."""
    log.warning("fusionflow: SharedLoader %r was dropped without close(): closed at its collection", name)

    def close() -> None:
        try:
            with hub.cond:
                hub.broadcast(("error", "the SharedLoader was dropped without close() (closed at its collection)"))
            hub.close()
        finally:
            loader.close()

    threading.Thread(target=close, name=f"fusionflow-shared-{name}-close").start()


class SharedLoader:
    """Serve `loader`'s batches to `SharedLoaderClient(name)`s on this node: every client of an epoch
    gets every sample once, in the loader's order, with identical pixels and targets.

    `loader`: a FusionFlowLoader with num_workers >= 1 and no accelerator or collate_fn (clients
    apply their own). Its ring gets `buffer` slots (default 2 x its prefetch_factor) and its workers
    persist while it serves (the producer's own configuration: `loader.config` is left as built).
    `name`: how clients find it (letters, digits, '.', '_', '-'). Clients may attach from construction
    on; serve() runs the epochs."""

    def __init__(self, loader, name: str, *, buffer: int | None = None):
        if not hasattr(getattr(loader, "parts", None), "held_epoch"):  # shared/ does not import the loader
            raise TypeError(f"SharedLoader serves a FusionFlowLoader, not {type(loader).__name__}")
        cfg = loader.config
        if cfg.num_workers < 1:
            raise ValueError("SharedLoader needs a loader with num_workers >= 1 (clients read its worker ring)")
        if cfg.accelerator is not None:
            raise ValueError(
                f"SharedLoader serves batches made in shared memory; accelerator={cfg.accelerator!r} makes "
                "part of each batch on the GPU: build the loader with accelerator=None"
            )
        if cfg.collate is not None:
            raise ValueError(
                "SharedLoader sends (images, targets): pass collate_fn to nothing, apply it in each client"
            )
        if buffer is None:
            buffer = 2 * cfg.prefetch_factor
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer={buffer!r} must be an integer >= 1 (mini-batches ahead of the slowest client)")
        self.name, self.buffer, self.loader = rendezvous.check_name(name), buffer, loader
        self.epochs_served = 0  # epochs served whole (one every client left before its end is not)
        self._told = False  # the clients were given the producer's last word
        self.epoch_clients = 0  # clients the latest epoch went to (those attached when it began)
        self._current, self._waited = None, False
        self._serving: int | None = None  # the thread serve() runs in (its ident), while it runs
        self._closing = self._close_at_end = False  # close() asked serve() to end; to close as it ends (a handler's)
        # the producer's own configuration, derived from the loader's (which stays as the user built it):
        # `buffer` ring slots, workers that persist while it serves
        self.config = cfg.with_config(prefetch_factor=buffer, persistent_workers=True)
        parts = loader.parts
        parts.runtime.stop()  # a running runtime has the old ring depth
        try:
            seed = next_base_seed(self.config.generator)  # its first epoch's draw, left to that epoch to make
            # the loader's augmentation seed: its own, or drawn by an epoch before, else this first epoch's (the
            # loader's from now on: its state_dict, its later epochs)
            self.config = parts.checkpoint.seeded(self.config, seed)
            self._mgr = parts.runtime.start(self.config, parts.delivery.alloc_device, seed)
            self._hub = Hub(self.name, self._mgr.board.ring.fd, self._hello, self._slot_free)
        except BaseException:
            loader.close()
            raise
        self._on_drop = weakref.finalize(self, _dropped, self._hub, loader, self.name)  # collected without close()
        self._on_drop.atexit = False  # (at exit the hub's own finalizer removes the record, the workers end)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None:  # the block failed or was interrupted: its clients are told so, not that it finished
            self._fail(exc)
        self.close()

    @property
    def clients(self) -> int:
        """Clients attached now (0 once closed)."""
        if self._hub is None:
            return 0
        with self._hub.cond:
            return len(self._hub.live())

    def serve(self, epochs: int, min_clients: int = 1) -> None:
        """Run `epochs` epochs of the loader and hand each to the clients attached when it begins; the
        first waits for `min_clients` of them, each later one for at least one (an epoch every client left
        before its end is not counted in `epochs_served`). Returns once every batch went to
        (was released by, or left with) every client it was published to. A failure or an interrupt here is
        told to the clients ("failed: ...") before it is raised."""
        for value, what in ((epochs, "epochs"), (min_clients, "min_clients")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}={value!r} must be an integer >= 1")
        hub = self._hub
        if hub is None:
            raise SharedLoaderError(f"SharedLoader {self.name!r} is closed: make a new one to serve again")
        with hub.cond:
            if self._serving:
                raise SharedLoaderError(f"SharedLoader {self.name!r} is serving already (serve() in another thread)")
            self._serving = threading.get_ident()
        try:
            target = self.epochs_served + epochs  # epochs every client left early are not counted: served again
            while self.epochs_served < target:
                self._wait_for(min_clients if not self._waited else 1)
                self._waited = True
                whole = self._serve_epoch()
                with hub.cond:
                    if not whole and not hub.live():  # left by every client, all detached since: done
                        break
            with hub.cond:
                while hub.held_slots() and not self._closing:
                    hub.cond.wait(0.5)
        except _Closing:
            return  # close() tells the clients the producer finished
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            with hub.cond:
                self._serving = None
                hub.cond.notify_all()
            if self._close_at_end:  # close() came from a signal handler on this thread: it is done here
                self.close()

    def close(self) -> None:
        """Tell the clients this producer finished (unless they were told it failed), close their connections,
        close the loader. Called while serve() runs -- from another thread (a timer), or from a signal handler (on
        serve()'s own thread: serve() closes as it ends) -- it ends serve(), which returns at its next step: an
        epoch under way is left, its clients told the producer finished."""
        hub = getattr(self, "_hub", None)
        if hub is None:
            return
        with hub.cond:  # serve() running in another thread ends at its next step (a batch's wait at most) first
            self._closing = True
            hub.cond.notify_all()
            if self._serving == threading.get_ident():  # a signal handler, on serve()'s own thread: serve() cannot
                self._close_at_end = True  # go on until the handler returns; it ends at its next step and closes then
                return
            deadline = time.monotonic() + CLOSING_S
            while self._serving and time.monotonic() < deadline:
                hub.cond.wait(0.5)
        self._hub = None
        self._on_drop.detach()
        with hub.cond:
            if not self._told:
                hub.broadcast(("finished", self.epochs_served))
        hub.close()
        self.loader.close()  # its runtime ran with the producer's ring depth: the next iteration starts its own

    def _fail(self, exc: BaseException) -> None:
        """Tell the clients why this producer ends (once): they raise it, not that it finished."""
        hub = getattr(self, "_hub", None)
        if hub is not None and not self._told:
            self._told = True
            with hub.cond:
                hub.broadcast(("error", f"{type(exc).__name__}: {exc}"))

    # ---------------------------------------------------------------- epochs
    def _wait_for(self, k: int) -> None:
        hub, said = self._hub, False
        with hub.cond:
            while len(hub.live()) < k:
                if self._closing:
                    raise _Closing
                if not said:
                    said = True
                    log.warning(
                        "fusionflow: SharedLoader %r waits for %d client%s (%d attached): "
                        "SharedLoaderClient(%r) in each training job",
                        self.name,
                        k,
                        "s" if k > 1 else "",
                        len(hub.live()),
                        self.name,
                    )
                hub.cond.wait(1.0)

    def _serve_epoch(self) -> bool:
        """One epoch to the clients attached now; whether it was served whole (not left by every client)."""
        hub, loader, parts = self._hub, self.loader, self.loader.parts
        if parts.runtime.manager is not self._mgr:
            raise FusionFlowError("the served loader's workers were restarted (load_state_dict, close()?)")
        upcoming = parts.checkpoint.upcoming()
        if (
            upcoming is not None
        ):  # told to the sampler (DistributedSampler's shuffle), as a loop calling set_epoch would
            loader.set_epoch(upcoming)
        with hub.cond:
            free = SlotPool(s for s in range(self.buffer) if s not in hub.held_slots())
            it = self._current = _HeldEpoch(
                parts.held_epoch(self.config, free), hub.cond, lambda: not hub.recipients or self._closing, hub
            )
            epoch = it.epoch
            hub.begin_epoch(epoch, len(loader))
            self.epoch_clients, whole = len(hub.recipients), True
            try:
                while True:
                    try:
                        state = it.next_held()
                    except StopIteration:
                        break
                    except _Unwanted:
                        if self._closing:
                            raise _Closing from None  # (no "end": the clients are told the producer finished)
                        whole = False
                        log.info(
                            "fusionflow: SharedLoader %r: epoch %d has no client left; ended early (not counted)",
                            self.name,
                            epoch,
                        )
                        break
                    try:
                        n, targets = self._compact(state)
                    except EmptyBatch:  # on_error='skip' left it none: not published, its slot free again
                        it.release(state.slot)
                        continue
                    hub.publish(state.slot, n, targets)
            finally:
                self._current = None
                it.close()
            hub.end_epoch()
            self.epochs_served += whole
            return whole

    def _compact(self, state) -> tuple[int, list | None]:
        """on_error applied to a completed slot (kept samples moved to its front, in order); its size
        and, when not all targets are ints, the targets as the dataset gave them."""
        ring, slot, n = self._mgr.board.ring, state.slot, state.size
        keep = self.loader.parts.delivery.select(n, state.failures)
        rows = range(n) if keep is None else keep
        targets = ff_targets.gather(ring.labels[slot], rows, state.targets) if state.targets else None
        if keep is not None:
            ring.images[slot][: len(keep)] = ring.images[slot][keep]
            ring.labels[slot][: len(keep)] = ring.labels[slot][keep]
            n = len(keep)
        return n, targets

    def _slot_free(self, slot: int) -> None:
        """The hub's lock held: no client holds `slot` any more."""
        if self._current is not None:
            self._current.release(slot)

    def _hello(self, running):
        cfg = self.config
        try:
            samples = len(cfg.sampler)
        except TypeError:
            samples = len(self.loader) * cfg.capacity
        return rendezvous.Hello(
            self.name,
            os.getpid(),
            self._mgr.board.ring.layout,
            cfg.capacity if cfg.batch_size is None else cfg.batch_size,  # (capacity: at most the sampler's samples)
            cfg.drop_last,
            len(self.loader),
            samples,
            running,
        )
