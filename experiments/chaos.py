"""Chaos soak: a training loop of many epochs with a fault injected at a random moment of each.

    .venv/bin/python -m experiments.chaos --epochs 30 --images 128
    .venv/bin/python -m experiments.chaos --epochs 12 --ray --faults gateway-kill,gateway-stop,actor-kill
    .venv/bin/python -m experiments.chaos --epochs 20 --images 128 --cache 1GB

Each epoch draws `--per-epoch` faults from `--faults`, each with a random mini-batch after whose
receipt the training loop injects it:
  worker-kill   SIGKILL one of the loader's own CPU worker processes
  worker-stop   SIGSTOP one (never resumed: the loader must notice it by itself)
  gateway-kill  SIGKILL the Ray gateway process (with --ray)
  gateway-stop  SIGSTOP it (with --ray; the call deadline, `--call-timeout`, must end it)
  actor-kill    SIGKILL one Ray actor process of the gateway's session (with --ray)
  actor-stop    SIGSTOP it (with --ray; the gateway ends a call hung that long, and that actor)
  raylet-kill   SIGKILL the raylet of the gateway's local Ray instance (with --ray; the gateway's
                pulse sees it gone and exits)
  agent-kill    SIGKILL that node's dashboard agent (with --ray; the raylet fate-shares with it)
  none          nothing (a control epoch)
Per epoch it checks that every sample arrived exactly once (the label is the index) and records the
longest wait at next() -- the stall the fault cost -- beside the epoch's median wait. At the end, after
close(): no process this run started is left, and no /dev/shm segment. The loader's own counters say
what handled each fault (reruns, stuck kills, restarts, gateways lost).

Lent workers and the global manager, the shared loader's producer and clients: experiments/chaos_jobs.py.
tests/test_chaos.py runs a short form of both.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import time

from experiments import harness
from fusionflow.runtime.procs import command_line, live_processes, pid_alive
from fusionflow.tools.baseline import timed_batches

FAULTS = (
    "worker-kill",
    "worker-stop",
    "gateway-kill",
    "gateway-stop",
    "actor-kill",
    "actor-stop",
    "raylet-kill",
    "agent-kill",
    "none",
)
LOCAL_FAULTS = ("worker-kill", "worker-stop", "none")
MIN_AGE_S = 1.0  # workers younger than this are spared: see `victims`


class Indexed:
    """(encoded JPEG, index): a batch's labels say which samples it holds."""

    def __init__(self, jpegs):
        self.data, self.sizes = jpegs, [len(b) for b in jpegs]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def _cmdline(pid: int) -> str:
    return " ".join(command_line(pid))


def descendants(root: int | None = None) -> set[int]:
    """Live processes below `root` (this process by default), zombies excluded."""
    children: dict[int, list[int]] = {}
    for pid, fields in live_processes():
        children.setdefault(int(fields[1]), []).append(pid)
    out, todo = set(), [root or os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(("ff_", "ffl_", "sem.ff"))}


def _age(pid: int) -> float:
    """Seconds since process `pid` started (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, IndexError, ValueError):
        return 0.0


def victims(fault: str, min_age: float = MIN_AGE_S) -> list[int]:
    """The processes `fault` may hit now. CPU workers younger than MIN_AGE_S are spared: a worker
    killed `max_retries` + 1 times in a row while it starts fails the loader with WorkerStartError by
    design (a worker that cannot start must not restart forever), and random hits at two per epoch
    would provoke exactly that; tests/test_loader.py covers kills and stops during start-up."""
    if fault.startswith("worker"):
        return [
            p.pid
            for p in mp.active_children()
            if p.name.startswith("fusionflow-worker-") and p.is_alive() and _age(p.pid) >= min_age
        ]
    gateways = [p for p in descendants() if "fusionflow.remote.gateway" in _cmdline(p)]
    if fault.startswith("gateway"):
        return gateways
    below = [p for g in gateways for p in descendants(g)]
    if fault == "raylet-kill":
        return [p for p in below if os.path.basename(_cmdline(p).split(" ", 1)[0]) == "raylet"]
    if fault == "agent-kill":
        return [p for p in below if "ray::DashboardAgent" in _cmdline(p)]
    return [p for p in below if _cmdline(p).startswith("ray::RemoteTask")]  # actor-kill, actor-stop


RAY_READY_S = 180.0  # a Ray fault first waits (a training step) this long for a gateway with a ready actor


def ray_ready(loader) -> float:
    """Wait, up to RAY_READY_S, until the loader's Ray workers have a gateway and a ready actor (the
    last fault's replacement is up), so that each fault hits a working path; seconds waited."""
    kinds = [k for k in loader.parts.runtime.manager.board.kinds if hasattr(k, "live")]
    t0 = time.monotonic()
    while kinds and not kinds[0].live and kinds[0].retired is None and time.monotonic() - t0 < RAY_READY_S:
        time.sleep(0.05)
    return time.monotonic() - t0


def inject(fault: str, rng: random.Random, min_age: float = MIN_AGE_S, loader=None) -> dict:
    """Hit one process as `fault` says; what was hit (or why nothing was). With `loader`, a Ray fault
    first waits for its Ray workers to be up again (`ray_ready`)."""
    if fault == "none":
        return {"fault": fault}
    if loader is not None and not fault.startswith("worker"):
        ray_ready(loader)
    return hit(fault, victims(fault, min_age), rng)


def hit(fault: str, pids, rng: random.Random) -> dict:
    """One of `pids`, drawn: SIGSTOP for a "-stop" fault, SIGKILL otherwise; what was hit, or why nothing."""
    if fault == "none":
        return {"fault": fault}
    if not pids:
        return {"fault": fault, "victim": None, "why": "no such process at that moment"}
    pid = rng.choice(sorted(pids))
    sig = signal.SIGSTOP if fault.endswith("stop") else signal.SIGKILL
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return {"fault": fault, "victim": None, "why": "it exited first"}
    return {"fault": fault, "victim": pid, "signal": sig.name}


def soak(
    epochs: int,
    images: int,
    faults: tuple[str, ...],
    seed: int = 0,
    workers: int = 2,
    batch_size: int = 16,
    step_s: float = 0.005,
    remote_workers=None,
    policy: str = "randaugment",
    jpegs=None,
    progress=print,
    per_epoch: int = 1,
    min_age: float = MIN_AGE_S,
    cache=None,
) -> dict:
    """Run the soak; a dict of per-epoch results, the loader's counters and what was left behind.
    `cache`: the loader's `cache=` (a decoded-image cache: faults then also hit workers filling it;
    its keeper, not a descendant, must be gone at the end too)."""
    from fusionflow import FusionFlowLoader

    rng = random.Random(seed)
    dataset = Indexed(jpegs if jpegs is not None else harness.mixed_jpegs(images))
    before_procs, before_shm = descendants(), shm_segments()
    loader = FusionFlowLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        policy=policy,
        seed=seed,
        persistent_workers=True,
        remote_workers=remote_workers,
        cache=cache,
    )
    results, keeper = [], None
    with loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            plan = sorted((rng.randrange(max(1, len(loader) - 1)), rng.choice(faults)) for _ in range(per_epoch))
            labels, waits, hits = [], [], []
            start = time.monotonic()
            for _x, y, waited in timed_batches(loader):
                attached = loader.parts.runtime.cache_attachment
                keeper = keeper or (attached.keeper_pid if attached is not None else None)
                waits.append(waited)
                labels += y.tolist()
                hits += [
                    {**inject(fault, rng, min_age, loader), "at_batch": at}
                    for at, fault in plan
                    if at == len(waits) - 1
                ]
                time.sleep(step_s)
            exact = sorted(labels) == list(range(len(dataset)))
            results.append(
                {
                    "epoch": epoch,
                    "faults": hits,
                    "exactly_once": exact,
                    "seconds": time.monotonic() - start,
                    "longest_wait_s": max(waits),
                    "median_wait_s": statistics.median(waits),
                }
            )
            r = results[-1]
            what = ", ".join(f"{h['fault']}@{h['at_batch']}" + ("" if h.get("victim") else " (missed)") for h in hits)
            progress(
                f"epoch {epoch:3d}  exactly once: {exact}  longest wait {r['longest_wait_s']:.2f} s "
                f"(median {r['median_wait_s'] * 1e3:.0f} ms)  {what}"
            )
        stats = loader.stats.summary()
    deadline = time.monotonic() + 20  # what close() ended may take a moment to be reaped
    while time.monotonic() < deadline and (descendants() - before_procs or shm_segments() - before_shm):
        time.sleep(0.2)
    left = descendants() - before_procs
    if keeper is not None and pid_alive(keeper):
        left.add(keeper)
    return {
        "epochs": results,
        "counters": {
            k: stats.get(k)
            for k in ("worker_restarts", "workers_stuck", "tiny_batches_rerun", "reruns_won", "remote_gateways_lost")
        },
        "processes_left": sorted(_cmdline(p)[:100] for p in left),
        "cache": stats.get("cache", {}),
        "shm_left": sorted(shm_segments() - before_shm),
    }


def summarize(out: dict) -> dict:
    """The soak's table: per fault kind, faults injected (a process hit), the longest stall of an epoch
    holding one, and whether every such epoch delivered each sample exactly once."""
    epochs, table = out["epochs"], {}
    for e in epochs:
        for h in e["faults"]:
            row = table.setdefault(
                h["fault"], {"injected": 0, "missed": 0, "longest_stall_s": 0.0, "exactly_once": True}
            )
            row["injected" if h.get("victim") or h["fault"] == "none" else "missed"] += 1
            row["longest_stall_s"] = max(row["longest_stall_s"], e["longest_wait_s"])
            row["exactly_once"] &= e["exactly_once"]
    return {
        "epochs": len(epochs),
        "faults_injected": sum(r["injected"] for f, r in table.items() if f != "none"),
        "all_exactly_once": all(e["exactly_once"] for e in epochs),
        "longest_stall_s": max(e["longest_wait_s"] for e in epochs),
        "by_fault": table,
        "clean": not out["processes_left"] and not out["shm_left"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-epoch", type=int, default=1, help="faults injected per epoch")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the training step: a sleep after each batch")
    ap.add_argument("--faults", default=None, help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--ray", action="store_true", help="one Ray actor beside the local workers (a local instance)")
    ap.add_argument("--call-timeout", type=float, default=None, help="RayWorkers(call_timeout=...)")
    ap.add_argument("--cache", default=None, help="the loader's cache= (a byte budget, e.g. 1GB)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    faults = tuple(args.faults.split(",")) if args.faults else (FAULTS if args.ray else LOCAL_FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or (not args.ray and set(faults) - set(LOCAL_FAULTS)):
        ap.error(f"--faults: {unknown or sorted(set(faults) - set(LOCAL_FAULTS))} (Ray faults need --ray)")
    remote = None
    if args.ray:
        from fusionflow import RayWorkers
        from fusionflow.remote import kind

        # Faults on every epoch kill gateways "in a row" on purpose (often before they delivered): the
        # soak keeps the remote workers from retiring (MAX_GATEWAY_FAILURES) or backing off for minutes
        # (BACKOFF_S doubles per failure: zero here), so that each fault hits a working Ray path.
        kind.MAX_GATEWAY_FAILURES, kind.BACKOFF_S = 1 << 30, 0.0

        remote = RayWorkers(1, call_timeout=args.call_timeout, init_kwargs={"num_cpus": 1})
    out = soak(
        args.epochs,
        args.images,
        faults,
        args.seed,
        args.workers,
        args.batch_size,
        step_s=args.step_ms / 1e3,
        remote_workers=remote,
        per_epoch=args.per_epoch,
        cache=args.cache,
    )
    summary = summarize(out)
    print(summary, out["counters"], "left:", out["processes_left"], out["shm_left"])
    path = harness.result_path(args.out, "chaos_ray.json" if args.ray else "chaos.json")
    harness.write_json({**harness.provenance(), "summary": summary, **out}, path)


if __name__ == "__main__":
    main()
