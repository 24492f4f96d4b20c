"""Which core each of a loader's workers is pinned to, agreed between the loaders on this node.

Several training jobs on one node (a sweep's trials, torchrun's local ranks, anything launched side
by side) each start a loader; pinning each loader's workers to "the first cores" would stack them
on the same cores while others idle (three 1-worker jobs on 2 cores: 537 vs 940 img/s unpinned).
So loaders claim cores in a file of the user's node directory (runtime/userdir.py), `cores.json`,
read and rewritten under an exclusive `flock`: a claim is the workers' cores and, for
`pin_workers="auto"`, one more left to the loader's training process (a pinned worker cannot move off
a core its trainer holds while another idles: 690 vs 762 img/s pinned on 2 cores, 2 workers) -- and with
a DALI accelerator, one more per DALI thread (they run in the training process: issue 41's cores reserved
for DALI, so that another loader's pinned workers do not land on them). Claims
of processes that are gone (pid and start time both checked, so a reused pid frees them too) are
dropped by whoever claims next; a loader drops its own at stop.

`"auto"` pins only when the free cores hold the whole claim (and, under torchrun, when every local
rank's claim fits the process's cores), else the workers run unpinned and the scheduler places
them; `True` pins regardless, free cores first, then every core of the process's affinity in turn.
A claims file that cannot be used (unwritable directory) leaves `"auto"` unpinned, with one log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid

from fusionflow.runtime.userdir import directory, env_number, flock_within

log = logging.getLogger("fusionflow")
LOCK_S = 10.0  # the longest a loader waits for the claims file's lock

FILE = "cores.json"


def local_ranks() -> int:
    """The training processes of this node (torchrun's LOCAL_WORLD_SIZE; 1 outside it)."""
    return max(1, env_number("LOCAL_WORLD_SIZE", 1, int, " (torchrun sets it: the training processes on this node)"))


def rank_cores(cores: int) -> int:
    """This rank's part of the node's `cores` (at least 1): what one rank may count on for its own threads."""
    return max(1, cores // local_ranks())


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _live(claim) -> bool:
    """A well-formed claim of a process that still runs (anything else in the file is dropped)."""
    try:
        return _start_time(int(claim["pid"])) == claim["start"] and all(isinstance(c, int) for c in claim["cores"])
    except (TypeError, KeyError, ValueError):
        return False


@contextlib.contextmanager
def _claims():
    """The live claims {key: {"pid", "start", "cores"}}, locked; what the caller leaves in the dict
    is written back."""
    path = os.path.join(directory(), FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as f:
        flock_within(f.fileno(), LOCK_S, path)  # a stopped loader holding it: workers unpinned, logged
        try:
            claims = json.loads(f.read() or "{}")
        except ValueError:
            claims = {}
        claims = {k: v for k, v in claims.items() if _live(v)} if isinstance(claims, dict) else {}
        yield claims
        f.seek(0)
        f.truncate()
        json.dump(claims, f)


class CoreClaim:
    """This pool's cores: `cores[wid]` is worker wid's core, or None (unpinned)."""

    def __init__(self, num_workers: int, mode: bool | str, trainer_cores: int = 1):
        self.cores: list[int | None] = [None] * num_workers
        self._key: str | None = None
        if not mode or num_workers < 1:
            return
        cpus = sorted(os.sched_getaffinity(0))
        ranks = local_ranks()
        trainer_cores = max(1, trainer_cores)
        if mode == "auto" and (num_workers + trainer_cores) * ranks > len(cpus):
            return  # not even the whole node would give every rank's workers and trainer (and DALI) a core
        try:
            self._claim(cpus, num_workers, mode, trainer_cores)
        except OSError as e:
            if mode == "auto":
                log.warning("fusionflow: workers left unpinned: the core claims file is unusable (%s)", e)
                return
            self.cores = [cpus[i % len(cpus)] for i in range(num_workers)]

    def _claim(self, cpus: list[int], num_workers: int, mode: bool | str, trainer_cores: int) -> None:
        with _claims() as claims:
            taken = {c for v in claims.values() for c in v["cores"]}
            free = [c for c in cpus if c not in taken]
            if len(free) >= num_workers + (trainer_cores if mode == "auto" else 1):
                mine = free[: num_workers + trainer_cores]  # the last ones left to the training process (and DALI)
                self.cores = list(mine[:num_workers])
            elif mode == "auto":
                return
            else:
                order = free + [c for c in cpus if c in taken]
                self.cores = [order[i % len(order)] for i in range(num_workers)]
                mine = sorted(set(self.cores))
            self._key = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            claims[self._key] = {"pid": os.getpid(), "start": _start_time(os.getpid()), "cores": mine}

    def core_of(self, wid: int) -> int | None:
        """Worker `wid`'s core; None when unpinned or beyond the claim (a worker an elastic target added)."""
        return self.cores[wid] if wid < len(self.cores) else None

    def release(self) -> None:
        """Drop this claim (idempotent; a claim of a process that is gone drops itself)."""
        key, self._key = self._key, None
        if key is None:
            return
        with contextlib.suppress(OSError), _claims() as claims:
            claims.pop(key, None)
