"""Simulated DDP data loading with and without the global manager's worker lending.

R ranks x W CPU workers; every iteration each rank prepares T tiny-batches whose times are
log-normal (RandAugment's per-sample cost varies) times a per-rank factor (one rank gets heavier
images); ranks start each iteration together (the all-reduce) and the iteration lasts until the
slowest rank's batch is ready plus a fixed training step. With lending, `plan_lending` -- the rule the
runtime uses -- runs at every event, moving idle workers of finished ranks to ranks still working;
they return when the borrower's iteration completes. Both runs see identical task times.

    .venv/bin/python -m experiments.sim_lending [--ranks 8] [--workers 4] [--tiny 16] [--iters 200]
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics

import numpy as np

from experiments.harness import RESULTS, provenance, write_json
from fusionflow.scheduling.lending import Progress, plan_lending


def iteration(times: list[list[float]], workers: int, lend: bool) -> tuple[list[float], int]:
    """Ready time of each rank for one iteration; and how many workers were lent."""
    ranks = len(times)
    queue = [list(sorted(t)) for t in times]  # smallest first, as CPU workers take them
    home = [r for r in range(ranks) for _ in range(workers)]
    serving = list(home)  # which rank each worker serves now
    running = {}  # worker -> (start, end, rank)
    events = []
    ready = [0.0 if not q else None for q in queue]
    lent_total = 0
    now = 0.0

    def start_idle():
        for w in range(len(serving)):
            r = serving[w]
            if w not in running and queue[r]:
                d = queue[r].pop(0)
                running[w] = (now, now + d, r)
                heapq.heappush(events, (now + d, w))

    def rebalance():
        nonlocal lent_total
        # borrowed workers go home once their borrower's iteration is complete
        for w in range(len(serving)):
            r = serving[w]
            if w not in running and r != home[w] and not queue[r] and all(x[2] != r for x in running.values()):
                serving[w] = home[w]
        if not lend:
            return
        table = []
        for r in range(ranks):
            active = tuple((now - s) / (e - s) for s, e, rr in running.values() if rr == r and e > s)
            idle = [w for w in range(len(serving)) if serving[w] == r and w not in running]
            table.append(Progress(r, 0, len(queue[r]), active, len(idle)))
        for loan in plan_lending(table):
            idle = [w for w in range(len(serving)) if serving[w] == loan.lender and w not in running]
            for w in idle[: loan.count]:
                serving[w] = loan.borrower
                lent_total += 1

    rebalance()
    start_idle()
    while events:
        now, w = heapq.heappop(events)
        _, _, r = running.pop(w)
        if not queue[r] and all(x[2] != r for x in running.values()):
            ready[r] = now
        rebalance()
        start_idle()
    return ready, lent_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tiny", type=int, default=16, help="tiny-batches per rank per iteration")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=0.6, help="log-normal spread of tiny-batch times")
    ap.add_argument("--heavy", type=float, default=1.3, help="time factor of rank 0 (heavier images)")
    ap.add_argument("--step", type=float, default=2.0, help="training step, in units of a median tiny-batch")
    ap.add_argument("--out", default=os.path.join(RESULTS, "sim_lending.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    factor = [args.heavy] + [1.0] * (args.ranks - 1)
    res = {}
    draws = [
        [(rng.lognormal(0.0, args.sigma, args.tiny) * factor[r]).tolist() for r in range(args.ranks)]
        for _ in range(args.iters)
    ]
    for lend in (False, True):
        gaps, iters, lent = [], [], 0
        for times in draws:
            ready, n = iteration(times, args.workers, lend)
            gaps.append(max(ready) - min(ready))
            iters.append(max(ready) + args.step)
            lent += n
        res["gm_on" if lend else "gm_off"] = {
            "straggler_gap_median": statistics.median(gaps),
            "straggler_gap_mean": statistics.fmean(gaps),
            "iteration_time_mean": statistics.fmean(iters),
            "workers_lent_per_iteration": lent / args.iters,
        }
    on, off = res["gm_on"], res["gm_off"]
    res["throughput_ratio_on_vs_off"] = off["iteration_time_mean"] / on["iteration_time_mean"]
    res["gap_ratio_on_vs_off"] = on["straggler_gap_mean"] / off["straggler_gap_mean"]
    res.update(vars(args), **provenance())
    print(
        f"{args.ranks} ranks x {args.workers} workers, {args.tiny} tiny-batches/iteration, sigma {args.sigma}, "
        f"rank 0 x{args.heavy}"
    )
    for k in ("gm_off", "gm_on"):
        r = res[k]
        print(
            f"  {k}: straggler gap mean {r['straggler_gap_mean']:.2f}, iteration {r['iteration_time_mean']:.2f}, "
            f"workers lent/iteration {r['workers_lent_per_iteration']:.1f}"
        )
    print(f"  gap x{res['gap_ratio_on_vs_off']:.2f}, throughput x{res['throughput_ratio_on_vs_off']:.3f}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
