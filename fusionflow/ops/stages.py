"""Per-stage timing of the CPU pipeline (opt-in: `FusionFlowLoader(..., stage_times=True)`).

A worker with stage timing on runs each sample with a `StageClock` as the pipeline's `tick`: the
clock adds the time since the previous tick to that stage's total. Stages, in order: read
(dataset[i]), decode+crop+resize (one pass: the window decoder crops and scales while it decodes),
flip, each ColorJitter adjustment, grayscale, each policy op by name, write (into the ring slot). Per task the
worker sends the totals in its DONE message (a fixed run of int64 ns, runtime/messages.py); the
loader sums them per worker in `loader.stats` (`stage_seconds()`, `stage_shares()`).

Off (the default) the pipeline's only cost is a `tick is None` test per stage.
"""

from __future__ import annotations

import time

READ, DECODE, FLIP, GRAYSCALE, WRITE = "read", "decode+crop+resize", "flip", "grayscale", "write"
BLUR = "blur"


def stage_names(policy) -> tuple[str, ...]:
    """The stages a policy's samples go through, in pipeline order (each op once, by name; an AugMix
    mixture, its chains included, as one stage "augmix")."""
    aug = policy.augment
    jitter = policy.jitter  # ColorJitter's ops, then the grayscale: after the flip (or after the augment ops)
    color = [op for op, r in zip(jitter.OPS, jitter.ranges) if r is not None] if jitter is not None else []
    color += [GRAYSCALE] if policy.grayscale > 0 else []
    names = [] if policy.color_after_augment else color
    names += [op.name for op in aug.ops]
    if aug.type in ("augmix", "timm-augmix"):
        names.append("augmix")
    elif aug.timm is not None:
        from fusionflow.policy.timm_augment import TIMM_OPS

        timm_ops = aug.timm.ops or tuple(step[0] for sub in aug.timm.subpolicies for step in sub)
        names += [TIMM_OPS[name][0] for name in timm_ops]
    elif aug.type == "deepaa":
        from fusionflow.policy.deepaa import fusionflow_ops

        names += fusionflow_ops(aug.deepaa)
    names += color if policy.color_after_augment else []
    names += [BLUR] if policy.blur is not None else []
    return (READ, DECODE, FLIP, *dict.fromkeys(names), WRITE)


class StageClock:
    """Accumulates nanoseconds per stage; call `start()` before a sample, `clock(stage)` after each."""

    def __init__(self, names: tuple[str, ...]):
        self.names = tuple(names)
        self._index = {n: k for k, n in enumerate(self.names)}
        self._totals = [0] * len(self.names)
        self._last = 0

    def start(self) -> None:
        self._last = time.monotonic_ns()

    def __call__(self, stage: str) -> None:
        now = time.monotonic_ns()
        self._totals[self._index[stage]] += now - self._last
        self._last = now

    def take(self) -> tuple[int, ...]:
        """The totals since the last take (then zeroed)."""
        out = tuple(self._totals)
        self._totals = [0] * len(self.names)
        return out


def shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each stage's share of the total, largest first."""
    total = sum(seconds.values())
    if total <= 0:
        return {}
    return dict(sorted(((k, v / total) for k, v in seconds.items()), key=lambda kv: -kv[1]))


def format_shares(share: dict[str, float], top: int | None = None) -> str:
    items = list(share.items())[:top]
    return ", ".join(f"{name} {100 * s:.0f}%" for name, s in items)
