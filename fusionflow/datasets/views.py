"""Several views of each sample, as timm's AugMix splits (`num_aug_splits`) feed a JSD loss: `SplitViews`
turns a dataset of N samples into one of N * S indices (view v % S of sample v // S) for a policy with
`views=S` (fusionflow/policy/sampling.py draws one crop per sample, the clean view first), and
`SplitBatches` turns each batch of sample indices into its views in timm's fast-collate order: every
sample's view 0, then every sample's view 1, ..."""

from __future__ import annotations

from fusionflow.datasets.sizes import encoded_sizes


class SplitViews:
    """dataset[v // views] at index v; `sizes` and `describe` follow the sample."""

    def __init__(self, dataset, views: int):
        if not isinstance(views, int) or views < 2:
            raise ValueError(f"views={views!r} must be an integer >= 2")
        self.dataset, self.views = dataset, views
        if (sizes := encoded_sizes(dataset)) is not None:  # (ignored with a warning when they are not sizes)
            self.sizes = [size for size in sizes for _ in range(views)]

    def __len__(self) -> int:
        return len(self.dataset) * self.views

    def __getitem__(self, index: int):
        return self.dataset[index // self.views]

    def describe(self, index: int) -> str:
        sample = index // self.views
        name = self.dataset.describe(sample) if hasattr(self.dataset, "describe") else f"sample {sample}"
        return f"{name} (view {index % self.views})"


class SplitBatches:
    """The batches of `batch_sampler` (sample indices) as view indices, view-major. `sampler` and
    `set_epoch` reach the wrapped sampler; `batch_size` is the largest batch of views."""

    def __init__(self, batch_sampler, views: int):
        self.batch_sampler, self.views = batch_sampler, views
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.batch_size = batch_sampler.batch_size * views

    def __iter__(self):
        for batch in self.batch_sampler:
            yield [i * self.views + v for v in range(self.views) for i in batch]

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
