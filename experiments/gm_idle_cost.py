"""What joining a global manager costs a training process while its loader has nothing to do.

A persistent FusionFlowLoader (1 worker) finishes an epoch, then the process sleeps; its CPU time
over that window (all threads: the loader's manager thread is what could spend it) is compared with
and without `global_manager`. Alternating, medians over repeats.

    .venv/bin/python -m experiments.gm_idle_cost [--seconds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import secrets
import time

from experiments.harness import RESULTS, medians, provenance, rotation, write_json
from fusionflow import FusionFlowLoader
from fusionflow.tools.synthetic import EncodedImages, make_jpegs


def idle_cpu_percent(ds, job, seconds: float) -> float:
    with FusionFlowLoader(
        ds, batch_size=8, num_workers=1, policy="randaugment", persistent_workers=True, global_manager=job
    ) as loader:
        for _ in loader:
            pass
        time.sleep(0.5)  # let the GM connect its doorbell
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return 100 * (time.process_time() - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "gm_idle_cost.json"))
    args = ap.parse_args()
    ds = EncodedImages(make_jpegs(16, 200, 400, seed=3))
    runs = {"off": [], "on": []}
    for rep in range(args.repeats):
        for mode in rotation(("off", "on"), rep):
            job = None if mode == "off" else "idle-cost-" + secrets.token_hex(4)
            runs[mode].append(idle_cpu_percent(ds, job, args.seconds))
            print(f"repeat {rep + 1} {mode:>3}: {runs[mode][-1]:.2f}% of a core while idle", flush=True)
    med = medians(runs)
    print(f"median: without GM {med['off']:.2f}%, with GM {med['on']:.2f}% of a core")
    write_json({**provenance(), "args": vars(args), "cpu_percent_median": med, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
