"""Run a command while N processes keep N cores busy the way CPU workers do: a diagnostic for whether DALI's
host threads lose to CPU workers for cores (issue 41: on a 16-vCPU GPU machine FusionFlow's CPU workers and
DALI's threads share cores that DALI alone has to itself).

Each burner decodes and resizes synthetic JPEGs of the benchmarks' sizes with OpenCV on one thread, as a
CPU worker's decode does, until the command ends; the burners are then stopped and waited for.

    .venv/bin/python -m experiments.cpu_burn --procs 4 -- .venv/bin/python -m experiments.bench_graph ...
    (on the device machine: python3 -m experiments.cpu_burn --procs 4 -- python3 -m experiments.bench_graph ...)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import subprocess
import sys


def burn(seed: int, stop, started) -> None:
    import cv2
    import numpy as np

    cv2.setNumThreads(1)
    rng = np.random.default_rng(seed)
    jpegs = []
    for _ in range(8):
        h, w = (int(x) for x in rng.integers(200, 1000, 2))
        img = cv2.resize(rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8), (w, h))
        jpegs.append(cv2.imencode(".jpg", img)[1])
    n = 0
    started.put(seed)  # busy from here on
    while not stop.is_set():
        img = cv2.imdecode(jpegs[n % len(jpegs)], cv2.IMREAD_COLOR)
        cv2.resize(img, (224, 224), interpolation=cv2.INTER_AREA)
        n += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, required=True, help="busy processes beside the command")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.procs < 0 or not command:
        ap.error("needs --procs >= 0 and a command after --")
    ctx = mp.get_context("spawn")
    stop, started = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=burn, args=(i, stop, started), daemon=True) for i in range(args.procs)]
    for p in procs:
        p.start()
    try:
        for _ in procs:  # every burner busy before the command starts, or no run under a load that is not there
            try:
                started.get(timeout=120)
            except queue.Empty:
                raise SystemExit("a burner did not start within 120 s (OpenCV missing? see its traceback)") from None
        return subprocess.call(command)
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
