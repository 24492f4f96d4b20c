"""A lent worker's handshake with its borrower (fusionflow/runtime/worker.py serve_borrower) when the
borrower starts closing just as the worker arrives: RETURN comes in place of SETUP, and the worker goes
home quietly (before: it raised, died with exit code 1 and was restarted by its owner)."""

import os
import secrets
import socket
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from fusionflow.runtime import messages as m
from fusionflow.runtime.worker import serve_borrower


def test_return_in_place_of_setup_sends_the_worker_home():
    address, secret = f"ff-test-borrower-{os.getpid()}-{secrets.token_hex(4)}", secrets.token_bytes(16)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + address)
    server.listen(1)
    seen = []

    def borrower():
        sock, _ = server.accept()
        conn = Connection(sock.detach())
        deliver_challenge(conn, secret)
        answer_challenge(conn, secret)
        seen.append(m.unpack_message(conn.recv_bytes(), m.Hello))
        conn.send_bytes(m.pack_control(m.RETURN))  # closing: no SETUP for this guest
        conn.close()

    t = threading.Thread(target=borrower, daemon=True)
    t.start()
    try:
        lend = m.Lend(peer=1, address=address, secret=secret, owner_lm=0)
        done = serve_borrower(lend, None, 3, (None, None, "home"), {}, os.getpid())
    finally:
        t.join(10)
        server.close()
    assert done == 0
    assert seen and seen[0].worker_id == 3
