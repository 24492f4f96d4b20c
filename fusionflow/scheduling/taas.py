"""Task-affinity-aware scheduling (TAAS): which end of a mini-batch's sorted tiny-batch list each
kind of worker takes, and the online search for K, the number of largest tiny-batches reserved for
the GPU worker.

Pure: the manager feeds it one observation per completed mini-batch (which side finished last,
and the mini-batch's makespan) and asks it for K.

Search: start at K=0. After each mini-batch: if the CPU side finished last, K += 1 (give the GPU
more); if the GPU side did, K -= 1. When the direction has flipped `settle_flips` times, the search
has found the boundary: K settles on the value between the two it oscillates across with the lower
mean makespan, and stays there until `restart()` (e.g. when the worker count changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KSearch:
    k_max: int  # at most this many tiny-batches reserved (a mini-batch's tiny-batch count)
    settle_flips: int = 2
    k: int = 0
    settled: bool = False
    _last_step: int = 0
    _flips: int = 0
    _makespans: dict = field(default_factory=dict)  # K -> [makespan, ...] since the last restart

    def observe(self, cpu_finished_last: bool, makespan: float) -> int:
        """Record one mini-batch run with the current K; returns the K for the next one."""
        self._makespans.setdefault(self.k, []).append(makespan)
        if self.settled:
            return self.k
        step = 1 if cpu_finished_last else -1
        proposed = min(self.k_max, max(0, self.k + step))
        if proposed == self.k:  # pinned at a bound: nothing to search in that direction
            return self.k
        if self._last_step and step != self._last_step:
            self._flips += 1
            if self._flips >= self.settle_flips:
                self.k = min((self.k, proposed), key=lambda k: (self._mean(k), k))
                self.settled = True
                return self.k
        self._last_step = step
        self.k = proposed
        return self.k

    def restart(self, k_max: int | None = None) -> None:
        """Search again from the current K (capacity changed)."""
        if k_max is not None:
            self.k_max = k_max
            self.k = min(self.k, k_max)
        self.settled, self._last_step, self._flips = False, 0, 0
        self._makespans.clear()

    def _mean(self, k: int) -> float:
        runs = self._makespans.get(k)
        return sum(runs) / len(runs) if runs else float("inf")


def cpu_may_take(remaining: int, reserved: int) -> bool:
    """CPU workers take a mini-batch's smallest remaining tiny-batch unless only the `reserved`
    largest (the GPU's) are left."""
    return remaining > reserved
