"""Chaos soak across jobs: the faults that experiments/chaos.py cannot inject inside one loader.

    .venv/bin/python -m experiments.chaos_jobs lending --rounds 12 --epochs 4
    .venv/bin/python -m experiments.chaos_jobs shared --rounds 24

lending: per round, a job of two loaders in this process under one global manager: `a` over a slow
dataset, `b` over 8 samples, one epoch of `b` before each of a's, so that while `a` trains the GM lends
b's idle worker to it (and `b` restarts a worker it lost). Each of a's epochs gets one fault after a
random batch (a GM fault only in a round's last epoch: lending ends with it):
  lent-kill     SIGKILL b's worker while it is lent to `a` (`a` requeues its tiny-batch, `b` replaces it)
  lent-stop     SIGSTOP it, never resumed (`a` kills it past the straggler bound once its own worker idles)
  gm-kill       SIGKILL the job's global manager (both loaders train on alone)
  gm-stop       SIGSTOP it, never resumed (silent 10 s: lost as if killed; the last loader out ends it)
  none          nothing (a control epoch)
Every epoch of `a` and `b` must hold each sample exactly once; the longest wait at a's next() is the stall.

shared: per round, a SharedLoader producer and two clients, each its own process (`python -m
experiments.chaos_jobs producer|client`), as co-located jobs run; a random moment after both attached:
  client-kill   SIGKILL a client: the other gets every epoch whole
  client-stop   SIGSTOP a client: the producer lets it go after 10 s and the other gets every epoch
                whole; resumed once the others are done, the stopped one must raise SharedLoaderError
  producer-kill SIGKILL the producer: both clients raise SharedLoaderError (it is gone) at once,
                or finish whole if every batch had been sent
  producer-stop SIGSTOP it: both clients raise SharedLoaderError within their timeout (or finish
                whole); then the soak kills it (a stopped job is its owner's to end)
  none          nothing
Every epoch a client completes must hold each sample exactly once, and each client must end as its
fault says. After each round and at the end: no process, no /dev/shm segment, no rendezvous record left
(a SIGKILLed producer's record is stale; the next reader of that name removes it, as a client would).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from experiments import harness
from experiments.chaos import Indexed, _cmdline, descendants, hit, shm_segments
from fusionflow.tools.baseline import timed_batches

LENDING = ("lent-kill", "lent-stop", "gm-kill", "gm-stop", "none")
SHARED = ("client-kill", "client-stop", "producer-kill", "producer-stop", "none")
LENT_WITHIN_S = 5.0  # lent-*: how long the training step waits for a loan to hit
ROUND_S = 240.0  # a round's processes that have not ended by then count as a hang


# ---------------------------------------------------------------- lending and the global manager
class Slow(Indexed):
    """Indexed JPEGs that take `sleep_s` each to read: the loader that borrows."""

    def __init__(self, jpegs, sleep_s: float):
        super().__init__(jpegs)
        self.sleep_s = sleep_s

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return super().__getitem__(i)


def gm_pids(job: str) -> list[int]:
    from fusionflow.runtime.gm.tables import table_name

    name = table_name(job)
    return [p for p in descendants() if "fusionflow.runtime.gm.manager" in _cmdline(p) and name in _cmdline(p)]


def lent_pids(lender) -> list[int]:
    workers = lender.parts.runtime.manager.pool.workers
    return [w.process.pid for w in workers if w is not None and w.lent_to is not None and w.process.is_alive()]


def _lent_soon(lender) -> list[int]:
    """The lender's lent workers, waiting up to LENT_WITHIN_S for one (a training step's time: loans
    come and go with the borrower's need)."""
    deadline = time.monotonic() + LENT_WITHIN_S
    while not (pids := lent_pids(lender)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def lending_round(job: str, epochs: int, faults, rng, jpegs, policy: str, sleep_s: float, progress, plan=None) -> list:
    """One job's epochs of `a`, one fault each (`plan`, or drawn from `faults`)."""
    from fusionflow import FusionFlowLoader

    common = dict(num_workers=1, policy=policy, persistent_workers=True, pin_workers=False, global_manager=job)
    a = FusionFlowLoader(Slow(jpegs, sleep_s), batch_size=16, shuffle=True, seed=1, tiny_batch_size=2, **common)
    b = FusionFlowLoader(Indexed(jpegs[:8]), batch_size=8, seed=2, **common)
    out = []
    with a, b:
        local = [f for f in faults if not f.startswith("gm")] or ["none"]
        plan = plan or [rng.choice(local) for _ in range(epochs - 1)] + [rng.choice(faults)]
        for epoch, fault in enumerate(plan):
            b_labels = [i for _x, y in b for i in y.tolist()]  # b trains a little; idle, it lends its worker
            a.set_epoch(epoch)
            at, labels, waits, hits = rng.randrange(max(1, len(a) - 1)), [], [], []
            for _x, y, waited in timed_batches(a):
                waits.append(waited)
                labels += y.tolist()
                if len(waits) - 1 == at:
                    pids = gm_pids(job) if fault.startswith("gm") else _lent_soon(b)
                    hits.append({**hit(fault, pids, rng), "at_batch": at})
            exact = sorted(labels) == list(range(len(jpegs))) and sorted(b_labels) == list(range(8))
            out.append(_epoch_row(epoch, hits, exact, waits))
            progress(_line(out[-1]))
        out[-1]["stats"] = {"a": _counters(a), "b": _counters(b)}
    deadline = time.monotonic() + 30  # the GM lingers out (or was ended by the last loader out)
    while gm_pids(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    for h in out[-1]["faults"]:  # a GM fault: the epoch was whole (above) and the GM is gone
        if h["fault"].startswith("gm") and h.get("victim"):
            h["as_expected"] = not gm_pids(job)
    return out


def _counters(loader) -> dict:
    s = loader.stats.summary()
    return {k: s.get(k) for k in ("worker_restarts", "workers_stuck", "workers_borrowed", "global_manager")}


def _epoch_row(epoch, hits, exact, waits) -> dict:
    return {"epoch": epoch, "faults": hits, "exactly_once": exact, "longest_wait_s": max(waits)}


def _line(r: dict) -> str:
    what = ", ".join(
        f"{h['fault']}" + ("" if h.get("victim") or h["fault"] == "none" else " (missed)") for h in r["faults"]
    )
    return f"epoch {r['epoch']}  exactly once: {r['exactly_once']}  longest wait {r['longest_wait_s']:.2f} s  {what}"


# ---------------------------------------------------------------- the shared loader
def producer_main(a) -> int:
    from fusionflow import FusionFlowLoader, SharedLoader

    loader = FusionFlowLoader(
        Indexed(harness.mixed_jpegs(a.images)), batch_size=16, shuffle=True, num_workers=2, policy=a.policy, seed=3
    )
    with SharedLoader(loader, name=a.name) as shared:
        shared.serve(epochs=a.epochs, min_clients=2)
    return 0


def client_main(a) -> int:
    """One JSON line per event on stdout: attached, each epoch (exact, longest wait), the end."""
    from fusionflow import SharedLoaderClient, SharedLoaderError

    def say(**kw):
        print(json.dumps(kw), flush=True)

    t0 = time.monotonic()
    try:
        loader = SharedLoaderClient(a.name, timeout=a.timeout)
        say(attached=True)
        for epoch in range(a.epochs):
            labels, waits = [], []
            t0 = time.monotonic()
            for _x, y, waited in timed_batches(loader):
                waits.append(waited)
                labels += y.tolist()
                time.sleep(a.step_ms / 1e3)  # the training step
                t0 = time.monotonic()
            say(epoch=epoch, exact=sorted(labels) == list(range(a.images)), longest_wait_s=max(waits, default=0.0))
        loader.close()
    except SharedLoaderError as exc:
        say(end="error", message=str(exc).splitlines()[0][:200], after_s=time.monotonic() - t0)
        return 0
    say(end="ok")
    return 0


def _job(role: str, name: str, a, log, tmp: str) -> subprocess.Popen:
    policy = a.policy
    if not isinstance(policy, str):  # a policy given as a mapping travels as a file
        policy = os.path.join(tmp, "policy.yaml")
        with open(policy, "w") as f:
            json.dump(a.policy, f)  # JSON is YAML
    args = ["--name", name, "--images", str(a.images), "--epochs", str(a.epochs), "--policy", policy]
    args += ["--timeout", str(a.timeout), "--step-ms", str(a.step_ms)]
    return subprocess.Popen([sys.executable, "-m", "experiments.chaos_jobs", role, *args], stdout=log, stderr=log)


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def _wait_all(procs, deadline: float) -> bool:
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def shared_round(name: str, fault: str, rng, a, tmp: str) -> dict:
    logs = [os.path.join(tmp, f"{role}.log") for role in ("producer", "client0", "client1")]
    files = [open(p, "w") for p in logs]
    producer = _job("producer", name, a, files[0], tmp)
    clients = [_job("client", name, a, f, tmp) for f in files[1:]]
    start, hang = time.monotonic(), False
    while not all(any(e.get("attached") for e in _events(p)) for p in logs[1:]):
        if time.monotonic() - start > ROUND_S or any(c.poll() is not None for c in clients):
            break
        time.sleep(0.05)
    epoch = rng.randrange(a.epochs - 1)  # the fault comes during the next epoch (or at its start)
    while not any(e.get("epoch") == epoch for e in _events(logs[1])) and time.monotonic() - start < ROUND_S:
        if clients[0].poll() is not None:
            break
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.3))
    victim = rng.randrange(2) if fault.startswith("client") else None
    target = clients[victim] if victim is not None else producer
    alive = [target.pid] if target.poll() is None else []  # poll() reaps: a zombie is not hit
    row = {"fault": fault, "after_epoch": epoch, **(hit(fault, alive, rng) if fault != "none" else {})}
    others = [c for k, c in enumerate(clients) if k != victim]
    deadline = time.monotonic() + ROUND_S
    if fault == "client-stop":
        hang = not _wait_all(others + [producer], deadline)
        target.send_signal(signal.SIGCONT)  # resumed: it must find itself let go
    elif fault == "producer-stop":
        hang = not _wait_all(clients, deadline)
        target.kill()
    hang = not _wait_all([producer, *clients], deadline) or hang
    for p in [producer, *clients]:
        if p.poll() is None:
            p.kill()
            p.wait()
    for f in files:
        f.close()
    ends = [_events(p) for p in logs[1:]]
    return {**row, "hang": hang, "clients": ends, "verdict": _verdict(fault, victim, ends, hang, a.epochs)}


def _verdict(fault: str, victim, ends, hang: bool, epochs: int) -> dict:
    """Every completed epoch exact; each client ended as its fault says: every epoch whole, or, hit
    itself (stopped) or by the producer's fault, SharedLoaderError -- or whole, when the fault came
    after its last batch was sent; a killed client says nothing."""
    exact = all(e["exact"] for events in ends for e in events if "epoch" in e)
    stall, right = 0.0, not hang
    for k, events in enumerate(ends):
        end = next((e for e in events if "end" in e), None)
        if k == victim:  # killed, or stopped: its own waits hold the stop itself
            if fault == "client-stop":
                right &= end is not None and end["end"] in ("error", "ok")
            continue
        stall = max([stall] + [e["longest_wait_s"] for e in events if "epoch" in e])
        whole = end is not None and end["end"] == "ok" and sum("epoch" in e for e in events) == epochs
        if fault.startswith("producer"):  # or whole: it had been sent every batch before the fault
            right &= whole or (end is not None and end["end"] == "error")
            stall = max(stall, end["after_s"] if end and "after_s" in end else 0.0)
        else:
            right &= whole
    return {"exactly_once": exact, "as_expected": right, "longest_stall_s": stall}


def shared_soak(rounds: int, faults, seed: int, a, progress=print) -> list:
    from fusionflow.shared import rendezvous

    rng, name, out = random.Random(seed), f"chaos-{uuid.uuid4().hex[:8]}", []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            row = shared_round(name, rng.choice(faults), rng, a, tmp)
            rendezvous.read(name)  # as the next client or producer of this name would: a stale record goes
            row["record_left"] = os.path.exists(rendezvous.path_of(name))
            out.append(row)
            v = row["verdict"]
            progress(
                f"round {r:3d}  {row['fault']:<13} exactly once: {v['exactly_once']}  as expected: {v['as_expected']}"
                f"  longest stall {v['longest_stall_s']:.2f} s  ends: {[_end(e) for e in row['clients']]}"
            )
    return out


def _end(events) -> str:
    end = next((e for e in events if "end" in e), None)
    return "killed" if end is None else end["end"] if end["end"] == "ok" else f"error: {end['message'][:60]}"


# ---------------------------------------------------------------- the table
def summarize(rows: list) -> dict:
    """Per fault kind: injected, longest stall, every epoch exact, every outcome as the fault says."""
    table = {}
    for r in rows:
        row = table.setdefault(r["fault"], {"injected": 0, "missed": 0, "longest_stall_s": 0.0, "exactly_once": True})
        row["injected" if r.get("victim") or r["fault"] == "none" else "missed"] += 1
        row["longest_stall_s"] = max(row["longest_stall_s"], r["longest_stall_s"])
        row["exactly_once"] &= r["exactly_once"]
        row["as_expected"] = row.get("as_expected", True) and r.get("as_expected", True)
    return table


def flat_lending(epochs: list) -> list:
    return [
        {**h, "longest_stall_s": e["longest_wait_s"], "exactly_once": e["exactly_once"]}
        for e in epochs
        for h in e["faults"]
    ]


def flat_shared(rows: list) -> list:
    return [{**r, **r["verdict"]} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["lending", "shared", "producer", "client"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="randaugment")
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="lending: the borrower's read time per sample")
    ap.add_argument("--timeout", type=float, default=10.0, help="shared: the clients' timeout")
    ap.add_argument("--step-ms", type=float, default=20.0, help="shared: a client's training step (a sleep)")
    ap.add_argument("--faults", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.scenario == "producer":
        sys.exit(producer_main(a))
    if a.scenario == "client":
        sys.exit(client_main(a))
    known = LENDING if a.scenario == "lending" else SHARED
    faults = tuple(a.faults.split(",")) if a.faults else known
    if set(faults) - set(known):
        ap.error(f"--faults: {sorted(set(faults) - set(known))} are not {a.scenario} faults ({', '.join(known)})")
    before_procs, before_shm, t0 = descendants(), shm_segments(), time.monotonic()
    if a.scenario == "lending":
        rng, jpegs, epochs = random.Random(a.seed), harness.mixed_jpegs(a.images), []
        for r in range(a.rounds):
            print(f"round {r}")
            epochs += lending_round(
                f"chaos{uuid.uuid4().hex[:8]}", a.epochs, faults, rng, jpegs, a.policy, a.sleep_ms / 1e3, print
            )
        rows, raw = flat_lending(epochs), {"epochs": epochs}
    else:
        raw = {"rounds": shared_soak(a.rounds, faults, a.seed, a)}
        rows = flat_shared(raw["rounds"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (descendants() - before_procs or shm_segments() - before_shm):
        time.sleep(0.2)
    left = sorted(_cmdline(p)[:100] for p in descendants() - before_procs)
    summary = {
        "scenario": a.scenario,
        "seconds": round(time.monotonic() - t0, 1),
        "faults_injected": sum(1 for r in rows if r.get("victim")),
        "by_fault": summarize(rows),
        "processes_left": left,
        "shm_left": sorted(shm_segments() - before_shm),
    }
    print(json.dumps(summary, indent=1))
    path = harness.result_path(a.out, f"chaos_{a.scenario}.json")
    harness.write_json({**harness.provenance(), "summary": summary, **raw}, path)


if __name__ == "__main__":
    main()
