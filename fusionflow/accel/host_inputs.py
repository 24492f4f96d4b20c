"""The DALI graph's host inputs as dense columns, and the helper process that makes them.

Every sample a DALI run takes needs its draw resolved on the host: the crop window (from the image's
size), the flips, each op slot's op id and parameters, the erased rectangle. That is the same
`SampleDraw` a CPU worker makes -- a pure function of (seed, epoch, index, copy) -- and costs ~30 us of
Python per sample (the draw ~20, the window and parameters ~6, small arrays the rest). In the
training process that is GIL taken from the training loop: at a GPU share of 5,000 img/s, 15% of a
core (issue 41's budget for everything the accelerator does there is 20 us a sample).

`HostInputs` makes the columns for a whole run at once: one array per DALI input, a row per sample.
`InputHelper` runs it in a helper process (one per accelerator, the CPU workers' multiprocessing
context): the accelerator thread sends a run's (indices, copies, sizes) and receives the columns, two
messages per run whatever its size, its thread asleep meanwhile. The helper's CPU time is reported with
each reply (`cpu_seconds`), so the cost is moved, not hidden.

The helper is an optimisation, never a dependency: if it dies, stops answering within `timeout`, or
cannot start, the accelerator logs it and makes the columns in its own thread (`HostInputs.columns`,
the same function); a helper is not used for erasing with noise (`erase.value` None: a full-size
noise image per sample is cheaper made where DALI is fed than sent through a pipe). It ignores SIGINT
(the terminal's Ctrl-C is the training process's to handle), closes the descriptors a fork gave it,
and ends on its pipe's end-of-file, so a killed training process leaves no helper behind.

Imports numpy and the policy package only: a spawned helper stays light.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np

from fusionflow.accel.helper_reads import HelperReader, HelperRun, ReadFailed, TargetsStayHome, byte_slots
from fusionflow.policy import Policy, crop_window, draw
from fusionflow.policy.op_specs import NUM_PARAMS
from fusionflow.runtime.procs import OURS, interrupts_deferred
from fusionflow.runtime.shm import forking_ours

log = logging.getLogger(__name__)
MAX_HELPERS = 4  # helper processes at most (a run's inputs cut into this many shares)
MIN_SHARE = 16  # the fewest samples worth a helper's message of their own (a message costs ~0.1 ms)
MAX_READ_FAILURES = 3  # runs the helpers failed to read before the accelerator reads every run itself


class HostLayout:
    """Where a sample's dense host inputs sit in its one packed float32 row: DALI gets a run's inputs as
    one array (`pack`), not one feed per input -- each of DALI's `feed_input` calls costs ~0.1-0.2 ms
    of Python in the training process whatever the run's size -- and the graph slices them back out
    (`span`). Op ids and flips are small integers: exact in float32. The erase noise (a full-size image
    per sample) stays an input of its own."""

    NAMES = ("anchor", "shape", "flip", "op_ids", "params", "erase_anchor", "erase_shape")

    def __init__(self, slots: int, erases: bool):
        widths = (2, 2, 1, slots, slots * NUM_PARAMS) + ((2, 2) if erases else ())
        self.spans, start = {}, 0
        for name, width in zip(self.NAMES, widths):
            self.spans[name] = (start, start + width)
            start += width

    def span(self, name: str) -> tuple[int, int]:
        return self.spans[name]

    def pack(self, columns: list[np.ndarray]) -> np.ndarray:
        """The (n, width) float32 rows of `HostInputs.columns`' dense columns (the noise, if any, excluded)."""
        dense = columns[: len(self.spans)]
        n = len(dense[0])
        return np.concatenate([np.asarray(c, np.float32).reshape(n, -1) for c in dense], axis=1)


def op_names(policy: Policy) -> list[str]:
    """The DALI graph's local op ids: 0 is Identity (an empty slot), then the policy's ops in file order."""
    return ["Identity"] + [o.name for o in policy.augment.ops if o.name != "Identity"]


class HostInputs:
    """A policy's DALI host inputs: per sample (`sample`) or per run as dense columns (`columns`).
    Column order: anchor [left, top], shape [w, h], flip, op ids, op parameters, then the erase inputs
    when the policy erases (anchor [top, left], shape [h, w], and for noise the full-size noise)."""

    def __init__(self, policy: Policy, slots: int | None = None):
        self.policy = policy
        self.local = {name: i for i, name in enumerate(op_names(policy))}
        self.slots = policy.augment.max_ops if slots is None else slots

    def sample(self, index: int, seed: int, epoch: int, copy: int, size: tuple[int, int]) -> tuple:
        """One sample's inputs (after the encoded bytes), as `DaliPolicyPipeline.prepare` returns them."""
        d = draw(self.policy, seed, epoch, index, copy)
        top, left, h, w = crop_window(self.policy, d, *size)
        out_h, out_w = self.policy.size
        op_ids = np.zeros(self.slots, np.int32)
        params = np.zeros((self.slots, NUM_PARAMS), np.float32)
        for k, op in enumerate(d.ops):
            op_ids[k] = self.local[op.name]
            params[k] = op.params(out_h, out_w)
        cols = (np.array([left, top], np.float32), np.array([w, h], np.float32), np.int32(d.flip), op_ids, params)
        return cols + self._erase(d)

    def columns(self, indices, copies, sizes, seed: int, epoch: int) -> list[np.ndarray]:
        """The inputs of a run: sample i has dataset index indices[i], occurrence copies[i] (None: all 0)
        and (height, width) sizes[i]. One array per input, a row per sample (`sample`'s, stacked)."""
        copies = np.zeros(len(indices), np.int64) if copies is None else copies
        rows = (
            self.sample(int(i), seed, epoch, int(c), (int(z[0]), int(z[1]))) for i, c, z in zip(indices, copies, sizes)
        )
        return [np.stack(col) for col in zip(*rows)]

    def _erase(self, d) -> tuple:
        """(anchor [top, left], shape [h, w]) of the erased rectangle ([0, 0] when not erased), and for
        value 'random' the noise as a full-size CHW image, zero outside the rectangle."""
        erase = self.policy.erase
        if erase is None:
            return ()
        e = d.erase
        anchor = np.array([e.top, e.left] if e else [0, 0], np.float32)
        shape = np.array([e.height, e.width] if e else [0, 0], np.float32)
        if erase.value is not None:
            return (anchor, shape)
        noise = np.zeros(self.policy.out_shape, np.float32)
        if e is not None:
            noise[:, e.top : e.top + e.height, e.left : e.left + e.width] = e.fill(erase)
        return (anchor, shape, noise)


class InputHelper:
    """`HostInputs.columns` in `processes` helper processes: a run of at least 2 * MIN_SHARE samples is cut
    into contiguous shares, one per helper, all sent before any answer is awaited, so the accelerator
    thread waits for the slowest share, not the sum (the H200, 2026-11-28: one helper's answer was 29% of
    the thread's wall time, ~70 us a sample of its ~140). `columns` raises what a helper raised computing
    them, or HelperGone when a helper is dead, unreachable or silent for `timeout` seconds (the caller then
    makes them itself); `close` ends them all (idempotent, bounded)."""

    def __init__(self, inputs: HostInputs, ctx, timeout: float = 60.0, processes: int = 1, reads=None):
        """`reads`: (dataset, run_samples, runs_in_flight, seed) to have the helpers read the runs too (`read`)."""
        if processes < 1:
            raise ValueError(f"processes={processes} must be >= 1")
        self.timeout, self.cpu_seconds = timeout, 0.0  # the helpers' CPU time so far (their last replies')
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
        log.warning("the DALI input helpers cannot read this dataset (%s); the accelerator reads its runs", why)
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
            replies = []
            for k, conn in enumerate(self._conns[:shares]):  # every answer read: the pipes stay in step
                if not conn.poll(self.timeout):
                    raise HelperGone(f"DALI input helper {k} gave no answer within {self.timeout:.0f} s")
                replies.append(conn.recv())
                self._cpu[k] = replies[-1][2]
        except Exception as exc:  # an answer left unread would be the next run's: the helpers are done
            self.close()
            if isinstance(exc, HelperGone):
                raise
            raise HelperGone(f"a DALI input helper is gone or its answer unreadable ({exc!r})") from exc
        self.cpu_seconds = sum(self._cpu)
        failed = next((payload for ok, payload, _ in replies if not ok), None)
        if failed is not None:
            raise failed
        return [payload for _, payload, _ in replies]

    def columns_or_none(self, indices, copies, sizes, seed: int, epoch: int) -> list[np.ndarray] | None:
        """`columns`, or None once a helper is gone (said once, in the log; the helpers are closed)."""
        try:
            return self.columns(indices, copies, sizes, seed, epoch)
        except HelperGone as exc:
            log.warning("%s; the accelerator makes its inputs in its own thread from now on", exc)
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
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
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
            log.warning("the DALI input helpers cannot read the dataset (%r); the accelerator reads its runs", exc)
            return InputHelper(HostInputs(policy), ctx, processes=processes)
    except Exception as exc:  # the accelerator works without one
        log.warning("the DALI input helper did not start (%r); the accelerator makes its inputs itself", exc)
        return None
