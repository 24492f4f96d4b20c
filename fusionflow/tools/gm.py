"""`python -m fusionflow gm ...`: run a DDP job's global manager explicitly (runtime/gm/manager.py), look at its
local managers, resize their CPU workers."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from fusionflow.runtime.gm import tables as gt
from fusionflow.runtime.gm.manager import GlobalManager, GlobalManagerClient, claim

log = logging.getLogger("fusionflow.runtime.gm.manager")


def main(argv: list[str]) -> int:
    """Run a job's GM explicitly, look at it, resize its workers."""
    ap = argparse.ArgumentParser(prog="python -m fusionflow gm", description=main.__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the GM of JOB in the foreground until Ctrl-C; loaders created with global_manager=JOB join it",
    )
    status = sub.add_parser("status", help="print the job's local managers and their lending counters")
    workers = sub.add_parser("workers", help="set the CPU worker count of every (or one) local manager")
    workers.add_argument("count", type=int)
    workers.add_argument("--lm", type=int, default=None, help="only this local manager (see status)")
    serve.add_argument("--job", required=True, help="the name given to FusionFlowLoader(global_manager=...)")
    for p in (status, workers):
        p.add_argument(
            "--job",
            help="the name given to FusionFlowLoader(global_manager=...); `status` without it lists every job on this "
            "node, `workers` takes the only one",
        )
    args = ap.parse_args(argv)
    if args.action == "workers" and args.count < 1:  # said before looking for the job (as set_workers says it)
        ap.error(
            f"workers: count={args.count} must be 1 or more (a loader with no workers of its own could wait forever)"
        )
    if args.action == "serve" and not args.job:
        ap.error("serve: --job must name the job (the name given to FusionFlowLoader(global_manager=...))")
    if args.action == "serve":
        return _serve(args.job)
    jobs = {args.job: None} if args.job is not None else gt.jobs_on_this_node()  # {name: its table, if found}
    if not jobs:
        print("no global manager runs on this node (no DDP job of yours with lending)", file=sys.stderr)
        return 1
    if args.action == "workers" and len(jobs) > 1:
        print(f"{len(jobs)} jobs run on this node: pass --job, one of {sorted(jobs)}", file=sys.stderr)
        return 1
    return max(_one(job, table, args) for job, table in sorted(jobs.items()))


def _one(job: str, table: str | None, args) -> int:
    """`status` or `workers` for one job (exit status)."""
    try:
        client = GlobalManagerClient(job, table)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    try:
        if args.action == "status":
            rows = client.local_managers()
            if args.job is None:  # listing the node's jobs: say whose rows these are
                print(f"job {job!r}:")
            for row in rows:
                print(" ".join(f"{k}={v}" for k, v in row.items()))
            if not rows:
                print(f"job {job!r}: no local manager is registered (no loader of the job runs now)")
        else:
            client.set_workers(args.count, lm=args.lm)
            who = f"local manager {args.lm}" if args.lm is not None else "every local manager"
            later = (
                " (a loader without persistent workers registers anew each epoch)"
                if args.lm is not None
                else (" (and those that register later)")
            )
            print(f"job {job!r}: CPU worker target {args.count} set for {who}{later}; `status` shows the counts")
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def _serve(job: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    name = gt.table_name(job)
    tables = gt.Tables.create(name, job) or gt.Tables.attach(name)
    if tables is None or not claim(tables):
        print(
            f"a global manager already runs for job {job!r} (pid {tables.gm_pid if tables else '?'})", file=sys.stderr
        )
        return 1
    try:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        log.info("fusionflow GM for job %r: table /dev/shm%s; Ctrl-C stops it", job, name)
        GlobalManager(tables).run(linger=None)  # unlinks the table when interrupted
    except KeyboardInterrupt:  # before the GM's loop: its table is left to nobody
        tables.unlink()
    finally:
        tables.close()
    return 0
