"""The DALI graph's host inputs as dense columns (the helper processes that make them: input_helpers.py).

Every sample a DALI run takes needs its draw resolved on the host: the crop window (from the image's
size), the flips, each op slot's op id and parameters, the erased rectangle. That is the same
`SampleDraw` a CPU worker makes -- a pure function of (seed, epoch, index, copy) -- and costs ~30 us of
Python per sample (the draw ~20, the window and parameters ~6, small arrays the rest). In the
training process that is GIL taken from the training loop: at a GPU share of 5,000 img/s, 15% of a
core (issue 41's budget for everything the accelerator does there is 20 us a sample).

`HostInputs` makes the columns for a whole run at once: one array per DALI input, a row per sample;
`HostLayout` packs them into one float32 row per sample. accel/input_helpers.py runs `HostInputs` in helper
processes, so that this Python runs outside the training process.

Imports numpy and the policy package only: a spawned helper stays light.
"""

from __future__ import annotations

import numpy as np

from fusionflow.policy import Policy, crop_window, draw
from fusionflow.policy.op_specs import NUM_PARAMS
from fusionflow.policy.sampling import run_uniforms


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

    def sample(self, index: int, seed: int, epoch: int, copy: int, size: tuple[int, int], first=None) -> tuple:
        """One sample's inputs (after the encoded bytes), as `DaliPolicyPipeline.prepare` returns them (`first`:
        the sample's uniforms when computed with its run's, sampling.run_uniforms)."""
        d = draw(self.policy, seed, epoch, index, copy, first)
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
        streams = run_uniforms(seed, epoch, indices, copies)  # one call for the run's random streams
        rows = (
            self.sample(int(i), seed, epoch, int(c), (int(z[0]), int(z[1])), u)
            for i, c, z, u in zip(indices, copies, sizes, streams)
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
