"""Before/after a change: one benchmark run alternately from two source trees, in one session.

A refactor must not cost speed, and this 2-core VM's throughput drifts by 10-20% over minutes, so
the two versions are measured in alternation (A B B A A B ...), each run a fresh process of the
benchmark script *in its own tree* (the scripts put their tree first on sys.path), and the result is
the median over runs of each version plus the median of the per-round ratios.

    # a tree of the old commit beside the current one
    git worktree add /tmp/before <commit>
    .venv/bin/python experiments/paired_trees.py --before /tmp/before --after . --repeats 5 \
        --bench loader -- --modes loader --images 256 --epochs 3
    .venv/bin/python experiments/paired_trees.py --before /tmp/before --after . --bench ddp -- --repeats 1

Metrics: `loader` reads FusionFlowLoader's img/s and its ratio to DataLoader + torchvision (that
ratio cancels most of the machine's drift); `cpu` reads the per-core pipeline's fast and exact modes
against torchvision (bench_cpu_pipeline.py); `ddp` reads the lending-on img/s and the on/off ratio;
`remote` reads bench_remote.py's 1 local + 1 actor and 2 local img/s, the training process's CPU per
image with and without the actor, and the bare Ray round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, provenance, write_json  # noqa: E402

BENCHES = {
    "loader": (
        "experiments/bench_loader.py",
        {
            "fusionflow_img_per_s": ("results", "loader", "fusionflow", "img_per_s_median"),
            "fusionflow_over_dataloader_tv": ("results", "loader", "fusionflow", "ratio_vs_dataloader_tv"),
        },
    ),
    "cpu": (
        "experiments/bench_cpu_pipeline.py",
        {
            "ff_fast_img_per_s": ("img_per_s_median", "ff_fast"),
            "ff_fast_over_torchvision": ("ratio_vs_torchvision", "ff_fast"),
            "ff_exact_over_torchvision": ("ratio_vs_torchvision", "ff_exact"),
        },
    ),
    "ddp": (
        "experiments/bench_ddp.py",
        {
            "lending_on_img_per_s": ("median", "on", "img_per_s"),
            "lending_off_img_per_s": ("median", "off", "img_per_s"),
            "on_over_off": ("ratio", "throughput_on_over_off"),
        },
    ),
    "remote": (
        "experiments/bench_remote.py",
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


def run_once(tree: str, script: str, extra: list[str], metrics: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run(
            [sys.executable, os.path.join(tree, script), *extra, "--out", out],
            cwd=tree,
            check=True,
            stdout=subprocess.DEVNULL,
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
    ap.add_argument("--label", default=None, help="names the result file")
    ap.add_argument("extra", nargs="*", help="arguments for the benchmark script (after --)")
    args = ap.parse_args()
    script, metrics = BENCHES[args.bench]
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict = {"before": [], "after": []}
    for r in range(args.repeats):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for name in order:
            res = run_once(trees[name], script, args.extra, metrics)
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
    git = lambda t: subprocess.run(
        ["git", "-C", t, "rev-parse", "--short", "HEAD"],
        capture_output=True,  # noqa: E731
        text=True,
    ).stdout.strip()
    label = args.label or args.bench
    write_json(
        {
            "benchmark": f"paired {args.bench}",
            **provenance(),
            "commits": {k: git(t) for k, t in trees.items()},
            "bench_args": args.extra,
            "runs": runs,
            "summary": summary,
        },
        os.path.join(RESULTS, f"paired_{label}.json"),
    )


if __name__ == "__main__":
    main()
