"""Small fixed-layout messages between the local manager and CPU workers (struct-packed bytes).

No pixel data ever travels here: a task names slots and dataset indices; a completion names the
task. Only failures (the exceptions, as text, to be re-raised in the training process) and targets
that are not Python ints (runtime/targets.py: {position: target}, small) carry a variable payload.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

from fusionflow.errors import class_name

if TYPE_CHECKING:
    from fusionflow.runtime.shm import RingLayout


class Kind(IntEnum):
    """The first field of every message. Worker lending (runtime/gm/link.py): owner -> worker LEND,
    worker -> owner HOME; on the borrower's socket: worker -> borrower HELLO, NEED, LEAVING (its
    owner called it back); borrower -> worker SETUP, SPEC, RETURN. Those are rare control messages:
    their payload, one of the dataclasses below (or none), is pickled."""

    TASK = 1
    STOP = 2
    DONE = 3
    READY = 4
    FATAL = 5
    LEND = 6
    HOME = 7
    HELLO = 8
    SETUP = 9
    NEED = 10
    SPEC = 11
    RETURN = 12
    LEAVING = 13
    BELL = 14  # GM -> LM on the LM's socket: the first one says "this connection is the GM's doorbell",
    # each later one "your action row has a new order" (no polling for orders in training)
    EVENT = 15  # Ray gateway -> its loader (remote/gateway.py): a pickled (what, ...) tuple, rare


TASK, STOP, DONE, READY, FATAL = Kind.TASK, Kind.STOP, Kind.DONE, Kind.READY, Kind.FATAL
LEND, HOME, HELLO, SETUP, NEED, SPEC = Kind.LEND, Kind.HOME, Kind.HELLO, Kind.SETUP, Kind.NEED, Kind.SPEC
RETURN, LEAVING, BELL, EVENT = Kind.RETURN, Kind.LEAVING, Kind.BELL, Kind.EVENT
_HEAD = struct.Struct("<iqiiqi")  # kind, task_id, generation, slot, epoch, count
_ITEM = struct.Struct("<iqi")  # position in the mini-batch, dataset index, copy number (repeated augmentation)
# DONE's fixed part after the head: when the worker started and finished the task (time.monotonic_ns:
# CLOCK_MONOTONIC, one clock for every process on the machine) and how many per-stage totals follow
# (int64 ns each, fusionflow/ops/stages.py; 0 when stage timing is off)
_TIMES = struct.Struct("<qqi")


@dataclass(frozen=True)
class Task:
    task_id: int
    generation: int
    slot: int
    epoch: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]
    copies: tuple[int, ...] = ()  # per sample (fusionflow.scheduling.tiny_batches.Copies); () when all are 0


@dataclass(frozen=True)
class SampleFailure:
    position: int
    index: int
    what: str  # the sample's description (its path, if the dataset knows it)
    exc_type: str
    message: str
    traceback: str
    exc_class: str = ""  # "module:qualname" of the exception (raised in the training process as one, too)
    attributes: dict | None = None  # its errno, filename, ... (errors.exception_attributes)


def pack_task(t: Task) -> bytes:
    head = _HEAD.pack(TASK, t.task_id, t.generation, t.slot, t.epoch, len(t.positions))
    copies = t.copies or (0,) * len(t.positions)
    return head + b"".join(_ITEM.pack(p, i, c) for p, i, c in zip(t.positions, t.indices, copies))


def pack_stop() -> bytes:
    return _HEAD.pack(STOP, 0, 0, 0, 0, 0)


def pack_done(
    task_id: int,
    generation: int,
    failures: list[SampleFailure],
    started_ns: int = 0,
    ended_ns: int = 0,
    stage_ns=(),
    *,
    targets: dict | None = None,
    worker: int = 0,
) -> bytes:
    """`targets`: {position: target} of the samples whose target did not go into the ring's int64 slot.
    `worker`: which of the sender's workers ran it (the Ray gateway's actor number; 0 for a CPU worker).
    Fixed size (head, times, stage totals) unless there are failures or such targets (pickled after)."""
    n = len(failures) + len(targets or ())  # 0: no payload (the common case: int targets, no failure)
    head = _HEAD.pack(DONE, task_id, generation, worker, 0, n)
    times = _TIMES.pack(started_ns, ended_ns, len(stage_ns))
    stages = struct.pack(f"<{len(stage_ns)}q", *stage_ns) if stage_ns else b""
    return head + times + stages + (pickle.dumps((failures, targets or {})) if n else b"")


def pack_ready(worker_id: int) -> bytes:
    return _HEAD.pack(READY, 0, 0, worker_id, 0, 0)


def pack_fatal(worker_id: int, text: str, exc: BaseException | None = None) -> bytes:
    """A worker could not start: its traceback `text`, after the "module:qualname" of `exc`'s class (one line)."""
    kind = class_name(exc) if exc is not None else ""
    return _HEAD.pack(FATAL, 0, 0, worker_id, 0, 0) + f"{kind}\n{text}".encode("utf-8", "replace")


@dataclass(frozen=True)
class Lend:
    """Owner LM -> its idle worker: serve LM `peer`, listening at `address`, until it sends you home."""

    KIND: ClassVar[Kind] = Kind.LEND
    peer: int  # the borrower's row in the job's table
    address: str  # the borrower's abstract Unix socket
    secret: bytes  # the job's secret, to authenticate there
    owner_lm: int  # the lender's own row


@dataclass(frozen=True)
class Home:
    """Lent worker -> its owner, back from a loan."""

    KIND: ClassVar[Kind] = Kind.HOME
    tasks: int  # tiny-batches it ran for the borrower


@dataclass(frozen=True)
class Hello:
    """Lent worker -> borrower, first thing on the borrower's socket."""

    KIND: ClassVar[Kind] = Kind.HELLO
    owner_lm: int
    worker_id: int  # within its owner


@dataclass(frozen=True)
class Setup:
    """Borrower -> lent worker: its batch ring (whose descriptor follows), seed and spec."""

    KIND: ClassVar[Kind] = Kind.SETUP
    ring_name: str
    layout: RingLayout
    seed: int
    spec_hash: bytes | None  # None: the borrower's spec does not pickle (the worker is sent home)


@dataclass(frozen=True)
class Spec:
    """Borrower -> lent worker that does not have it yet: what runs the borrower's samples. Pickled
    once per loader (runtime/gm/link.py, `make_spec`) and sent as those bytes (`pack_pickled`)."""

    KIND: ClassVar[Kind] = Kind.SPEC
    dataset: Any
    policy: Any
    worker_init_fn: Any
    cache_side: int | None = None  # the borrower's decoded-image cache's max_side: its rendering, or None (uncached)


LENDING_MESSAGES = (Lend, Home, Hello, Setup, Spec)


def pack_message(msg: Lend | Home | Hello | Setup | Spec) -> bytes:
    """A typed control message: its kind in the head, the dataclass pickled after it."""
    return pack_pickled(msg.KIND, pickle.dumps(msg))


def unpack_message(msg: bytes, expected: type):
    """The dataclass a `pack_message` message carries; TypeError if it is not an `expected`."""
    payload = unpack_control(msg)
    if type(payload) is not expected or kind_of(msg) != expected.KIND:
        raise TypeError(
            f"expected a {expected.__name__} message, got kind {kind_of(msg)} carrying {type(payload).__name__}"
        )
    return payload


def pack_control(kind: int, payload=None) -> bytes:
    return pack_pickled(kind, pickle.dumps(payload))


def pack_pickled(kind: int, pickled: bytes) -> bytes:
    """A control message whose payload is already pickled (e.g. a loader's dataset and policy)."""
    return _HEAD.pack(kind, 0, 0, 0, 0, 0) + pickled


def unpack_control(msg: bytes):
    return pickle.loads(msg[_HEAD.size :])


def kind_of(msg: bytes) -> int:
    return _HEAD.unpack_from(msg)[0]


def unpack_task(msg: bytes) -> Task:
    _, task_id, gen, slot, epoch, n = _HEAD.unpack_from(msg)
    items = [_ITEM.unpack_from(msg, _HEAD.size + k * _ITEM.size) for k in range(n)]
    copies = tuple(c for _, _, c in items)
    return Task(
        task_id,
        gen,
        slot,
        epoch,
        tuple(p for p, _, _ in items),
        tuple(i for _, i, _ in items),
        copies if any(copies) else (),
    )


def unpack_done(msg: bytes) -> tuple[int, int, list[SampleFailure], dict]:
    """(task_id, generation, failures, {position: target} of targets sent along)."""
    _, task_id, gen, _, _, n = _HEAD.unpack_from(msg)
    _, _, stages = _TIMES.unpack_from(msg, _HEAD.size)
    failures, targets = pickle.loads(msg[_HEAD.size + _TIMES.size + 8 * stages :]) if n else ([], {})
    return task_id, gen, failures, targets


def unpack_done_times(msg: bytes) -> tuple[int, int, tuple[int, ...]]:
    """(started_ns, ended_ns, per-stage ns totals) of a DONE message."""
    started, ended, stages = _TIMES.unpack_from(msg, _HEAD.size)
    return started, ended, struct.unpack_from(f"<{stages}q", msg, _HEAD.size + _TIMES.size) if stages else ()


def unpack_done_worker(msg: bytes) -> int:
    """The `worker` of a DONE message."""
    return _HEAD.unpack_from(msg)[3]


def unpack_fatal(msg: bytes) -> tuple[str, str]:
    """(the traceback, the "module:qualname" of the exception's class or "")."""
    kind, _, text = msg[_HEAD.size :].decode("utf-8", "replace").partition("\n")
    return text, kind
