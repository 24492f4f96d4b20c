"""The training process's handle on one Ray gateway process (remote/gateway.py): starting it, its
start-up handshake, its socket, and ending it and everything it started. No ray import here.

Start: the loader's dataset, policy and worker_init_fn are pickled here with cloudpickle (as Ray
would: lambdas and classes of the training script travel by value), so a dataset that cannot be
pickled fails in the training process with a TypeError naming it, before any process starts. The
gateway is `python -m fusionflow.remote.gateway` (a fresh interpreter: nothing of the training
process's threads, CUDA context or locks is inherited), in a session of its own, with the socket's
and the ring's descriptors passed; it gets the training process's sys.path first, so it imports
what the training process imports.

End (`stop`: STOP, a grace period, SIGKILL; `kill`): the gateway's whole session is killed after it
(runtime/procs.py kill_session) -- the Ray instance it started, and what Ray left when its node died
under it (a raylet's agents) -- so no Ray process of ours outlives the loader.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait

from fusionflow.errors import GatewayLost, RemoteWorkerError
from fusionflow.remote.pulse import SILENT_S
from fusionflow.runtime import messages as m
from fusionflow.runtime.authsock import set_send_timeout
from fusionflow.runtime.procs import is_stopped, kill_session

log = logging.getLogger("fusionflow.remote.kind")
STOP_GRACE_S = 10.0  # the gateway's ray.shutdown() of a local instance takes a few seconds
# a gateway that takes nothing from its socket this long while a send waits (a full buffer: hundreds of tasks queued
# on a large cluster, its loop held in a Ray call) is killed: the sending thread also runs the call-deadline and
# silence checks, which a send blocked for ever turned off (and close() hung on STOP)
SEND_BOUND_S = SILENT_S
ERRORS = {"TypeError": TypeError, "ConnectionError": ConnectionError, "ImportError": ImportError}
STOPPED_S = 5.0  # a gateway stopped (SIGSTOP) this long during its start-up is given up (GatewayLost)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pickle_spec(spec: dict) -> bytes:
    """The gateway's start-up spec, pickled with cloudpickle; TypeError naming the dataset if it cannot be."""
    import cloudpickle

    try:
        cloudpickle.dumps(spec["dataset"])
    except Exception as exc:
        raise TypeError(
            f"remote_workers: the dataset {type(spec['dataset']).__name__} cannot be pickled to send it "
            f"to the Ray workers ({type(exc).__name__}: {exc}). Keep no open files, locks or "
            "lambdas in its attributes (open them lazily in __getitem__), or use "
            "remote_workers=None"
        ) from exc
    return cloudpickle.dumps(spec)


class GatewayLink:
    """One gateway process: `conn` (its socket), `pid`, `returncode` once it ended."""

    def __init__(self, spec_bytes: bytes, ring_fd: int):
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fusionflow.remote.gateway",
                    str(theirs.fileno()),
                    str(ring_fd),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(), ring_fd),
                start_new_session=True,  # its session: everything it starts, to end with it
                env=env,
            )
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())
        os.set_inheritable(self.conn.fileno(), False)
        self._hello = pickle.dumps({"sys_path": list(sys.path), "spec": spec_bytes})  # sent by wait_started
        self.last_error: str | None = None  # the last Ray error the gateway reported
        self.session_dir: str | None = None  # the Ray instance the gateway started for itself: its session folder

    def wait_started(self, timeout: float) -> dict:
        """The gateway's ("started", info), after forwarding its log records; raises the error it
        reports (TypeError, ConnectionError, RemoteWorkerError ...) or a RemoteWorkerError when it
        exits or does not answer within `timeout`. It first sends the start-up spec, within the same
        bound: a gateway stopped before it reads a spec larger than the socket's buffer (the dataset
        travels in it) cannot hold this thread, and `kill()` from another thread ends the send."""
        deadline = time.monotonic() + timeout
        set_send_timeout(self.conn, timeout)
        try:
            self.conn.send_bytes(self._hello)
        except OSError as exc:  # it died, or stopped reading (stopped): the process's fault
            raise GatewayLost(
                f"remote_workers: the Ray gateway did not take its start-up spec within {timeout:.0f} s ({exc!r})"
            ) from None
        finally:
            set_send_timeout(self.conn, SEND_BOUND_S)
        stopped_since = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not mp_wait([self.conn], min(left, 1.0)):
                if self.proc.poll() is not None:
                    raise GatewayLost(f"remote_workers: the Ray gateway process {self.how_it_ended()} during start-up")
                if left <= 0:
                    raise RemoteWorkerError(f"remote_workers: the Ray gateway did not start within {timeout:.0f} s")
                stopped_since = (stopped_since or time.monotonic()) if is_stopped(self.proc.pid) else None
                if stopped_since is not None and time.monotonic() - stopped_since >= STOPPED_S:
                    raise GatewayLost(
                        f"remote_workers: the Ray gateway process was stopped (SIGSTOP) for {STOPPED_S:.0f} s during "
                        "start-up; it is killed"
                    )
                continue
            try:
                event = m.unpack_control(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.proc.wait()
                raise GatewayLost(
                    f"remote_workers: the Ray gateway process {self.how_it_ended()} during start-up"
                ) from None
            if event[0] == "log":
                forward_log(event)
            elif event[0] == "error":
                raise ERRORS.get(event[1], RemoteWorkerError)(event[2])
            elif event[0] == "session":  # the instance it started: removed by kill() even if start-up fails
                self.session_dir = event[1]
            elif event[0] == "started":
                return event[1]

    def how_it_ended(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def send(self, msg: bytes) -> bool:
        try:
            self.conn.send_bytes(msg)
            return True
        except (BlockingIOError, TimeoutError):  # took nothing for SEND_BOUND_S: a frame cut short cannot be
            log.warning(  # finished, so it is killed (its reader then requeues)
                "remote_workers: the Ray gateway took nothing from its socket for %.0f s; killing it", SEND_BOUND_S
            )
            self.kill()
            return False
        except OSError:  # it died: its reader finds out and requeues
            return False

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """STOP, up to `grace` seconds to shut Ray down, then SIGKILL; then its session. A gateway stopped (SIGSTOP)
        would only use up the grace: killed at once (its session's processes then go with kill_session)."""
        try:
            if is_stopped(self.pid):
                log.warning("remote_workers: the Ray gateway is stopped (SIGSTOP); killing it")
                return
            self.send(m.pack_stop())
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("remote_workers: the Ray gateway did not stop within %.0f s; killing it", grace)
        finally:  # a Ctrl-C in the wait too: the gateway told to stop leaves its session folder to us
            self.kill()

    def kill(self) -> None:
        """SIGKILL the gateway (if it still runs) and every process of its session; reap it."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        left = kill_session(self.pid)
        if left:
            log.warning("remote_workers: processes %s of the Ray gateway's session did not exit", left)
        remove_session_dir(self.session_dir or session_dir_of(self.pid))

    def close(self) -> None:
        """Close the socket (after its reader has ended: the gateway's death is its EOF)."""
        self.conn.close()

    def discard(self) -> None:
        """A gateway that never got a reader (its start-up failed or was cut short): kill, close."""
        self.kill()
        self.close()


def session_dir_of(pid: int) -> str | None:
    """The session folder of a Ray instance that process `pid` started (Ray names it session_<date>_<pid> under its
    temp root: $RAY_TMPDIR, else $TMPDIR, else /tmp, + /ray), for a gateway killed before it could say which: while
    `ray.init` was still starting the instance. None when there is none. A driver that joined a cluster has none."""
    root = os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray")
    found = glob.glob(os.path.join(root, f"session_*_{pid}"))
    return found[0] if len(found) == 1 else None


def remove_session_dir(path: str | None) -> None:
    """The session folder of a Ray instance a gateway started for itself (its logs and sockets: tens of MB, left under
    /tmp/ray by every run until session 39), once its processes are gone; Ray's session_latest link too if it names
    it. Ray leaves the folders of instances it did not start to whoever started them."""
    path = (path or "").rstrip("/")
    if not os.path.basename(path).startswith("session_"):
        return
    shutil.rmtree(path, ignore_errors=True)
    latest = os.path.join(os.path.dirname(path), "session_latest")
    with contextlib.suppress(OSError):
        if os.path.basename(os.readlink(latest).rstrip("/")) == os.path.basename(path):
            os.unlink(latest)


def forward_log(event) -> None:
    """A ("log", level, logger, message) event: logged here, under the gateway's logger name."""
    _what, level, name, text = event
    logging.getLogger(name).log(level, "%s", text)


class GatewayState:
    """One gateway process's life as the Ray worker kind (remote/kind.py) sees it: the tiny-batches it holds."""

    def __init__(self, link: GatewayLink):
        self.link = link
        self.outstanding: dict = {}  # task id -> Work sent to it and neither done nor given back
        self.sent_at: dict = {}  # task id -> when it was sent (monotonic), for the same tasks
        self.unresponsive: str | None = None  # why it was killed (silent, or holding work too long)
        self.heard_at = time.monotonic()  # its last message (a result, an event, its pulse)
        self.delivered = 0
        self.last_error: str | None = None
        self.reader: threading.Thread | None = None

    def skip(self, lost: float) -> None:
        """The whole job did not run for `lost` s (runtime/stuck.py overslept): its silence and its calls' time away
        count from the resume, so the pause kills no gateway."""
        self.heard_at += lost
        for task in self.sent_at:
            self.sent_at[task] += lost
