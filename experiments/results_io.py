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
