"""How much of each mini-batch the accelerator takes: G, its largest samples, in one DALI run. Pure.

TAAS's K search (scheduling/taas.py) moved K by one tiny-batch per mini-batch after "which side
finished last": a latency signal. A synchronous GPU run always finished after a small CPU
tiny-batch, so K fell to 0 and the accelerator ran four samples at a time (the H100 run of
2026-11-24: 1,615 img/s against DALI alone's 6,799). The split is computed from measured rates
instead, so that both sides finish a mini-batch together.

The model, per mini-batch of B samples with G on the accelerator:
    the CPU workers take (B - G) * p seconds     p: CPU seconds per sample, all live workers together
    the accelerator's device is busy t * B + G * g seconds
                                                 g: the accelerator's seconds per sample (a run's
                                                    fixed cost spread over its samples)
                                                 t: the training step's seconds per sample on the
                                                    same device (0 when DALI does not share one with
                                                    training: its CPU backend)
    the period is the larger of the two, and the best G balances them:
        G* = B * (p - t) / (g + p), clamped to [0, B].
In throughput terms, with c = 1/p: R = (1 + c*g) / (t + g) when the device bounds it (issue 41's R).

`ShareController` estimates p, g and t online and returns G for the next mini-batch: p from the CPU
workers' tiny-batch times and how many live (a moving average), g from the accelerator's completion
intervals of its share runs (taken at the size it runs, so a run's fixed cost f is folded in: g = g0 +
f/G, whose fixed point is the exact optimum of the model with f; the median of the last ACCEL_WINDOW,
so one run slowed by something else is not a new rate; a run that found the accelerator idle, timed from
its read's end, only lowers it -- its interval holds DALI's latency -- until none has been queued for
2 * ACCEL_WINDOW runs), and t from the iteration period whenever the
CPU side was not what training waited for (then the period is the device's: t*B + G*g; the median of
the last TRAIN_WINDOW, so one long pause -- validation, a checkpoint -- is not a slower model, while a
faster step is taken at once). While the CPU side is the bottleneck the period bounds t from above,
so a training step that got faster is noticed. Tail runs (a few tiny-batches of the mini-batch
training waits for) are not observed: a run's fixed cost over a few samples reads as a slow
accelerator (experiments/twin_gpu.py: G fell from ~190 to 55 that way). G never falls below one
tiny-batch (the accelerator's rate stays measured) nor leaves the CPU side less than one (its rate
too; a mini-batch of fewer than two tiny-batches keeps one for the accelerator, and idle CPU workers
take the ones it has not started): neither side starves -- except where training needs the whole
device (c*t >= 1, or a run's fixed cost is not worth paying): then G is 0 until the CPU side bounds
iterations again, which pushes G up from 0 as above.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MARGIN = 0.02  # a measured device time this much below the estimate contradicts it
ACCEL_WINDOW = 5  # the accelerator's rate: the median of its last runs' (one slow run is not a new rate)
TRAIN_WINDOW = 3  # the training step's device time: the median of its last device-bound iterations


def best_share(batch: int, cpu_s: float, accel_s: float, train_s: float = 0.0) -> int:
    """G in [0, batch] that minimises max(train_s*batch + G*accel_s, (batch - G)*cpu_s): the balance
    point rounded to the better of its two neighbours. All rates are seconds per sample (`cpu_s`: of
    the CPU workers together)."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if min(cpu_s, accel_s, train_s) < 0:
        raise ValueError(f"rates must be >= 0: cpu_s={cpu_s}, accel_s={accel_s}, train_s={train_s}")
    if accel_s + cpu_s == 0:
        return batch // 2
    g_star = batch * (cpu_s - train_s) / (accel_s + cpu_s)
    lo = min(batch, max(0, math.floor(g_star)))
    hi = min(batch, max(0, math.ceil(g_star)))
    return min((lo, hi), key=lambda g: period(batch, g, cpu_s, accel_s, train_s))


def period(batch: int, g: int, cpu_s: float, accel_s: float, train_s: float = 0.0) -> float:
    """The model's seconds per mini-batch with `g` samples on the accelerator."""
    return max(train_s * batch + g * accel_s, (batch - g) * cpu_s)


@dataclass
class ShareController:
    """Online estimates of the model's rates, and the G they give. Feed it `cpu_tiny_batch`,
    `accel_run` and `iteration` observations as they happen; ask `share(batch)`.

    `shares_device`: the accelerator runs on the device training runs on (DALI on the GPU), so the
    training step's time there counts against it; False for DALI's CPU backend.
    `step`: the smallest share and the smallest CPU remainder (a tiny-batch's samples).
    `alpha`: the CPU side's moving average's weight of a new observation."""

    shares_device: bool = True
    step: int = 1
    alpha: float = 0.5
    cpu_s: float | None = None  # seconds per sample on one CPU worker
    accel_s: float | None = None  # accelerator seconds per sample, at the size it runs
    train_s: float = 0.0  # the training step's device seconds per sample (0 until measured)
    last_share: int | None = None  # the G last returned, and the one the observations were made at
    _push: int = 0  # samples added to the model's G while the CPU side keeps bounding iterations
    _cpu_bound: bool = False  # the last iteration was the CPU side's
    _alone: int = 0  # runs in a row that found the accelerator idle (accel_run's `queued` False)
    _accel_seen: deque = field(default_factory=lambda: deque(maxlen=ACCEL_WINDOW))  # seconds per sample
    _train_seen: deque = field(default_factory=lambda: deque(maxlen=TRAIN_WINDOW))  # seconds per sample

    def cpu_tiny_batch(self, seconds: float, samples: int) -> None:
        """A CPU worker took `seconds` for a tiny-batch of `samples` samples."""
        if samples > 0 and seconds >= 0:
            self.cpu_s = self._avg(self.cpu_s, seconds / samples)

    def accel_run(self, seconds: float, samples: int, queued: bool = True) -> None:
        """The accelerator completed a run of `samples` samples `seconds` after the later of its previous
        completion and its own start (its completion interval while busy). `queued` False: the run found
        the accelerator idle (taken after the previous run completed), so its interval (from its read's end)
        holds DALI's latency for it -- its host stages -- not only the pace DALI keeps with runs queued. Such a
        run only bounds the pace from above: a faster one is taken, a slower one is not (on the H200, 2026-11-30,
        read as the pace it shrank G, which left DALI idle between runs, whose intervals read slower still:
        with 15 CPU workers the accelerator took every other mini-batch's share and added nothing)."""
        if samples > 0 and seconds >= 0:
            self._alone = 0 if queued else self._alone + 1
            # (once no run has been queued for 2 * ACCEL_WINDOW runs, the lone runs' own latency is the rate: a faster
            # reading or two could otherwise hold it low for good while DALI got slower)
            slower = self.accel_s is not None and seconds / samples >= self.accel_s
            if not queued and slower and self._alone < 2 * ACCEL_WINDOW:
                return
            self._accel_seen.append(seconds / samples)
            self.accel_s = statistics.median(self._accel_seen)

    def iteration(self, seconds: float, batch: int, cpu_bound: bool) -> None:
        """Training took a mini-batch of `batch` samples `seconds` after the previous one; `cpu_bound`:
        it waited for the CPU workers' part of it."""
        if not self.shares_device or batch < 1 or self.accel_s is None or self.last_share is None:
            return
        device = max(0.0, seconds - self.last_share * self.accel_s) / batch  # exact when the device bounded it
        if not cpu_bound:
            # a faster step is taken at once, a slower one once it is the median (a pause for validation
            # or a checkpoint is one long iteration, not a slower model)
            self._train_seen.append(device)
            self.train_s = min(device, statistics.median(self._train_seen))
            self._push, self._cpu_bound = 0, False
            return
        # The period was the CPU side's: the device's time is at most that. If the estimate said more,
        # it was wrong (training got faster); if the CPU side bounds twice in a row, G is too small.
        # Either way G grows by a step that doubles until the device bounds an iteration again,
        # which measures t afresh.
        contradicted = device < (1 - MARGIN) * self.train_s
        self.train_s = min(self.train_s, device)
        self._train_seen = deque((min(x, device) for x in self._train_seen), maxlen=TRAIN_WINDOW)
        self._push = max(2 * self.step, 2 * self._push) if contradicted or self._cpu_bound else 0
        self._cpu_bound = True

    def share(self, batch: int, workers: int = 1) -> int:
        """G for the next mini-batch of `batch` samples while `workers` CPU workers live: all of it
        without any, half until both sides' rates are measured."""
        step = min(self.step, batch)
        if workers < 1:
            g = batch
        elif self.cpu_s is None or self.accel_s is None:
            g = batch // 2
        else:
            g = best_share(batch, self.cpu_s / workers, self.accel_s, self.train_s)
            if self._push and self.last_share is not None:
                g = max(g, self.last_share + self._push)
        if g == 0 and self.shares_device and self.accel_s is not None:
            pass  # training needs the device more than the CPU workers need help: no run at all
        elif workers >= 1 and batch >= 2 * step:
            g = min(max(g, step), batch - step)
            if g == step and self._idle_is_better(batch, step, workers):
                g = 0
        elif workers >= 1:  # under two tiny-batches: one for the accelerator (its rate stays measured; idle CPU
            g = min(
                max(g, 1), batch
            )  # workers take what it has not taken: whole mini-batches alternate when B <= step)
        self.last_share = g
        return g

    def _idle_is_better(self, batch: int, step: int, workers: int) -> bool:
        """On a shared device, whether no run beats the smallest share (`step` samples): a run's fixed
        cost, spread over the few samples of the last small run, can cost training more than the CPU
        side gains (the twin at ResNet-50's rates with 15 workers: a share of 4 took 10% of the rate).
        Not while the CPU side is pushing G up."""
        if not self.shares_device or self.accel_s is None or self.cpu_s is None or self._push:
            return False
        cpu_s = self.cpu_s / workers
        return period(batch, 0, cpu_s, self.accel_s, self.train_s) <= period(
            batch, step, cpu_s, self.accel_s, self.train_s
        )

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
