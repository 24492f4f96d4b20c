"""The message kinds' wire values and the typed lending messages' round trips."""

import os
import pickle

import pytest

from fusionflow.runtime import messages as m
from fusionflow.runtime.gm.link import make_spec
from fusionflow.runtime.shm import RingLayout


def test_kinds_keep_their_wire_values():
    # a message's first int32; a worker and a borrower from the same install must agree on them
    assert {k.name: int(k) for k in m.Kind} == {
        "TASK": 1,
        "STOP": 2,
        "DONE": 3,
        "READY": 4,
        "FATAL": 5,
        "LEND": 6,
        "HOME": 7,
        "HELLO": 8,
        "SETUP": 9,
        "NEED": 10,
        "SPEC": 11,
        "RETURN": 12,
        "LEAVING": 13,
        "BELL": 14,
        "EVENT": 15,
    }
    assert m.LEND is m.Kind.LEND and m.BELL == 14 and m.EVENT == 15


LENDING = [
    m.Lend(peer=3, address="fusionflow-abc", secret=b"s" * 32, owner_lm=1),
    m.Home(tasks=17),
    m.Hello(owner_lm=2, worker_id=5),
    m.Setup(ring_name="ffring", layout=RingLayout(2, 8, (3, 4, 4), "uint8"), seed=7, spec_hash=b"h" * 16),
    m.Setup(ring_name="ffring", layout=RingLayout(1, 1, (1,), "uint8"), seed=0, spec_hash=None),
    m.Spec(dataset=[b"a", b"b"], policy={"ops": []}, worker_init_fn=None),
]


@pytest.mark.parametrize("msg", LENDING, ids=lambda x: type(x).__name__)
def test_lending_message_round_trip(msg):
    wire = m.pack_message(msg)
    assert m.kind_of(wire) == type(msg).KIND
    assert m.unpack_message(wire, type(msg)) == msg


def test_every_lending_kind_has_one_message():
    assert sorted(cls.KIND for cls in m.LENDING_MESSAGES) == [m.LEND, m.HOME, m.HELLO, m.SETUP, m.SPEC]


@pytest.mark.parametrize(
    "wire", [m.pack_message(m.Home(1)), m.pack_control(m.RETURN), m.pack_pickled(m.LEND, pickle.dumps(m.Home(1)))]
)
def test_unpack_message_refuses_another_kind(wire):
    with pytest.raises(TypeError, match="expected a Lend message"):
        m.unpack_message(wire, m.Lend)


def test_spec_travels_pre_pickled():
    spec = make_spec([1, 2], {"ops": []}, None)
    wire = m.pack_pickled(m.SPEC, spec)
    assert m.unpack_message(wire, m.Spec) == m.Spec([1, 2], {"ops": []}, None)


def test_spec_that_does_not_pickle_is_none():
    assert make_spec([1], {"ops": []}, lambda wid: None) is None


def test_done_carries_the_gateways_actor_number_and_events_round_trip():
    failure = m.SampleFailure(6, 3, "sample 3", "DecodeError", "bad", "Traceback ...")
    msg = m.pack_done(9, 2, [failure], 100, 250, (5, 7), targets={4: 0.5}, worker=3)
    assert m.kind_of(msg) == m.DONE and m.unpack_done_worker(msg) == 3
    assert m.unpack_done(msg) == (9, 2, [failure], {4: 0.5})
    assert m.unpack_done_times(msg) == (100, 250, (5, 7))
    assert m.unpack_done_worker(m.pack_done(1, 1, [])) == 0  # a CPU worker's
    event = ("back", [1, 2], "lost")
    assert m.unpack_control(m.pack_control(m.EVENT, event)) == event


def _pipe_with(raw: bytes):
    """A pipe whose reading end is a multiprocessing Connection, `raw` already written into it."""
    from multiprocessing.connection import Connection

    r, w = os.pipe()
    os.write(w, raw)
    return Connection(r, writable=False), w


@pytest.mark.parametrize("size", [0, 7, 4096, 70_000])
def test_recv_whole_reads_what_multiprocessing_writes(size):
    import multiprocessing as mp
    import threading

    from fusionflow.runtime.authsock import recv_whole

    reader, writer = mp.Pipe(duplex=False)
    payload = os.urandom(size)
    t = threading.Thread(target=writer.send_bytes, args=(payload,))  # 70 kB: more than a pipe holds
    t.start()
    try:
        assert recv_whole(reader, rest_s=30) == payload
    finally:
        t.join(30)
        reader.close()
        writer.close()


def test_recv_whole_bounds_a_message_whose_sender_stopped_midway():
    """4 of 1000 announced bytes, then nothing (a sender SIGSTOPped mid-write): TimeoutError naming how far it
    got, after the bound and not long after; a sender that hung up midway: EOFError."""
    import struct
    import time

    from fusionflow.runtime.authsock import recv_whole

    conn, w = _pipe_with(struct.pack("!i", 1000) + b"abcd")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"nothing more within 0.3 s; 4 of 1000 bytes read"):
            recv_whole(conn, rest_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 10
    finally:
        conn.close()
        os.close(w)
    conn, w = _pipe_with(struct.pack("!i", 1000) + b"abcd")
    os.close(w)
    with pytest.raises(EOFError, match="4 of 1000"):
        recv_whole(conn, rest_s=30)
    conn.close()
