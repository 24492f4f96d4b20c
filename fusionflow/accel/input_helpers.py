"""The helper processes that make a DALI run's host inputs (accel/host_inputs.py's `HostInputs`) and read its samples.

`InputHelper` runs `HostInputs.columns` in helper processes (the CPU workers' multiprocessing context): the
accelerator thread sends a run's (indices, copies, sizes) and receives the columns, two messages per helper
per run whatever its size, its thread asleep meanwhile. With `reads` they read the run's samples too
(accel/helper_reads.py). Each reply carries the helper's CPU time (`cpu_seconds`), so the cost is moved, not
hidden.

The helpers are an optimisation, never a dependency: if one dies, is stopped (SIGSTOP, a debugger) for
STOPPED_S, stays silent past its answer bound, or cannot start, the accelerator logs it and makes the columns
(and reads the runs) in its own thread (`HostInputs.columns`, the same function). The answer bound stays below
the accelerator's stall bound (runtime/liveness.py, accelerator.py `watch`), so that a helper that does not
answer costs the accelerator its helpers, never its run: until 2026-11-29 a helper stopped mid-run held the
accelerator 25 s and then retired it. A helper is not used for erasing with noise (`erase.value` None: a
full-size noise image per sample is cheaper made where DALI is fed than sent through a pipe). It ignores SIGINT
(the terminal's Ctrl-C is the training process's to handle), closes the descriptors a fork gave it, and ends on
its pipe's end-of-file, so a killed training process leaves no helper behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np

from fusionflow.accel.header_sizes import HeaderSizes
from fusionflow.accel.helper_reads import HelperReader, HelperRun, ReadFailed, TargetsStayHome, byte_slots
from fusionflow.accel.host_inputs import HostInputs
from fusionflow.accel.run_read import RunRead, read_for_run, read_run
from fusionflow.runtime import liveness
from fusionflow.runtime.authsock import recv_whole
from fusionflow.runtime.procs import OURS, interrupts_deferred, is_stopped
from fusionflow.runtime.shm import forking_ours

log = logging.getLogger(__name__)
MAX_HELPERS = 4  # helper processes at most (a run's inputs cut into this many shares)
MIN_SHARE = 16  # the fewest samples worth a helper's message of their own (a message costs ~0.1 ms)
MAX_READ_FAILURES = 3  # runs the helpers failed to read before the accelerator reads every run itself
STOPPED_S = liveness.STRAGGLER_FLOOR_S  # a helper stopped this long is given up (a CPU worker's is rerun by then)
ANSWER_SHARE = 0.5  # a running helper's answer bound: this share of the stall bound of a run as long as its answers
# (the other half: the run's time before it was asked for, and the thread's own read of it once the helpers are gone)
SLICE_S = 0.25  # an answer is awaited in slices this long, to see a stopped helper or an `interrupt`


class InputHelper:
    """`HostInputs.columns` in `processes` helper processes: a run of at least 2 * MIN_SHARE samples is cut
    into contiguous shares, one per helper, all sent before any answer is awaited, so the accelerator
    thread waits for the slowest share, not the sum (the H200, 2026-11-28: one helper's answer was 29% of
    the thread's wall time, ~70 us a sample of its ~140). `columns` raises what a helper raised computing
    them, or HelperGone when a helper is dead, unreachable, stopped STOPPED_S, silent past `answer_bound`, or
    `interrupt`ed (the caller then makes them itself); `close` ends them all (idempotent, bounded)."""

    def __init__(self, inputs: HostInputs, ctx, timeout: float | None = None, processes: int = 1, reads=None):
        """`reads`: (dataset, run_samples, runs_in_flight, seed) to have the helpers read the runs too (`read`).
        `timeout`: seconds a running helper may take to answer; None: `answer_bound`'s measured bound."""
        if processes < 1:
            raise ValueError(f"processes={processes} must be >= 1")
        self.timeout, self.cpu_seconds = timeout, 0.0  # the helpers' CPU time so far (their last replies')
        self.answer_seconds = 0.0  # the running mean of a run's answers (from the first request to the last reply)
        self._interrupted = False
        self._conns, self._procs, self._cpu = [], [], [0.0] * processes
        self.slots, self.read_failures, self._unconfirmed = byte_slots(reads, processes, MIN_SHARE), 0, None
        self._retired = []  # slots of helpers that read no more: mapped until the helpers close (runs read them)
        forked = ctx.get_start_method() == "fork"  # then each inherits every descriptor of the training process
        try:
            for k in range(processes):
                conn, child = ctx.Pipe()
                self._conns.append(conn)
                reader = None
                if self.slots is not None:
                    # what a forked helper closes: the training process's ends of every helper's pipe (its own
                    # included: else it never sees end-of-file when the training process dies), the other segments
                    siblings = [c.fileno() for c in self._conns] + self.slots.fds_but(k)
                    reader = HelperReader(
                        reads[0], self.slots.child_fd(k), self.slots.slots, self.slots.slot_bytes, siblings
                    )
                try:
                    seed = None if reads is None else (reads[3] * 1_000_003 + k + 1) % 2**63
                    proc = ctx.Process(
                        target=serve, args=(inputs, child, forked, reader, seed), name=f"{OURS}dali-inputs-{k}"
                    )
                    proc.daemon = True
                    with interrupts_deferred(), forking_ours():  # a Ctrl-C in the fork left a zombie helper
                        proc.start()
                        self._procs.append(proc)
                finally:
                    child.close()
        except BaseException:
            self.close()
            raise
        finally:
            if self.slots is not None:
                self.slots.forget_fds()  # the helpers have theirs (inherited, or passed at start)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def columns(self, indices, copies, sizes, seed: int, epoch: int) -> list[np.ndarray]:
        indices = np.asarray(indices, np.int64)
        copies = None if copies is None else np.asarray(copies, np.int64)
        sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
        replies = self._ask(len(indices), lambda p: ("columns", indices[p], _part(copies, p), sizes[p], seed, epoch))
        return replies[0] if len(replies) == 1 else [np.concatenate(col) for col in zip(*replies)]

    def read(self, indices, copies, seed: int, epoch: int):
        """The run's samples read by the helpers (their dataset's batched read, header sizes, draws), the encoded
        bytes in a slot of shared memory (a HelperRun). None where the helpers do not read (none do, no slot is
        free, or a helper's read failed: the caller reads the run, so an error is raised where it always was).
        Raises as `columns` does (HelperGone: the helpers are gone)."""
        self._unconfirmed = None
        slot = self.slots.take() if self.slots is not None else None
        if slot is None:
            return None
        indices = np.asarray(indices, np.int64)
        copies = None if copies is None else np.asarray(copies, np.int64)
        try:
            replies = self._ask(len(indices), lambda p: ("read", indices[p], _part(copies, p), seed, epoch, slot.index))
        except TargetsStayHome as exc:  # the training process reads every run from now on
            slot.release()
            self._stop_reading(exc)
            return None
        except ReadFailed as exc:  # counted once the training process has read the run (`read_here`)
            slot.release()
            self._unconfirmed = exc
            return None
        except BaseException:
            slot.release()
            raise
        samples, labels = [], []
        for segment, (_, targets, offsets, lengths, _) in zip(self.slots.segments, replies):  # helper k's segment
            samples += map(segment.__getitem__, map(slice, offsets.tolist(), (offsets + lengths).tolist()))
            labels += targets
        hw = np.concatenate([reply[0] for reply in replies])
        offsets = np.concatenate([reply[2] for reply in replies])
        columns = [np.concatenate(col) for col in zip(*(reply[4] for reply in replies))]
        return HelperRun(hw, labels, columns, samples, np.flatnonzero((offsets < 0) & (hw[:, 0] > 0)).tolist(), slot)

    def read_here(self) -> None:
        """The training process read the run the helpers failed to read: their failure was theirs, not the
        dataset's (a corrupt sample fails there too, and is not counted). MAX_READ_FAILURES such runs and the
        helpers read no more (the segments stay mapped until they close: runs in flight read them)."""
        failed, self._unconfirmed = self._unconfirmed, None
        if failed is None or self.slots is None:
            return
        self.read_failures += 1
        if self.read_failures >= MAX_READ_FAILURES:
            self._stop_reading(failed)

    def _stop_reading(self, why) -> None:
        log.warning(
            "fusionflow: the DALI input helpers cannot read this dataset (%s); the accelerator reads its runs", why
        )
        self._retired.append(self.slots)
        self.slots = None

    def _ask(self, n: int, request) -> list:
        """Send `request(part)` to each helper for a contiguous part of n samples (one part per helper, at least
        MIN_SHARE samples each), then read every answer: the payloads, in order."""
        if not self._conns:
            raise HelperGone("the DALI input helpers are closed")
        shares = max(1, min(len(self._conns), n // MIN_SHARE))
        cuts = [n * k // shares for k in range(shares + 1)]
        try:
            for conn, a, b in zip(self._conns, cuts, cuts[1:]):
                conn.send(request(slice(a, b)))
            replies, asked = [], time.monotonic()
            for k, conn in enumerate(self._conns[:shares]):  # every answer read: the pipes stay in step
                self._await_answer(k, conn, asked)  # begun: the rest within STOPPED_S (a helper stopped mid-write)
                replies.append(ForkingPickler.loads(recv_whole(conn, rest_s=STOPPED_S)))
                self._cpu[k] = replies[-1][2]
            took = time.monotonic() - asked
            self.answer_seconds = 0.8 * self.answer_seconds + 0.2 * took if self.answer_seconds else took
        except Exception as exc:  # an answer left unread would be the next run's: the helpers are done, killed now
            self.close(timeout=0.0)
            if isinstance(exc, HelperGone):
                raise
            raise HelperGone(f"a DALI input helper is gone or its answer unreadable ({exc!r})") from exc
        self.cpu_seconds = sum(self._cpu)
        failed = next((payload for ok, payload, _ in replies if not ok), None)
        if failed is not None:
            raise failed
        return [payload for _, payload, _ in replies]

    def answer_bound(self) -> float:
        """Seconds a running helper may take to answer: `timeout`, else ANSWER_SHARE of the stall bound the
        accelerator's `watch` puts on a run taking as long as the helpers' answers (runtime/liveness.py; a run
        takes at least its answer, so its bound is at least that): the helpers are given up before the run is."""
        return self.timeout if self.timeout is not None else ANSWER_SHARE * liveness.stuck_bound(self.answer_seconds)

    def interrupt(self) -> None:
        """From another thread (the accelerator's stop): an answer awaited now, or later, raises HelperGone
        within SLICE_S."""
        self._interrupted = True

    def _await_answer(self, k: int, conn, asked: float) -> None:
        """Until helper k's answer can be read (or its pipe's end): HelperGone once it has been stopped for
        STOPPED_S, has run `answer_bound` seconds since `asked`, or the helpers are interrupted."""
        bound, stopped_at, pid = self.answer_bound(), None, self._procs[k].pid
        while not conn.poll(SLICE_S):
            now = time.monotonic()
            if self._interrupted:
                raise HelperGone("the DALI input helpers were interrupted (the accelerator stops)")
            stopped_at = (stopped_at or now) if is_stopped(pid) else None
            if stopped_at is not None and now - stopped_at >= STOPPED_S:
                raise HelperGone(f"DALI input helper {k} (pid {pid}) has been stopped for {now - stopped_at:.0f} s")
            if now - asked >= bound:
                raise HelperGone(f"DALI input helper {k} (pid {pid}) gave no answer within {bound:.0f} s")

    def columns_or_none(self, indices, copies, sizes, seed: int, epoch: int) -> list[np.ndarray] | None:
        """`columns`, or None once a helper is gone (said once, in the log; the helpers are closed)."""
        try:
            return self.columns(indices, copies, sizes, seed, epoch)
        except HelperGone as exc:
            log.warning("fusionflow: %s; the accelerator makes its inputs in its own thread from now on", exc)
            self.close()
            return None

    def close(self, timeout: float = 5.0) -> None:
        """End every helper within `timeout` seconds in all, killing those that have not ended by then. Polled:
        a forked helper closes the descriptor `join` waits on (serve's close_inherited), so `join` would block
        in waitpid for a helper that does not end."""
        conns, procs, self._conns, self._procs = self._conns, self._procs, [], []
        for conn in conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            conn.close()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() and not is_stopped(p.pid) for p in procs) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:  # interrupted too (a Ctrl-C in the wait): no helper left running, no segment left mapped
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()  # ended or killed: waitpid returns
            for slots in [self.slots, *self._retired]:
                if slots is not None:
                    slots.close()
            self.slots, self._retired = None, []


class RunSource:
    """Where the accelerator's runs get their samples and host inputs: its InputHelper (`helper`, owned from here)
    while the helpers answer, else its own thread (`read_run`, and `columns` None: the pipeline makes them).
    The helpers' CPU time goes to `counters` (accelerator_inputs_cpu_seconds)."""

    def __init__(self, helper: InputHelper | None, dataset, max_pixels: int | None, seed: int, counters):
        self.helper, self.dataset, self.max_pixels, self.seed = helper, dataset, max_pixels, seed
        self.counters, self.stopping = counters, False
        self.dims = HeaderSizes(len(dataset) if hasattr(dataset, "__len__") else 0)  # (height, width) per sample

    def read(self, group) -> RunRead:
        """`group` read by the helpers where they read it (with its host inputs), else here; an empty read once
        `interrupt`ed (the accelerator stops)."""
        helper = self.helper
        try:
            return read_for_run(helper, self.dataset, group, self.dims, self.max_pixels, self.seed)
        except HelperGone as exc:  # closed: the accelerator's thread reads and makes the inputs from now on
            if self.stopping:
                return RunRead(sizes=[])
            log.warning(
                "fusionflow: %s; the accelerator reads its runs and makes its inputs in its own thread from now on", exc
            )
            self.helper = None
            return read_run(self.dataset, group, self.dims, self.max_pixels)
        finally:
            if helper is not None:
                self.counters.accelerator_inputs_cpu_seconds = helper.cpu_seconds

    def columns(self, indices, copies, sizes, epoch: int):
        """The run's host inputs from the helpers; None (the pipeline makes them) once they are gone."""
        helper, columns = self.helper, None
        if helper is not None:  # gone: columns_or_none closed them
            columns = helper.columns_or_none(indices, copies, sizes, self.seed, epoch)
            self.counters.accelerator_inputs_cpu_seconds = helper.cpu_seconds
            self.helper = helper if columns is not None else None
        return columns

    def interrupt(self) -> None:
        """From another thread: an answer awaited from the helpers now or later is given up (HelperGone)."""
        self.stopping = True
        if self.helper is not None:
            self.helper.interrupt()

    def close(self) -> None:
        if self.helper is not None:
            self.helper.close()


class HelperGone(RuntimeError):
    """The input helper cannot answer: the accelerator makes its inputs itself from then on."""


def _part(copies, p):
    return None if copies is None else copies[p]


def serve(inputs: HostInputs, conn, close_inherited: bool = False, reader=None, seed=None) -> None:
    """The helper's loop: a request in, its payload (or the exception) out, until None or end-of-file.
    `close_inherited` (a forked helper): every descriptor but stdio and its pipe is closed first, so the
    helper never keeps a socket, pipe or shared-memory segment of the training process open past its
    owner's close (a peer waiting for end-of-file would wait for this process instead). `reader`
    (helper_reads.HelperReader): the helper reads runs too, and closes only what a CPU worker does (`attach`:
    the dataset's own descriptors stay)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler of the script's: end quietly
    if reader is not None:
        reader.attach(close_inherited, seed)
    elif close_inherited:
        fd = conn.fileno()
        os.closerange(3, fd)
        os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        try:
            reply = (True, _answer(inputs, reader, request), time.process_time())
        except Exception as exc:  # sent back: the accelerator handles it as its own run's failure
            reply = (False, exc, time.process_time())
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return
        except Exception as exc:  # an exception (or a target) that does not pickle: its text instead
            what = "the reply" if reply[0] else repr(reply[1])
            failed = ReadFailed if request[0] == "read" else RuntimeError  # a read: the training process reads it
            conn.send((False, failed(f"{what} does not pickle ({exc!r})"), reply[2]))


def _answer(inputs: HostInputs, reader, request):
    kind, *args = request
    if kind == "columns":
        return inputs.columns(*args)
    indices, copies, seed, epoch, slot = args
    try:
        hw, labels, offsets, lengths = reader.read(indices, slot)
    except ReadFailed:
        raise
    except Exception as exc:
        raise ReadFailed(repr(exc)) from None
    return hw, labels, offsets, lengths, inputs.columns(indices, copies, np.where(hw > 0, hw, 1), seed, epoch)


def helper_processes(on_gpu: bool, cores: int, workers: int, threads: int) -> int:
    """How many helper processes: on a GPU the cores left beside the CPU workers, DALI's threads and the
    training loop (1 to MAX_HELPERS; `cores`: this rank's, runtime/cores.py rank_cores); on DALI's CPU backend
    1 (the CPU workers and DALI have the cores)."""
    return max(1, min(MAX_HELPERS, cores - workers - threads - 1)) if on_gpu else 1


def start_helper(policy, ctx=None, processes: int = 1, reads=None) -> InputHelper | None:
    """An InputHelper of `processes` helpers for `policy` in multiprocessing context `ctx` (None: the default),
    or None where the accelerator makes its inputs itself: erasing with noise, or a helper that cannot start.
    `reads`: (dataset, run_samples, runs_in_flight, seed): the helpers read the runs too (InputHelper.read)."""
    import multiprocessing

    from fusionflow.policy import load_policy

    policy = load_policy(policy)
    if policy.erase is not None and policy.erase.value is None:
        return None
    try:
        ctx = ctx if ctx is not None else multiprocessing.get_context()
        try:
            return InputHelper(HostInputs(policy), ctx, processes=processes, reads=reads)
        except Exception as exc:  # e.g. a dataset that does not pickle (spawn): they make the draws only
            if reads is None:
                raise
            log.warning(
                "fusionflow: the DALI input helpers cannot read the dataset (%r); the accelerator reads its runs", exc
            )
            return InputHelper(HostInputs(policy), ctx, processes=processes)
    except Exception as exc:  # the accelerator works without one
        log.warning(
            "fusionflow: the DALI input helper did not start (%r); the accelerator makes its inputs itself", exc
        )
        return None
