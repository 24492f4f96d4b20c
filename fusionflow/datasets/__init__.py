"""Datasets that return raw encoded samples (no decoding) and know each sample's byte size.

  folder.py    ImageFolder: a folder per class
  wrappers.py  what the loader wraps a dataset in: DictSamples (sample_keys), ReadAhead (read_ahead)
  shards.py    TarShards: WebDataset tar shards by index

Nothing here imports the loader, the runtime or torch.
"""
