"""What every experiment records beside its numbers: the command, the date, the machine; and how it
writes its JSON under experiments/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "host": platform.node()}


def provenance() -> dict:
    return {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def interleaved_rates(candidates: dict, items: int, repeats: int, label: str = "") -> tuple[dict, dict]:
    """Time each candidate (a no-argument callable that processes `items` items) once for warm-up,
    then `repeats` rounds with the candidates interleaved, so a noisy neighbour hits them all alike.
    Prints each round; returns ({name: [seconds per round]}, {name: items/s at the median round})."""
    import statistics
    import time

    for go in candidates.values():  # warm-up: caches, lazy imports, first-call costs
        go()
    times = {name: [] for name in candidates}
    for r in range(repeats):
        for name, go in candidates.items():
            t0 = time.perf_counter()
            go()
            times[name].append(time.perf_counter() - t0)
        print(
            f"{label}repeat {r + 1}/{repeats}: "
            + ", ".join(f"{n} {items / t[-1]:.0f} img/s" for n, t in times.items()),
            flush=True,
        )
    return times, {n: items / statistics.median(t) for n, t in times.items()}
