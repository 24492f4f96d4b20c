"""What the producer has to say to one client and its socket has not taken yet.

The hub's messages go through an `Outbox` per client: `put` frames a message and writes what the socket
takes at once, without waiting (MSG_DONTWAIT: the descriptor's mode, which the blocking reads share, stays
as it is); the rest waits in the outbox, and the hub's thread writes it when the socket has room
(`flush` on a write event). So a client that reads nothing for a while -- a validation pass between steps
while batches with large targets fill its socket -- delays only its own messages: the producer's main
thread never blocks on a socket under the hub's lock, where it held every other client's batches and pongs,
and the client is not let go for being slow. What an outbox holds is bounded by what the producer may
publish to a client at all: a message per ring slot it holds, and a few words.

Frames are multiprocessing.connection's (a 4-byte big-endian length; -1 then an 8-byte one past 2 GiB),
so the client reads them with `Connection.recv_bytes` or authsock's `recv_whole`.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import struct


def send_plain(conn, msg) -> None:
    """`msg` pickled by value, sent whole on `conn` (the hello, before the client has an outbox)."""
    conn.send_bytes(pickled(msg))


def pickled(msg) -> bytes:
    """`msg` pickled by value: Connection.send pickles with multiprocessing's reducers, where a tensor -- a batch's
    soft labels -- goes as a descriptor of its storage, fetched through multiprocessing's resource sharer, which only
    processes of one family may ask (every client's first batch failed with AuthenticationError)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def frame(msg) -> bytes:
    """`msg` pickled by value, framed as `Connection.send_bytes` frames it."""
    body = pickled(msg)
    if len(body) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body
    return struct.pack("!i", len(body)) + body


class Outbox:
    def __init__(self, conn):
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))  # its own descriptor of the connection's socket
        self._sock.setblocking(True)  # (a socket.setdefaulttimeout() made it, and the shared reads, non-blocking)
        self._frames: collections.deque[memoryview] = collections.deque()

    @property
    def pending(self) -> bool:
        return bool(self._frames)

    def put(self, msg) -> bool:
        """Queue `msg` behind what is waiting and write what the socket takes now; whether some is left waiting.
        Raises OSError for a connection that is gone (EPIPE, ECONNRESET)."""
        self._frames.append(memoryview(frame(msg)))
        return self.flush()

    def flush(self) -> bool:
        """Write what the socket takes now, without waiting; whether some is left waiting."""
        while self._frames:
            head = self._frames[0]
            try:
                sent = self._sock.send(head, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return True
            if sent < len(head):
                self._frames[0] = head[sent:]
                return True
            self._frames.popleft()
        return False

    def close(self) -> None:
        self._frames.clear()
        self._sock.close()
