"""One rank of tests/test_ddp.py, run under torchrun: DDP (gloo) training over FusionFlowLoader."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_loader import SMALL, Bytes  # noqa: E402

from fusionflow import FusionFlowLoader  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ds = Bytes(37, sleep=0.03 if rank == 0 else 0.0)  # rank 0 is the straggler: heavier samples
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    with FusionFlowLoader(
        ds,
        batch_size=4,
        sampler=sampler,
        num_workers=1,
        policy=SMALL,
        persistent_workers=True,
        tiny_batch_size=1,
        pin_workers=False,
    ) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen[epoch] = []
            for images, labels in loader:
                loss = model(images.float().mean(dim=(2, 3))).square().mean()  # all-reduce in backward
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen[epoch] += labels.tolist()
            ring = loader._manager.board.ring.name
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "ring": ring, "pid": os.getpid(), "stats": loader.stats.summary()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
