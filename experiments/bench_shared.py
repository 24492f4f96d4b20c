"""One loader for many jobs: co-located training jobs, each with its own FusionFlowLoader, vs one
SharedLoader (`python -m fusionflow serve`) feeding them all.

A job is its own process training the demo's small CNN (fusionflow/tools/demo.py, 1 torch thread)
on the same ImageFolder (mixed-size JPEGs, 200-1000 px), policy, batch size and seed, for
`--epochs` epochs. Configurations, rotated every round so drifts in the machine's load hit all:

  own x J     J jobs at once, each with its own loader of max(1, cores // J) workers
  shared x J  one producer with `cores` workers, J jobs attached as SharedLoaderClients
  own x 1     one job, its own loader with `cores` workers
  shared x 1  one job through a client, the producer with `cores` workers

Models: "cnn" trains the small CNN on the CPU (1.6 ms of CPU per image alone here, ~2.2 with both
cores busy, a cost a GPU node does not pay on its CPUs); "none" stands for the GPU node: the job takes
each batch into its own memory and trains nothing on the CPU. Independent jobs pin their workers as
`--pin-workers` says (default "auto", the product's default: loaders on one node claim disjoint
cores, runtime/cores.py; before that, three 1-worker jobs on 2 cores each pinned their worker to the
first core, 537 vs 940 img/s).
`--only own` runs the own-loader configurations alone (to compare pinning across trees).

Per configuration: aggregate img/s (every job's images over the window in which all jobs are past their
first batch and none has finished: start-up excluded) and busy CPU-seconds per image over that window
(/proc/stat: every process on the machine).
Reported: medians over rounds, shared / own (required >= 2x for J = 3, goal 2.7x) and the client's
overhead for one job (1 - shared x 1 / own x 1; goal < 5%).

    .venv/bin/python -m experiments.bench_shared       # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from experiments.harness import (
    RESULTS,
    ROOT,
    cpu_ticks,
    data_path,
    image_folder,
    module_command,
    provenance,
    rotation,
    write_json,
)

DATA = data_path("shared")


def job(a) -> int:
    """One training job: the small CNN on its own loader or on a client; writes its numbers."""
    import torch

    from fusionflow.tools.demo import small_cnn, train_step

    torch.set_num_threads(1)
    if a.mode == "own":
        from fusionflow import FusionFlowLoader, ImageFolder

        loader = FusionFlowLoader(
            ImageFolder(a.data),
            batch_size=a.batch_size,
            shuffle=True,
            num_workers=a.workers,
            policy=a.policy,
            seed=0,
            drop_last=True,
            persistent_workers=True,
            pin_workers={"auto": "auto", "false": False, "true": True}[a.pin_workers],
        )
    else:
        from fusionflow import SharedLoaderClient

        loader = SharedLoaderClient(a.name, timeout=120)
    torch.manual_seed(0)
    model = small_cnn(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    stamps = []  # (wall-clock time, images) after each batch
    for _ in range(a.epochs):
        for x, y in loader:
            if a.model == "cnn":
                train_step(model, opt, loss_fn, x, y)
            # model "none": a GPU trains; the CPU's part is the batch in this process's memory
            stamps.append((time.time(), len(y)))
    loader.close()
    with open(a.out, "w") as f:
        json.dump(stamps, f)
    return 0


def _busy_cpu_seconds() -> float:
    """CPU time this machine has spent busy, all cores (harness.cpu_ticks)."""
    idle, total = cpu_ticks()
    return (total - idle) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Busy CPU seconds sampled every 50 ms, to read them at any instant of a run afterwards."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.time(), _busy_cpu_seconds()))
            self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        return min(self.samples, key=lambda s: abs(s[0] - t))[1]


def steady(stamps: list, cpu: CpuSampler) -> dict:
    """Over the window where every job is past its first batch and none has finished: images/s of
    all jobs together and busy CPU-seconds per image."""
    t0 = max(s[0][0] for s in stamps)
    t1 = min(s[-1][0] for s in stamps)
    images = sum(n for s in stamps for t, n in s if t0 < t <= t1)
    return {"img_per_s": images / (t1 - t0), "cpu_s_per_image": (cpu.at(t1) - cpu.at(t0)) / images}


def _spawn(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_config(shared: bool, jobs: int, model: str, a, tmp: str) -> dict:
    cores = len(os.sched_getaffinity(0))
    name = f"bench-{uuid.uuid4().hex[:8]}"
    cpu = CpuSampler()
    log = open(os.path.join(tmp, "log.txt"), "a")
    procs = []
    common = ["--data", a.data, "--batch-size", str(a.batch_size), "--policy", a.policy]
    if shared:
        serve = [sys.executable, "-m", "fusionflow", "serve", "--name", name, "--epochs", str(a.epochs)]
        serve += ["--workers", str(cores), "--min-clients", str(jobs), "--drop-last", "--seed", "0", *common]
        procs.append(_spawn(serve, log))
    outs = [os.path.join(tmp, f"{name}-{i}.json") for i in range(jobs)]
    per_job_workers = cores if jobs == 1 else max(1, cores // jobs)
    for out in outs:
        mode = ["--mode", "client", "--name", name] if shared else ["--mode", "own", "--workers", str(per_job_workers)]
        cmd = [*module_command("bench_shared"), "job", *mode, "--model", model, "--epochs", str(a.epochs)]
        cmd += ["--out", out, *common, "--pin-workers", a.pin_workers]
        procs.append(_spawn(cmd, log))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"a process of the configuration failed: see {log.name}")
    cpu.stop()
    return steady([json.load(open(out)) for out in outs], cpu)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="bench", choices=["bench", "job"])
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images-per-class", type=int, default=96, help="4 classes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--json", default=os.path.join(RESULTS, "shared_loader.json"))
    ap.add_argument("--models", default="cnn,none", help="cnn: the small CNN trains on the CPU; none: a GPU would")
    ap.add_argument("--pin-workers", choices=["auto", "false", "true"], default="auto", help="own loaders' pinning")
    ap.add_argument("--only", choices=["own", "shared"], help="run only these configurations")
    ap.add_argument("--mode", choices=["own", "client"])  # job only
    ap.add_argument("--model", choices=["cnn", "none"])
    ap.add_argument("--name")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.role == "job":
        return job(a)
    image_folder(4 * a.images_per_class, root=a.data)
    configs = {}
    for model in a.models.split(","):
        configs |= {
            f"{model}: own x {a.jobs}": (False, a.jobs, model),
            f"{model}: shared x {a.jobs}": (True, a.jobs, model),
            f"{model}: own x 1": (False, 1, model),
            f"{model}: shared x 1": (True, 1, model),
        }
    configs = {k: v for k, v in configs.items() if a.only is None or k.split(": ")[1].startswith(a.only)}
    runs = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for key in rotation(configs, r):
                runs[key].append(run_config(*configs[key], a, tmp))
                print(f"round {r + 1}/{a.rounds} {key}: {runs[key][-1]['img_per_s']:.0f} img/s, "
                      f"{1e3 * runs[key][-1]['cpu_s_per_image']:.1f} CPU-ms/image", flush=True)  # fmt: skip
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("img_per_s", "cpu_s_per_image")} for k, v in runs.items()
    }
    result = {
        **provenance(),
        "jobs": a.jobs,
        "epochs": a.epochs,
        "images": 4 * a.images_per_class,
        "batch_size": a.batch_size,
        "policy": a.policy,
        "pin_workers": a.pin_workers,
        "cores": len(os.sched_getaffinity(0)),
        "rounds": runs,
        "medians": med,
    }
    for k, v in med.items():
        print(f"{k:>18}: {v['img_per_s']:7.1f} img/s  {1e3 * v['cpu_s_per_image']:6.2f} CPU-ms/image")
    for model in a.models.split(",") if a.only is None else []:
        own, shared = med[f"{model}: own x {a.jobs}"], med[f"{model}: shared x {a.jobs}"]
        one = 1 - med[f"{model}: shared x 1"]["img_per_s"] / med[f"{model}: own x 1"]["img_per_s"]
        result[model] = {
            "aggregate_ratio": shared["img_per_s"] / own["img_per_s"],
            "cpu_per_image_ratio": shared["cpu_s_per_image"] / own["cpu_s_per_image"],
            "client_overhead": one,
        }
        print(
            f"{model}: shared / own with {a.jobs} jobs: {result[model]['aggregate_ratio']:.2f}x aggregate img/s, "
            f"{result[model]['cpu_per_image_ratio']:.2f}x CPU per image; one job through a client: "
            f"{100 * one:+.1f}% overhead"
        )
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
