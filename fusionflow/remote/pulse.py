"""How a Ray gateway shows it is alive, and the deadlines that judge it (issue 42; docs/waits.md).

Both sides use this module: the gateway process (remote/gateway.py) runs a `Pulse`, and the training
process's worker kind (remote/kind.py) reads its beats and measures its calls. No ray import here.

- **The pulse**: a thread of the gateway that never calls Ray sends an ("alive",) event every `PULSE_S`,
  so a gateway that is stopped, wedged or swapped out is found by its silence (`SILENT_S`) even when it
  holds no tiny-batch, not only when it is next given one. The same thread watches the node's raylet:
  Ray's core worker can outlive a dead raylet for minutes, holding its calls (seen: 6.5 minutes); a
  gateway whose raylet is gone says so and exits, and the loader runs what it held locally.
- **The call deadline** (`call_deadline`): how long a tiny-batch may be away at the gateway,
  `RayWorkers(call_timeout=)` or max(`CALL_FLOOR_S`, `CALL_FACTOR` x the mean round trip). Past it the
  loader kills the whole gateway. Before that, at `ACTOR_SHARE` of it, the gateway gives up one call
  that hangs on one actor (a stuck read, a stopped actor process): that actor is killed and replaced,
  its tiny-batches run locally, and the gateway's other actors go on.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from fusionflow.runtime.procs import command_line, live_processes, pid_alive

PULSE_S = 1.0  # the gateway's heartbeat
SILENT_S = 10.0  # a gateway that said nothing (no beat, no result) this long is killed
CALL_FLOOR_S, CALL_FACTOR = 10.0, 20.0  # call_timeout=None: max(10 s, 20x the mean round trip)
ACTOR_SHARE = 0.5  # the gateway ends one actor's call at this share of the call deadline

log = logging.getLogger("fusionflow.remote.kind")


def call_deadline(call_timeout: float | None, mean_s: float) -> float:
    """Seconds a tiny-batch may be away: the configured `call_timeout`, or a multiple of the measured
    mean (`mean_s`, 0 before anything was measured) with a floor."""
    if call_timeout is not None:
        return call_timeout
    return max(CALL_FLOOR_S, CALL_FACTOR * mean_s)


def running_mean(mean: float, sample: float) -> float:
    """The moving mean the deadlines follow (the first sample sets it)."""
    return sample if not mean else 0.8 * mean + 0.2 * sample


def silence(heard_at: float, now: float) -> str | None:
    """Why a gateway last heard from at `heard_at` counts as unresponsive at `now`, or None."""
    quiet = now - heard_at
    if quiet <= SILENT_S:
        return None
    return (
        f"said nothing for {quiet:.0f} s (it beats every {PULSE_S:.0f} s; a stopped or wedged process) and was killed"
    )


def find_raylet(socket_name: str | None) -> int | None:
    """The pid of the raylet serving `socket_name` on this node, or None (not found, not visible)."""
    if not socket_name:
        return None
    flag = f"--raylet_socket_name={socket_name}"
    for pid, _fields in live_processes():
        args = command_line(pid)
        if args and os.path.basename(args[0]) == "raylet" and flag in args:
            return pid
    return None


def _end_this_process() -> None:
    """SIGKILL to itself: no Ray call can hold it (ray.shutdown() with a dead raylet may hang), and the
    loader kills the rest of its session."""
    os.kill(os.getpid(), signal.SIGKILL)


class Pulse:
    """The gateway's heartbeat thread: `send(("alive",))` every PULSE_S; when the raylet `raylet_pid`
    is gone, one warning (the loader gets it) and `on_raylet_gone()`, by default the end of the process."""

    def __init__(self, send, raylet_pid: int | None, on_raylet_gone=_end_this_process):
        self._send, self.raylet_pid, self._on_raylet_gone = send, raylet_pid, on_raylet_gone
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fusionflow-gateway-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(PULSE_S):
            if self.raylet_pid is not None and not pid_alive(self.raylet_pid):
                log.warning(
                    "remote_workers: this node's raylet (pid %d) is gone; the Ray gateway exits so that its "
                    "tiny-batches run elsewhere",
                    self.raylet_pid,
                )
                self._on_raylet_gone()
                return
            try:
                self._send(("alive",))
            except Exception:  # the loader is gone: the main loop finds out too
                return
