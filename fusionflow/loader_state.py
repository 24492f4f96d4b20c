"""FusionFlowLoader's checkpointing: `state_dict()` / `load_state_dict()` and the bookkeeping of the
epoch in progress that they read (what the pure capture/restore in fusionflow/state.py needs)."""
from __future__ import annotations

import dataclasses
import warnings

from fusionflow import state as ff_state


class Checkpointing:
    """A base class of FusionFlowLoader: its position, to resume it exactly (fusionflow/state.py)."""

    def state_dict(self) -> dict:
        """The loader's position, to resume it exactly: small (no pixels), picklable, torch.save-able.

        Taken anywhere -- between epochs, or mid-epoch after k batches were yielded -- and loaded into
        a fresh loader over the same dataset (any num_workers) with `load_state_dict`, the resumed
        loader yields exactly the batches the original would have yielded next -- the rest of the
        epoch, same indices and pixels -- and the same epochs after it. A loader that stopped
        mid-epoch (`break`) resumes that epoch's remaining batches."""
        in_epoch = self._yielded is not None
        ff_state.warn_if_unresumable(self.batch_sampler, self.sampler)
        return {
            "version": ff_state.VERSION,
            "dataset_len": len(self.dataset), "batch_size": self.capacity, "drop_last": self.drop_last,
            "num_batches": len(self), "seed": self.seed,
            "epoch": self._epoch, "epoch_set": self._epoch_set, "iterations": self._iterations,
            "batches_yielded": self._yielded if in_epoch else None,
            "sampler": (self._epoch_start if in_epoch and self._epoch_start is not None
                        else ff_state.capture(self.batch_sampler, self.sampler)),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the next iteration continues where that loader was. The state's
        seed replaces this loader's (the augmentation is a function of it); the loader must be built
        over a dataset of the same length with the same batch_size, drop_last and kind of sampler."""
        if not isinstance(state, dict) or state.get("version") != ff_state.VERSION:
            raise ValueError(f"state={type(state).__name__} is not a FusionFlowLoader.state_dict() of version "
                             f"{ff_state.VERSION}: pass what loader.state_dict() returned")
        mine = {"dataset_len": len(self.dataset), "batch_size": self.capacity, "drop_last": self.drop_last,
                "num_batches": len(self)}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"the state is from a loader with {key}={state.get(key)!r}, this loader has "
                                 f"{key}={value!r}: build the loader as the one that saved the state was built "
                                 "(same dataset length, batch_size, drop_last and sampler)")
        ff_state.check(state["sampler"], self.batch_sampler, self.sampler)
        yielded = state["batches_yielded"]
        if yielded is not None and not (isinstance(yielded, int) and 0 <= yielded <= len(self)):
            raise ValueError(f"state['batches_yielded']={yielded!r} must be an int in [0, {len(self)}]")
        seed = state["seed"]
        if self._seed_given and seed != self.seed:
            warnings.warn(f"seed={self.seed} was given, but the state was saved with seed={seed}: the state's seed "
                          "is used, so the resumed run augments as the saved one did", UserWarning, stacklevel=2)
        if self.seed != seed:
            self.seed = seed
            self.config = dataclasses.replace(self.config, seed=seed)
            self._stop_manager()  # running workers hold the old seed
        self._epoch, self._epoch_set, self._iterations = state["epoch"], state["epoch_set"], state["iterations"]
        if yielded is not None:  # the next iteration is the saved epoch itself: no epoch + 1
            self._epoch_set, self._iterations = True, max(0, self._iterations - 1)
        self._resume = (state["sampler"], yielded or 0)
        self._yielded = self._epoch_start = None

    def _yielded_one(self, serial: int, done: bool = False) -> None:
        """Count a batch yielded by iteration `serial` (or, `done`, its epoch's end), if it is the newest."""
        if serial == self._serial and self._yielded is not None:
            self._yielded = None if done else self._yielded + 1

    def _epoch_batches(self, serial: int, copies=None):
        """This epoch's batches of indices; records what reproduces them (or restores it, resuming).
        Batches skipped on resume still pass through `copies` (repeated augmentation's counter), so
        the copies after the resume point get the numbers they would have had."""
        saved, skip = self._resume if self._resume is not None else (None, 0)
        self._resume = None
        batches, snapshot = ff_state.start_epoch(self.batch_sampler, self.sampler, saved, skip, on_skip=copies)
        if serial == self._serial:
            self._epoch_start, self._yielded = snapshot, skip
        return batches
