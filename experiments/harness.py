"""What every experiment shares: where data sets and results live, the synthetic data sets (made once,
reused), interleaved timing with medians, and the result JSON with its provenance (the command, the
machine, the date, the git commit).

Every script is a module of this package, run from the repository root, so that the checkout's own
`fusionflow` is the one imported:

    .venv/bin/python -m experiments.<name> [arguments]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
DATA = os.path.join(ROOT, "experiments", "data")  # generated data sets (git-ignored; `make clean` removes it)


# ---------------------------------------------------------------- data sets
def data_path(*parts: str) -> str:
    """A path under experiments/data."""
    return os.path.join(DATA, *parts)


def image_folder(images: int, root: str | None = None, classes: int = 4) -> str:
    """An ImageFolder of synthetic mixed-size JPEGs (200-1000 px): `classes` folders of
    max(1, images // classes) images each, at `root` (default experiments/data/bench_<count>). Files
    already there are kept, so the second call costs nothing. Returns the root."""
    from fusionflow.tools.synthetic import make_image_folder

    per_class = max(1, images // classes)
    root = root or data_path(f"bench_{per_class * classes}")
    make_image_folder(root, num_classes=classes, per_class=per_class)
    return root


def cached_pickle(path: str, make: Callable[[], object]) -> str:
    """`path`, holding the pickle of `make()`: made the first time, reused after. Returns the path."""
    if not os.path.exists(path):
        import pickle

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(make(), f)
    return path


def _encode_one(job: tuple[int, int, int]) -> bytes:
    from fusionflow.tools.synthetic import encode, make_image

    h, w, seed = job
    return encode(make_image(h, w, seed))


def mixed_jpegs(n: int, procs: int | None = None) -> list[bytes]:
    """`n` synthetic JPEGs with sides uniform in 200..1000 px (image i from seed i), made by `procs`
    forked processes (default: every core)."""
    import multiprocessing as mp

    import numpy as np

    rng = np.random.default_rng(0)
    jobs = [(int(h), int(w), i) for i, (h, w) in enumerate(rng.integers(200, 1001, (n, 2)))]
    with mp.get_context("fork").Pool(procs or os.cpu_count() or 1) as pool:
        return pool.map(_encode_one, jobs, chunksize=16)


# ---------------------------------------------------------------- timing
def cpu_ticks() -> tuple[int, int]:
    """(idle, all) clock ticks this machine's cores have spent since boot, from /proc/stat (idle counts
    iowait; guest time is inside user). Raises OSError where there is no /proc."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def cpu_idle_fraction(seconds: float) -> float:
    """The machine's idle share of all its cores over the next `seconds` (1.0 where there is no /proc)."""
    try:
        idle0, total0 = cpu_ticks()
        time.sleep(seconds)
        idle1, total1 = cpu_ticks()
    except OSError:
        time.sleep(seconds)
        return 1.0
    return (idle1 - idle0) / max(1, total1 - total0)


def settle(idle: float = 0.85, window: float = 0.25, limit: float = 60.0) -> float:
    """Wait until the machine is quiet -- `idle` of its cores idle over a `window` -- or `limit` seconds
    have passed; returns the seconds waited. A candidate that runs ahead of its consumer (a loader's
    ring, DALI's prefetch queue) refills its bank after its round: without this, that refill runs in the
    next candidate's timed window and a candidate is timed against its neighbour's leftovers."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit and cpu_idle_fraction(window) < idle:
        pass
    return time.perf_counter() - t0


def rotation(names: Iterable, r: int) -> list:
    """`names` in round r's order: rotated by r, so who goes first changes every round (two names
    alternate: A B, B A, A B ...) and neither a drift in the machine's load nor a place in the round
    favours one of them."""
    names = list(names)
    k = r % len(names)
    return names[k:] + names[:k]


def rounds(
    candidates: dict[str, Callable[[], object]],
    repeats: int,
    warmup: bool = True,
    rotate: bool = False,
    report: Callable[[int, dict], None] | None = None,
) -> dict[str, list]:
    """Call every candidate once to warm up (caches, lazy imports, first-call costs) unless `warmup`
    is False, then `repeats` rounds calling each once -- in `rotation` when `rotate`, else in the
    dict's order -- so that a noisy neighbour hits them all alike. Returns each candidate's return
    values, round by round; `report(r, values so far)` after each round."""
    if warmup:
        for go in candidates.values():
            go()
    values: dict[str, list] = {name: [] for name in candidates}
    for r in range(repeats):
        for name in rotation(candidates, r) if rotate else candidates:
            values[name].append(candidates[name]())
        if report is not None:
            report(r, values)
    return values


def timed(go: Callable[[], object]) -> Callable[[], float]:
    """`go` as a candidate for `rounds` whose value is its wall time in seconds."""

    def run() -> float:
        t0 = time.perf_counter()
        go()
        return time.perf_counter() - t0

    return run


def interleaved_rates(candidates: dict, items: int, repeats: int, label: str = "") -> tuple[dict, dict]:
    """Time each candidate (a no-argument callable that processes `items` items) once for warm-up,
    then `repeats` rounds with the candidates interleaved (`rounds`). Prints each round; returns
    ({name: [seconds per round]}, {name: items/s at the median round})."""

    def report(r: int, times: dict) -> None:
        rates = ", ".join(f"{n} {items / t[-1]:.0f} img/s" for n, t in times.items())
        print(f"{label}repeat {r + 1}/{repeats}: {rates}", flush=True)

    times = rounds({name: timed(go) for name, go in candidates.items()}, repeats, report=report)
    return times, {n: items / statistics.median(t) for n, t in times.items()}


def medians(runs: dict) -> dict:
    """{name: median of its list}."""
    return {name: statistics.median(values) for name, values in runs.items()}


# ---------------------------------------------------------------- subprocesses
def module_command(name: str) -> list[str]:
    """The command that runs experiments/<name>.py as a module with this interpreter; run it with
    cwd=ROOT (the tree whose experiments and fusionflow it imports)."""
    return [sys.executable, "-m", f"experiments.{name}"]


# ---------------------------------------------------------------- results and their provenance
def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "host": platform.node()}


def git_commit(tree: str = ROOT) -> str | None:
    """The commit checked out in `tree` (12 hex digits), "-dirty" appended when tracked files differ
    from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", tree, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
        if head.returncode:
            return None
        status = subprocess.run(
            ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:  # no git on this machine
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def command() -> str:
    """This process's command line as a user would type it: `python -m experiments.<name> ...`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {os.path.relpath(sys.argv[0])}"
    return " ".join([head, shlex.join(sys.argv[1:])]).strip()


def provenance() -> dict:
    return {
        "command": command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "git_commit": git_commit(),
    }


def result_path(out: str | None, name: str, folder: str = RESULTS) -> str:
    """Where a result goes: `out` when given, else experiments/results/<name> (or `folder`/<name>)."""
    return out or os.path.join(folder, name)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
