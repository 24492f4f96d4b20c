"""Write an ImageFolder (root/<class>/<image>) as WebDataset tar shards that fusionflow.TarShards reads.

    python examples/make_shards.py /data/train /data/train-shards --per-shard 1000 [--shuffle-seed 0]

Each sample is two members, KEY.<image extension> (the file's bytes, not re-encoded) and KEY.cls
(the class index as text); KEY is the sample's position in the folder order. Samples are shuffled
across shards by default (a seeded permutation), so that a shard is not one class. Prints the brace
pattern to pass to TarShards, and writes classes.txt (one class name per line, in index order).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import tarfile

from fusionflow import ImageFolder


def write_shards(root: str, out: str, per_shard: int = 1000, shuffle_seed: int | None = 0) -> str:
    ds = ImageFolder(root)
    order = list(range(len(ds)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    os.makedirs(out, exist_ok=True)
    count = (len(order) + per_shard - 1) // per_shard
    for s in range(count):
        path = os.path.join(out, f"train-{s:06d}.tar")
        with tarfile.open(path + ".part", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in order[s * per_shard : (s + 1) * per_shard]:
                ext = os.path.splitext(ds.paths[i])[1].lstrip(".").lower() or "jpg"
                for name, data in ((f"{i:09d}.{ext}", ds[i][0]), (f"{i:09d}.cls", str(ds.targets[i]).encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mode = len(data), 0o444
                    tar.addfile(info, io.BytesIO(data))
        os.replace(path + ".part", path)
    with open(os.path.join(out, "classes.txt"), "w") as f:
        f.write("\n".join(ds.classes) + "\n")
    return os.path.join(out, f"train-{{000000..{count - 1:06d}}}.tar")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="ImageFolder root: root/<class>/<image>")
    ap.add_argument("out", help="directory for the shards")
    ap.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    ap.add_argument("--shuffle-seed", type=int, default=0, help="seed of the permutation; -1 keeps folder order")
    args = ap.parse_args()
    if args.per_shard < 1:
        ap.error("--per-shard must be at least 1")
    pattern = write_shards(args.root, args.out, args.per_shard, None if args.shuffle_seed < 0 else args.shuffle_seed)
    print(f"fusionflow.TarShards({pattern!r})")


if __name__ == "__main__":
    main()
