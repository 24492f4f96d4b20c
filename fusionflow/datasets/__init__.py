"""Datasets that return raw encoded samples (no decoding) and know each sample's byte size.

  folder.py  ImageFolder, DictSamples (dict samples through sample_keys), ReadAhead
  shards.py  TarShards: WebDataset tar shards by index

Nothing here imports the loader, the runtime or torch.
"""
