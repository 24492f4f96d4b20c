"""A loader never closed: its accelerators stopped, and the DALI pipelines kept for its next epoch closed, at
interpreter exit -- before DALI's own exit hook (registered after DALI's import, this one runs first). GpuSession
(accel/session.py) registers each accelerator it starts and each pipeline it keeps (`keep_or_close`, `keep_idle`)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref

log = logging.getLogger("fusionflow.loader")

LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accelerator -> the pid that started it
IDLE: weakref.WeakSet = weakref.WeakSet()  # DALI pipelines kept for a loader's next manager (close() is idempotent)
EXIT_HOOK_PID: list[int] = []  # the process that registered the exit hook (a forked child inherits it)


def stop_at_exit(accel) -> None:
    """Stop `accel` at interpreter exit if its loader was never closed. DALI shuts every pipeline down in
    its own exit hook, under a running accelerator thread: the run in flight failed, the thread rebuilt
    the graph mid-teardown, and the user saw DALI's and our tracebacks. Registered after DALI's import
    (a pipeline exists), this hook runs before DALI's."""
    LIVE[accel] = os.getpid()
    if os.getpid() not in EXIT_HOOK_PID:
        EXIT_HOOK_PID.append(os.getpid())
        atexit.register(stop_live)


def stop_live() -> None:
    if os.getpid() not in EXIT_HOOK_PID:  # a forked child that runs exit hooks: not its accelerators
        return
    for accel in [a for a, pid in list(LIVE.items()) if pid == os.getpid()]:  # (a forked copy's: the parent's)
        accel.keep_pipeline = None  # closed now, not kept for a next epoch
        try:
            accel.stop()
        except Exception:  # exiting anyway: one that cannot stop must not keep the others running
            log.exception("stopping the DALI accelerator at exit failed")
    for pipeline in list(IDLE):  # before DALI's hook too: a loader's finalizer may run after it
        try:
            pipeline.close()
        except Exception:
            log.exception("closing an idle DALI pipeline at exit failed")


def keep_or_close(pipeline, keep, retired) -> None:
    """A stopped accelerator's pipeline: given to `keep` (its keep_pipeline) if it can run again -- no run in flight,
    the accelerator never `retired` -- else closed. A kept one refers to its accelerator no more."""
    if keep is None or retired or not pipeline.idle:
        pipeline.close()
        return
    pipeline.build_guard = contextlib.nullcontext
    pipeline.forget_last_run()  # this epoch's input helpers' bytes: not held through the gap
    keep(pipeline)


class Spares(list):
    """A loader's DALI pipelines kept idle for its next manager (GpuSession's). Once `shut` (the loader closed), a
    pipeline kept later -- by an accelerator thread that outlived its stop, when its run returned -- is closed."""

    def __init__(self):
        super().__init__()
        self.lock, self.shut = threading.Lock(), False


def keep_idle(spares: Spares, pipeline) -> None:
    """An accelerator's keep_pipeline: the session's Spares (not the session: the accelerator lives on the manager)."""
    with spares.lock:
        if not spares.shut:
            spares.append(pipeline)
            IDLE.add(pipeline)
            return
    pipeline.close()
