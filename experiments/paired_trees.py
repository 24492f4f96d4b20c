"""Before/after a change: one benchmark run alternately from two source trees, in one session.

A refactor must not cost speed, and this 2-core VM's throughput drifts by 10-20% over minutes, so
the two versions are measured in alternation (A B B A A B ...), each run a fresh process of the
benchmark *in its own tree*, and the result is the median over runs of each version plus the median
of the per-round ratios.

Each run starts in its tree (cwd = the tree), so the tree's own experiments and fusionflow are the
ones imported. How depends on the tree: one whose experiments/ is a package (experiments/__init__.py)
runs `python -m experiments.<bench>`; an older one, whose scripts put their tree on sys.path
themselves, runs `python experiments/<bench>.py`. So "before" may be any old commit.

    # a tree of the old commit beside the current one
    git worktree add /tmp/before <commit>
    .venv/bin/python -m experiments.paired_trees --before /tmp/before --after . --repeats 5 \
        --bench loader -- --modes loader --images 256 --epochs 3
    .venv/bin/python -m experiments.paired_trees --before /tmp/before --after . --bench ddp -- --repeats 1

Metrics: `loader` reads FusionFlowLoader's img/s and its ratio to DataLoader + torchvision (that
ratio cancels most of the machine's drift); `cpu` reads the per-core pipeline's fast and exact modes
against torchvision (bench_cpu_pipeline); `ddp` reads the lending-on img/s and the on/off ratio;
`cooperation` reads bench_cooperation's first batch size: the gain (X - Y)/Z, its per-round median, X's
img/s and X/(Y+Z) (give both trees the same bench_cooperation to compare the loaders alone); `feeder`
reads bench_feeder's first batch size: the accelerator thread's and its helpers' CPU per sample, the runs'
size (the same bench_feeder in both trees); `remote` reads bench_remote.py's 1 local + 1 actor and 2 local
img/s, the training process's CPU per image with and without the actor, and the bare Ray round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from experiments.harness import git_commit, provenance, result_path, rotation, write_json

# --bench: (the experiment's module name, {metric: its path in the experiment's JSON})
BENCHES = {
    "loader": (
        "bench_loader",
        {
            "fusionflow_img_per_s": ("results", "loader", "fusionflow", "img_per_s_median"),
            "fusionflow_over_dataloader_tv": ("results", "loader", "fusionflow", "ratio_vs_dataloader_tv"),
        },
    ),
    "cpu": (
        "bench_cpu_pipeline",
        {
            "ff_fast_img_per_s": ("img_per_s_median", "ff_fast"),
            "ff_fast_over_torchvision": ("ratio_vs_torchvision", "ff_fast"),
            "ff_exact_over_torchvision": ("ratio_vs_torchvision", "ff_exact"),
        },
    ),
    "ddp": (
        "bench_ddp",
        {
            "lending_on_img_per_s": ("median", "on", "img_per_s"),
            "lending_off_img_per_s": ("median", "off", "img_per_s"),
            "on_over_off": ("ratio", "throughput_on_over_off"),
        },
    ),
    "cooperation": (
        "bench_cooperation",
        {
            "gain": ("rows", 0, "gain"),
            "gain_per_round": ("rows", 0, "gain_paired"),
            "x_img_per_s": ("rows", 0, "median", "ff_dali"),
            "x_over_y_plus_z": ("rows", 0, "x_over_y_plus_z"),
        },
    ),
    "feeder": (
        "bench_feeder",
        {
            "feed_us_per_sample": ("rows", 0, "feed_us_per_sample"),
            "helper_us_per_sample": ("rows", 0, "inputs_us_per_sample"),
            "samples_per_run": ("rows", 0, "samples_per_run"),
        },
    ),
    "remote": (
        "bench_remote",
        {
            "one_local_one_actor_img_per_s": ("loader", "local 1 + remote 1 (back, in_flight 2)", "img_per_s"),
            "two_local_img_per_s": ("loader", "local 2 workers", "img_per_s"),
            "training_cpu_us_per_img_with_actor": (
                "loader",
                "local 1 + remote 1 (back, in_flight 2)",
                "train_process_cpu_us_per_img",
            ),
            "training_cpu_us_per_img_local_only": ("loader", "local 1 worker", "train_process_cpu_us_per_img"),
            "round_trip_s": ("overhead", "round_trip_s"),
        },
    ),
}


def dig(d, path):
    for k in path:
        d = d[k]
    return float(d)


def is_package_tree(tree: str) -> bool:
    """Whether the tree's experiments run as modules (`python -m experiments.x`): its experiments/ is a
    package. Older trees' scripts run as files and put their tree on sys.path themselves."""
    return os.path.isfile(os.path.join(tree, "experiments", "__init__.py"))


def bench_command(tree: str, bench: str) -> list[str]:
    """The command that runs experiment `bench` (a module name, e.g. "bench_loader") of `tree`, in the
    tree's own way; it runs with cwd = the tree."""
    if is_package_tree(tree):
        return [sys.executable, "-m", f"experiments.{bench}"]
    return [sys.executable, os.path.join(tree, "experiments", f"{bench}.py")]


def run_once(tree: str, bench: str, extra: list[str], metrics: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run(
            [*bench_command(tree, bench), *extra, "--out", out], cwd=tree, check=True, stdout=subprocess.DEVNULL
        )
        with open(out) as f:
            d = json.load(f)
    return {name: dig(d, path) for name, path in metrics.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--bench", choices=sorted(BENCHES), default="loader")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default=None, help="names the result file (experiments/results/paired_<label>.json)")
    ap.add_argument("--out", default=None, help="the result file (default: named by --label)")
    ap.add_argument("extra", nargs="*", help="arguments for the benchmark script (after --)")
    args = ap.parse_args()
    bench, metrics = BENCHES[args.bench]
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict = {"before": [], "after": []}
    for r in range(args.repeats):
        for name in rotation(("before", "after"), r):
            res = run_once(trees[name], bench, args.extra, metrics)
            runs[name].append(res)
            print(f"round {r} {name:6s} " + " ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)
    summary = {}
    for k in metrics:
        b = [x[k] for x in runs["before"]]
        a = [x[k] for x in runs["after"]]
        summary[k] = {
            "before_median": statistics.median(b),
            "after_median": statistics.median(a),
            "after_over_before": statistics.median(a) / statistics.median(b),
            "paired_ratio_median": statistics.median(x / y for x, y in zip(a, b)),
        }
        print(
            f"{k}: before {summary[k]['before_median']:.3f}  after {summary[k]['after_median']:.3f}  "
            f"after/before {summary[k]['after_over_before']:.3f} (paired median "
            f"{summary[k]['paired_ratio_median']:.3f})"
        )
    label = args.label or args.bench
    write_json(
        {
            "benchmark": f"paired {args.bench}",
            **provenance(),
            "commits": {k: git_commit(t) for k, t in trees.items()},
            "invocations": {k: " ".join(bench_command(t, bench)[1:]) for k, t in trees.items()},
            "bench_args": args.extra,
            "runs": runs,
            "summary": summary,
        },
        result_path(args.out, f"paired_{label}.json"),
    )


if __name__ == "__main__":
    main()
