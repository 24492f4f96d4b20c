"""Authenticated abstract Unix sockets: how FusionFlow's processes of one user talk on a node.

An abstract socket has no file and vanishes with the process that listens on it, so a SIGKILLed
owner leaves nothing behind; but anyone on the node may connect to it. So each side proves it
knows the owner's secret (an HMAC challenge each way, multiprocessing.connection's), and the
secret travels only through something that is the user's alone (a 0600 shared-memory table for
the global manager's lending, a 0600 file in a 0700 directory for a SharedLoader). Every step of a
handshake is bounded by HANDSHAKE_S: a peer that connects and says nothing costs seconds, never a
hang.

Used by the lending sockets (runtime/gm/link.py) and the SharedLoader's (fusionflow/shared/).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

HANDSHAKE_S = 2  # each step of connecting to a peer's socket (connect, authenticate, first message)
SEND_TIMEOUT_S = 5  # a peer that stops reading cannot block a sending thread longer
REST_S = 5  # a message once begun arrives whole within this, or its sender counts as stopped mid-message


def sockopt_seconds(sock: socket.socket, opt: int, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(seconds), int((seconds % 1) * 1e6)))


def set_receive_timeout(conn: Connection, seconds: float) -> None:
    """Bound (0: unbound) every read on `conn`; a read that times out raises BlockingIOError."""
    _set_timeout(conn, socket.SO_RCVTIMEO, seconds)


def set_send_timeout(conn: Connection, seconds: float) -> None:
    """Bound (0: unbound) every write on `conn` that cannot make progress; it raises BlockingIOError."""
    _set_timeout(conn, socket.SO_SNDTIMEO, seconds)


def peer_pid(conn: Connection) -> int | None:
    """The pid of the process at the other end of a connected Unix socket (SO_PEERCRED), or None."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        finally:
            s.close()
    except (OSError, AttributeError):  # not a Unix socket, or no SO_PEERCRED here
        return None
    return pid or None


def recv_whole(conn: Connection, rest_s: float | None = None) -> bytes:
    """`conn.recv_bytes()` for a reader that was told a message has begun (a wait said `conn` is readable):
    the whole message must arrive within `rest_s` (default REST_S), else TimeoutError (an OSError). A sender stopped in
    the middle of a message (SIGSTOP, a paused container; a message over PIPE_BUF is not written at
    once) would otherwise hold the reading thread forever. EOFError if the peer hung up. Reads the frame
    multiprocessing.connection writes: a 4-byte big-endian length (-1: an 8-byte one follows), then it."""
    rest_s = REST_S if rest_s is None else rest_s
    deadline = time.monotonic() + rest_s
    fd = conn.fileno()
    try:
        (size,) = struct.unpack("!i", _read_exactly(fd, 4, deadline))
        if size == -1:
            (size,) = struct.unpack("!Q", _read_exactly(fd, 8, deadline))
        return _read_exactly(fd, size, deadline)
    except TimeoutError as exc:
        raise TimeoutError(f"nothing more within {rest_s:g} s; {exc}") from None


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    chunks, got = [], 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(min(left, 3600.0) * 1000))):  # (poll takes an int of ms)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{got} of {size} bytes read")
            continue
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            raise EOFError(f"the peer hung up in the middle of a message ({got} of {size} bytes read)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _set_timeout(conn: Connection, opt: int, seconds: float) -> None:
    s = socket.socket(fileno=os.dup(conn.fileno()))  # options belong to the socket: set them through a dup
    sockopt_seconds(s, opt, seconds)
    s.close()


def hang_up(conn: Connection) -> None:
    """Shut the connection down both ways now (closing it is the owner's): the peer's socket reports the hang-up at
    once, even with messages still queued for it or a copy of the descriptor open in a forked child."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected: nothing to tell


def listen(address: str, backlog: int = 64) -> socket.socket:
    """A non-blocking listening socket at abstract `address`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(address: str, secret: bytes) -> Connection:
    """Connect to abstract `address` and authenticate both ways, each step bounded by HANDSHAKE_S; sends
    stay bounded by SEND_TIMEOUT_S (a send that cannot progress raises BlockingIOError, an OSError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDSHAKE_S)
        sock.connect("\0" + address)
        sock.setblocking(True)
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        set_receive_timeout(conn, HANDSHAKE_S)
        set_send_timeout(conn, SEND_TIMEOUT_S)  # a listener that stops reading cannot hold our sends
        answer_challenge(conn, secret)
        deliver_challenge(conn, secret)
    except BaseException:
        conn.close()
        raise
    return conn


def accept(listener: socket.socket, secret: bytes, what: str) -> Connection | None:
    """A peer knocking on `listener` (non-blocking): authenticate it both ways and return its
    connection (reads unbounded again, sends bounded by SEND_TIMEOUT_S), or None (nobody knocked, or
    a peer that failed the handshake: logged, naming `what` it knocked on)."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    conn = None
    try:
        sock.setblocking(True)
        sockopt_seconds(sock, socket.SO_RCVTIMEO, HANDSHAKE_S)  # a stalled peer cannot hang the accepting thread
        sockopt_seconds(sock, socket.SO_SNDTIMEO, SEND_TIMEOUT_S)
        conn = Connection(sock.detach())
        deliver_challenge(conn, secret)
        answer_challenge(conn, secret)
    except Exception as exc:
        log.warning("fusionflow: refused a connection to %s: %r", what, exc)
        (conn or sock).close()
        return None
    set_receive_timeout(conn, 0)
    return conn
