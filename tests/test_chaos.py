"""The chaos soak's short form (experiments/chaos.py): epochs with a CPU worker SIGKILLed or SIGSTOPped
at a random batch -- every epoch still delivers each sample exactly once, the stall a stopped worker
costs is bounded (by a second copy of its tiny-batch, or its replacement when it was still starting; both
bounds lowered here), and nothing is left behind."""

import os

import pytest
from test_loader import JPEGS, SMALL, no_leaks  # noqa: F401  (autouse: no process or segment left)

from experiments import chaos
from fusionflow.runtime import liveness


def short_soak(monkeypatch, epochs: int, seed: int, **kw) -> dict:
    """The soak's short form: 48 images, worker kills and stops, the bounds lowered."""
    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1.0)
    monkeypatch.setattr(liveness, "START_S", 2.0)  # a worker may be hit while it starts (a replacement)
    return chaos.soak(
        epochs=epochs,
        images=48,
        faults=("worker-kill", "worker-stop"),
        seed=seed,
        batch_size=8,
        policy=SMALL,
        jpegs=JPEGS[:48],
        progress=lambda line: None,
        min_age=0.5,  # only a worker just forked is spared (the soak's 3 s would spare most of this short run)
        step_s=0.1,  # a training step, so the epochs last long enough for workers to be hit
        **kw,
    )


@pytest.mark.slow
def test_every_epoch_exactly_once_under_killed_and_stopped_workers(monkeypatch):
    out = short_soak(monkeypatch, epochs=6, seed=1)
    assert [e["exactly_once"] for e in out["epochs"]] == [True] * 6
    table = chaos.summarize(out)["by_fault"]
    assert {f for f, row in table.items() if row["injected"]} == {"worker-kill", "worker-stop"}, out["epochs"]
    assert table["worker-stop"]["longest_stall_s"] < liveness.STUCK_FLOOR_S  # bounded well below the stuck bound
    assert out["counters"]["worker_restarts"] >= 1  # what was hit was replaced (the last hit may not be yet)
    assert out["processes_left"] == [] and out["shm_left"] == []


@pytest.mark.slow
def test_exactly_once_with_the_decoded_cache_under_killed_and_stopped_workers(monkeypatch):
    """The same faults while workers fill and read the decoded-image cache: a worker killed mid-fill
    leaves no entry visible (its claim is taken again), every epoch is exact, the keeper is gone at the end."""
    out = short_soak(monkeypatch, epochs=5, seed=2, cache="64MB")
    assert [e["exactly_once"] for e in out["epochs"]] == [True] * 5
    assert out["cache"]["hits"] > 0 and out["cache"]["entries"] == 48
    assert out["processes_left"] == [] and out["shm_left"] == []


@pytest.mark.slow
def test_lent_workers_and_the_global_manager_killed_and_stopped(monkeypatch):
    """experiments/chaos_jobs.py's lending scenario, one job: a's epochs stay exact while b's lent worker
    is SIGKILLed, then SIGSTOPped (killed by `a` past the straggler bound, lowered here, when it was
    running a's tiny-batch; a worker stopped idle or mid-handshake costs nothing), then the GM is
    stopped; the last loader out ends the stopped GM, and nothing is left."""
    import random
    import uuid

    from experiments import chaos_jobs

    monkeypatch.setattr(liveness, "STRAGGLER_FLOOR_S", 1.0)
    monkeypatch.setattr(chaos_jobs, "LENT_WITHIN_S", 60.0)  # a loan comes within a step, even on a busy CI
    before_procs, before_shm = chaos.descendants(), chaos.shm_segments()
    job = f"chaos{uuid.uuid4().hex[:8]}"
    plan = ["lent-kill", "lent-stop", "gm-stop"]
    rows = chaos_jobs.lending_round(
        job, 3, plan, random.Random(5), JPEGS[:48], SMALL, 0.02, progress=lambda line: None, plan=plan
    )
    assert [r["exactly_once"] for r in rows] == [True] * 3
    hits = [h for r in rows for h in r["faults"]]
    assert [h["fault"] for h in hits] == plan and all(h.get("victim") for h in hits), hits
    assert hits[-1]["as_expected"], "the stopped GM outlived its job"
    assert chaos.descendants() - before_procs == set() and chaos.shm_segments() - before_shm == set()


@pytest.mark.slow
def test_shared_loader_client_and_producer_killed(tmp_path):
    """experiments/chaos_jobs.py's shared scenario, two rounds: a client SIGKILLed (the other gets every
    epoch whole), then the producer (both clients raise SharedLoaderError); nothing left either time."""
    import random
    import uuid
    from types import SimpleNamespace

    from experiments import chaos_jobs
    from fusionflow.shared import rendezvous

    args = SimpleNamespace(images=48, epochs=4, policy=SMALL, timeout=30.0, step_ms=20.0)
    name, rng = f"chaos-{uuid.uuid4().hex[:8]}", random.Random(1)
    before_procs, before_shm = chaos.descendants(), chaos.shm_segments()
    for fault in ("client-kill", "producer-kill"):
        row = chaos_jobs.shared_round(name, fault, rng, args, str(tmp_path))
        assert row.get("victim") and not row["hang"], row
        assert row["verdict"]["exactly_once"] and row["verdict"]["as_expected"], row
        rendezvous.read(name)  # a SIGKILLed producer's record is stale: its next reader removes it
        assert not os.path.exists(rendezvous.path_of(name))
    assert chaos.descendants() - before_procs == set() and chaos.shm_segments() - before_shm == set()
