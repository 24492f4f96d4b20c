"""Remote CPU workers on Ray (issue 16): what the remote path costs per tiny-batch, what it adds to a
loader on this machine, and what N remote CPUs would add to a GPU node with 4 local cores.

1. overhead: one tiny-batch's compute in this process (CpuPipeline, the policy, `--tiny` samples) vs
   the remote path without compute (an actor returns a tiny-batch-sized uint8 array: pickling, the
   object store, the RPC, ray.get and the copy into a ring-like buffer) -- its latency, the CPU it
   costs the training process and the CPU it costs the actor; and an actor's tiny-batches/s at
   `in_flight` 1, 2, 3 (how deep a queue hides the round trip).
2. loader: img/s of FusionFlowLoader local-only vs local + a Ray actor on this machine (1 local worker
   + 1 actor on a 2-core VM), for both ends of the queue, in_flight 1/2/3 and per_call 1/2; configurations rotate
   every round, medians over rounds; the training process's CPU per image and the Ray gateway
   process's CPU per remote tiny-batch (run first, before this process imports ray: the training
   process of a user never does).
3. model: throughput of a GPU node with 4 local cores and N remote CPUs, from the measured compute
   time and the measured per-tiny-batch costs (each remote tiny-batch costs the GPU node `local CPU`
   of receive time; an actor spends `actor CPU` on top of its compute), capped by an assumed NIC.
   Plot: experiments/results/remote_model.png.

    .venv/bin/python -m experiments.bench_remote          # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from experiments.harness import RESULTS, ROOT, provenance, rotation, write_json
from fusionflow.remote.task import RemoteTask
from fusionflow.tools.synthetic import EncodedImages


class BenchTask(RemoteTask):
    """The real actor plus what the overhead measurement needs."""

    def echo(self, n: int):
        """The remote path without compute: a result of `n` samples' size, as `run` returns it."""
        if getattr(self, "_echo", None) is None or len(self._echo) != n:
            self._echo = np.full((n, *self.pipe.out_shape), 7, self.pipe.out_dtype)
        return self._echo, [0] * n, [], 0.0

    def cpu(self) -> float:
        return time.process_time()  # this actor process, all its threads (Ray's included)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def overhead(ray, ds, policy, tiny: int, calls: int) -> dict:
    from fusionflow.ops.pipeline import CpuPipeline

    pipe = CpuPipeline(policy)
    rng = np.random.default_rng(0)
    groups = [rng.choice(len(ds), tiny, replace=False).tolist() for _ in range(calls)]
    out = np.empty((tiny, *pipe.out_shape), pipe.out_dtype)
    compute = []
    for idx in groups:
        t0 = time.perf_counter()
        for j, i in enumerate(idx):
            pipe(ds[i][0], i, 0, 0, out=out[j])
        compute.append(time.perf_counter() - t0)
    actor = ray.remote(BenchTask).options(num_cpus=1).remote(ray.put(ds), policy, 0, 0)
    ray.get(actor.probe.remote(0))
    ring = np.empty((tiny, *pipe.out_shape), pipe.out_dtype)
    for _ in range(5):  # warm-up
        ray.get(actor.echo.remote(tiny))
    lat, a0, p0 = [], ray.get(actor.cpu.remote()), time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        images, *_ = ray.get(actor.echo.remote(tiny))
        ring[:] = images
        lat.append(time.perf_counter() - t0)
    local_cpu = (time.process_time() - p0) / calls
    actor_cpu = (ray.get(actor.cpu.remote()) - a0) / calls
    pickled = []
    import pickle

    for _ in range(calls):
        t0 = time.perf_counter()
        bufs = []
        pickle.dumps(ring, protocol=5, buffer_callback=bufs.append)
        pickled.append(time.perf_counter() - t0)
    depth = {}
    for d in (1, 2, 3):  # an actor's tiny-batches/s with d calls queued on it (real compute)
        inflight, done, t0, k = [], 0, None, 0
        while done < calls:
            while len(inflight) < d:
                idx = groups[k % calls]
                k += 1
                inflight.append(actor.run.remote(0, tuple(range(tiny)), tuple(idx), ()))
            ready, inflight = ray.wait(inflight, num_returns=1)
            images, *_ = ray.get(ready[0])
            ring[:] = images
            if t0 is None:
                t0 = time.perf_counter()  # from the first result: steady state
            else:
                done += 1
        depth[d] = calls / (time.perf_counter() - t0)
    ray.kill(actor)
    c = median(compute)
    # which end of the queue: compute of a mini-batch's smallest vs largest tiny-batch (size-sorted as
    # the loader sorts them); the remote overhead per tiny-batch is the same at both ends
    from fusionflow.scheduling import split_sorted

    ends = {"front": [], "back": []}
    for _ in range(max(4, calls // 8)):
        tb = split_sorted(rng.choice(len(ds), 32, replace=False).tolist(), ds.sizes, tiny)
        for end, t in (("front", tb[0]), ("back", tb[-1])):
            t0 = time.perf_counter()
            for j, i in enumerate(t.indices):
                pipe(ds[i][0], i, 0, 0, out=out[j])
            ends[end].append(time.perf_counter() - t0)
    return {
        "tiny_batch_size": tiny,
        "output_bytes": int(out.nbytes),
        "compute_s": c,
        "compute_front_s": median(ends["front"]),
        "compute_back_s": median(ends["back"]),
        "round_trip_s": median(lat),
        "round_trip_p90_s": float(np.percentile(lat, 90)),
        "local_cpu_s": local_cpu,
        "actor_cpu_s": actor_cpu,
        "pickle_s": median(pickled),
        "actor_tiny_batches_per_s": {str(k): v for k, v in depth.items()},
        "compute_bound_tiny_batches_per_s": 1.0 / c,
    }


def _cpu_s(pid: int | None) -> float:
    """utime + stime of process `pid` so far (0 when it is gone)."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway_pid(loader) -> int | None:
    """The pid of the loader's newest Ray gateway process (its remote worker kind's latest session), or
    None before its workers started (the first epoch) or without remote workers."""
    manager = loader.parts.runtime.manager
    kinds = manager.board.kinds if manager is not None else []
    return kinds[0].sessions[-1] if kinds and kinds[0].sessions else None


def loader_runs(ds, policy, args) -> dict:
    """Before ray is imported here: the loader's gateway process starts a local Ray instance of
    its own per configuration (1 CPU: one actor), as a user's training process would."""
    import torch

    from fusionflow import FusionFlowLoader, RayWorkers

    configs = {
        "local 1 worker": None,
        "local 1 + remote 1 (back, in_flight 2)": dict(take="back", in_flight=2),
        "local 1 + remote 1 (front, in_flight 2)": dict(take="front", in_flight=2),
        "local 1 + remote 1 (back, in_flight 1)": dict(take="back", in_flight=1),
        "local 1 + remote 1 (back, in_flight 3)": dict(take="back", in_flight=3),
        "local 1 + remote 1 (back, in_flight 2, per_call 1)": dict(take="back", in_flight=2, per_call=1),
        "local 1 + remote 1 (back, in_flight 2, per_call 4)": dict(take="back", in_flight=2, per_call=4),
        "local 2 workers": "local2",
    }
    names = [n for n in configs if not args.configs or any(c in n for c in args.configs.split(";"))]
    rates = {n: [] for n in names}
    waits = {n: [] for n in names}
    remote_share = {n: [] for n in names}
    cpu_per_img = {n: [] for n in names}  # this (the training) process's CPU per image: manager, receiving
    gateway_cpu = {n: [] for n in names}  # the Ray gateway process's CPU per remote tiny-batch
    remote_tb_per_img = {n: [] for n in names}
    for r in range(args.rounds):
        for name in rotation(names, r):
            cfg = configs[name]
            remote = RayWorkers(1, address="auto", **cfg) if isinstance(cfg, dict) else None
            loader = FusionFlowLoader(
                ds,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=2 if cfg == "local2" else 1,
                policy=policy,
                tiny_batch_size=args.tiny,
                seed=0,
                persistent_workers=True,
                generator=torch.Generator().manual_seed(r),
                remote_workers=remote,
            )
            with loader:
                for epoch in range(args.epochs + 1):
                    loader.set_epoch(epoch)
                    loader.stats.reset()
                    gateway = _gateway_pid(loader)  # from epoch 1
                    t0, p0, g0 = time.perf_counter(), time.process_time(), _cpu_s(gateway)
                    n = 0
                    for x, _y in loader:
                        n += len(x)
                    took, cpu = time.perf_counter() - t0, time.process_time() - p0
                    g = _cpu_s(gateway) - g0
                    if epoch:  # the first epoch warms up
                        rates[name].append(n / took)
                        waits[name].append(1e3 * float(np.mean(loader.stats.wait_seconds)))
                        total = sum(loader.stats.tiny_batches_per_worker) + loader.stats.remote_tiny_batches
                        remote_share[name].append(loader.stats.remote_tiny_batches / max(1, total))
                        cpu_per_img[name].append(cpu / n)
                        remote_tb_per_img[name].append(loader.stats.remote_tiny_batches / n)
                        if loader.stats.remote_tiny_batches:
                            gateway_cpu[name].append(g / loader.stats.remote_tiny_batches)
            print(f"round {r} {name}: {median(rates[name][-args.epochs :]):.0f} img/s", flush=True)
    return {
        n: {
            "img_per_s": median(rates[n]),
            "img_per_s_all": rates[n],
            "wait_mean_ms": median(waits[n]),
            "remote_share": median(remote_share[n]),
            "train_process_cpu_us_per_img": 1e6 * median(cpu_per_img[n]),
            "remote_tiny_batches_per_img": median(remote_tb_per_img[n]),
            "gateway_cpu_ms_per_remote_tiny_batch": 1e3 * median(gateway_cpu[n]),
        }
        for n in names
    }


DEFAULT = "local 1 + remote 1 (back, in_flight 1)"  # RayWorkers' defaults


def receive_cost(runs: dict) -> tuple[float, float] | None:
    """What receiving a remote tiny-batch costs the node inside a loader, in two parts: the training
    process's CPU (its CPU per image with one actor at the defaults minus that with local workers
    only, per remote tiny-batch) and the Ray gateway process's CPU per remote tiny-batch."""
    remote, local = runs.get(DEFAULT), runs.get("local 1 worker")
    if not remote or not local or not remote["remote_tiny_batches_per_img"]:
        return None
    extra = (remote["train_process_cpu_us_per_img"] - local["train_process_cpu_us_per_img"]) / 1e6
    return max(0.0, extra / remote["remote_tiny_batches_per_img"]), remote["gateway_cpu_ms_per_remote_tiny_batch"] / 1e3


def model(
    o: dict, local_cores: int = 4, max_remote: int = 64, nic_gbit: float = 10.0, train_process_cores: float = 0.5
) -> dict:
    """img/s of a GPU node's loader with `local_cores` and N remote CPUs (the GPU's own demand not
    capping it): local workers get the cores the training process and the receiving of remote
    results leave; each remote CPU runs tiny-batches at compute / (compute + actor overhead); the
    NIC caps the bytes coming in."""
    c, tiny, h = o["compute_s"], o["tiny_batch_size"], o["local_cpu_s"]
    per_core = tiny / c  # img/s of one core
    remote_eff = c / (c + o["actor_cpu_s"])
    nic_img_s = nic_gbit * 1e9 / 8 / (o["output_bytes"] / tiny)
    cores = local_cores - train_process_cores  # what the loader's local side has
    base = cores * per_core
    rows = []
    for n in range(max_remote + 1):
        # remote tiny-batches/s: what the actors supply, what the NIC carries, what the node's CPUs can
        # receive (each costs h of local CPU, taken from the local workers' share)
        remote_tb = min(n * remote_eff / c, nic_img_s / tiny, cores / h)
        receive_cores = remote_tb * h
        local = (cores - receive_cores) * per_core
        total = local + remote_tb * tiny
        rows.append({"remote_cpus": n, "img_per_s": total, "speedup": total / base, "receive_cores": receive_cores})
    return {
        "local_cores": local_cores,
        "train_process_cores": train_process_cores,
        "nic_gbit": nic_gbit,
        "per_core_img_s": per_core,
        "remote_efficiency": remote_eff,
        "nic_img_s": nic_img_s,
        "rows": rows,
    }


def plot(m: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["remote_cpus"] for r in m["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n, [r["speedup"] for r in m["rows"]], label="model, receive cost of a bare round trip")
    if "in_loader" in m:
        ax.plot(
            n,
            [r["speedup"] for r in m["in_loader"]["rows"]],
            label=f"model, receive cost measured in a loader ({1e3 * m['in_loader']['local_cpu_s']:.1f} ms)",
        )
    ax.plot(
        n,
        [1 + k / (m["local_cores"] - m["train_process_cores"]) for k in n],
        "--",
        color="grey",
        label="ideal (remote CPU = local core)",
    )
    ax.set_xlabel("remote CPUs (Ray actors)")
    ax.set_ylabel(f"loader throughput vs {m['local_cores']} local cores")
    ax.set_title(f"GPU node, {m['local_cores']} cores + N remote CPUs ({m['nic_gbit']:.0f} Gbit/s NIC)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--tiny", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per configuration and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=60, help="tiny-batches per overhead measurement")
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--skip-loader", action="store_true")
    ap.add_argument(
        "--configs",
        default="",
        help="';'-separated substrings: run only the loader configurations "
        "whose name contains one (e.g. 'back, in_flight 2;front')",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "remote_randaugment.json"))
    args = ap.parse_args()

    from fusionflow.policy import load_policy
    from fusionflow.tools.synthetic import make_jpegs

    ds = EncodedImages(make_jpegs(args.images, 200, 1000, seed=1))
    policy = load_policy(args.policy)
    # Ray's worker processes import this checkout's fusionflow
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    # one warm Ray instance of 1 CPU for every configuration, as on a cluster (`ray start`), so that no
    # configuration's timed epochs overlap a fresh instance's start-up; this process does not import ray
    # before its loaders ran, as a user's training process never does
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli, "start", "--head", "--num-cpus=1", "--include-dashboard=false"], check=True)
    try:
        runs = {} if args.skip_loader else loader_runs(ds, policy, args)
        import ray

        ray.init(address="auto", logging_level="WARNING")
        try:
            o = overhead(ray, ds, policy, args.tiny, args.calls)
            print({k: v for k, v in o.items()}, flush=True)
        finally:
            ray.shutdown()
    finally:
        subprocess.run([ray_cli, "stop", "--force"], check=False)
    m = model(o)
    costs = receive_cost(runs)
    if costs is not None:  # the same model with what receiving costs the node inside a loader (the
        h_loader = sum(costs)  # training process's part and the gateway's), not the bare echo
        o_loader = {**o, "local_cpu_s": h_loader}
        m["in_loader"] = {
            "local_cpu_s": h_loader,
            "training_process_cpu_s": costs[0],
            "gateway_cpu_s": costs[1],
            "rows": model(o_loader)["rows"],
        }
    result = {
        **provenance(),
        "overhead": o,
        "loader": runs,
        "model": m,
        "setup": {
            "images": args.images,
            "sides": [200, 1000],
            "batch_size": args.batch_size,
            "policy": args.policy,
            "ray_num_cpus": 1,
        },
    }
    write_json(result, args.out)
    plot(m, os.path.splitext(args.out)[0].replace("remote_randaugment", "remote_model") + ".png")


if __name__ == "__main__":
    main()
