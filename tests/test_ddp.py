"""FusionFlowLoader under torchrun + DDP (gloo, CPU): every sample of every shard exactly once, while
the global manager lends the fast rank's idle worker to the slow one; nothing left behind."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_loader import Bytes, ff_segments
from torch.utils.data import DistributedSampler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_two_epochs_exactly_once(tmp_path):
    before = ff_segments()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        os.path.join(os.path.dirname(__file__), "ddp_rank.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = Bytes(37)
    rings, stats = [], []
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        rings.append(out["ring"])
        stats.append(out["stats"])
        for epoch in range(2):
            ref = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
            ref.set_epoch(epoch)
            assert out["seen"][str(epoch)] == list(ref), (rank, epoch)
    union = [i for r in range(2) for i in json.loads((tmp_path / f"rank{r}.json").read_text())["seen"]["0"]]
    assert set(union) == set(range(37)) and len(union) == 38  # one index padded, as DistributedSampler does
    assert rings[0] != rings[1]  # each rank owns its own segment
    slow, fast = stats
    assert slow["global_manager"] == fast["global_manager"] == "active"
    assert fast["workers_lent"] > 0 and slow["workers_borrowed"] > 0  # the fast rank's worker helped
    # (a lender counts a loan's tiny-batches when its worker is home: the last loan may not be yet)
    assert 0 < fast["lent_tiny_batches"] <= slow["borrowed_tiny_batches"]
    deadline = time.time() + 5  # the GM exits shortly after the last loader and unlinks its table
    while (ff_segments() != before or gm_processes()) and time.time() < deadline:
        time.sleep(0.05)
    assert ff_segments() == before
    assert not gm_processes()


def gm_processes() -> list[int]:
    """Global-manager processes of this user still running (any job)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"fusionflow.runtime.gm.manager" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids
