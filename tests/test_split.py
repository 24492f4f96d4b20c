"""The accelerator's share of a mini-batch (fusionflow/scheduling/split.py), against the model's
optimum found by brute force over every G, in simulated worlds with the H100's rates (issue 41)."""

import pytest

from fusionflow.scheduling.split import ACCEL_WINDOW, ShareController, best_share, period

B = 256
STEP = 4  # tiny-batch size
DALI_S = 1 / 6800  # DALI alone on the H100: 6,800 img/s
H100 = {  # (training s/img, CPU workers' img/s together, workers)
    "resnet18-4w": (86e-6, 1482, 4),
    "resnet18-15w": (86e-6, 4944, 15),
    "resnet50-4w": (254e-6, 1482, 4),
    "resnet50-15w": (254e-6, 4944, 15),
}


def world_period(g, train_s, cpu_rate, accel_s, fixed_s):
    """The simulated world's seconds per mini-batch: the device runs the training step and the
    accelerator's run (its fixed cost when it runs at all), the CPU workers the rest, in parallel."""
    device = train_s * B + (fixed_s + g * accel_s if g else 0.0)
    return max(device, (B - g) / cpu_rate)


def optimum(train_s, cpu_rate, accel_s, fixed_s):
    """Brute force: the best throughput over every G (an independent reference for the model)."""
    return max(B / world_period(g, train_s, cpu_rate, accel_s, fixed_s) for g in range(B + 1))


def simulate(phases, fixed_s=0.0, shares_device=True, disturb=()):
    """Run the controller through `phases` [(mini-batches, train_s, cpu_rate, workers)]; returns
    per mini-batch (G, throughput, the optimum of its phase, mini-batches since the phase began).
    `disturb`: {mini-batch number: "pause" (training stops 3 s before taking it: validation, a
    checkpoint) or "slow run" (its DALI run took 20x its time: something else held the device)}."""
    c = ShareController(shares_device=shares_device, step=STEP)
    out = []
    disturb = dict(disturb)
    for count, train_s, cpu_rate, workers in phases:
        best = optimum(train_s if shares_device else 0.0, cpu_rate, DALI_S, fixed_s)
        for k in range(count):
            g = c.share(B, workers)
            dev_train = train_s if shares_device else 0.0
            p = world_period(g, dev_train, cpu_rate, DALI_S, fixed_s)
            out.append((g, B / p, best, k))
            per_worker_s = workers / cpu_rate  # one worker's seconds per sample
            for _ in range(max(1, (B - g) // STEP)):
                c.cpu_tiny_batch(STEP * per_worker_s, STEP)
            what = disturb.get(len(out) - 1)
            if g:
                c.accel_run((fixed_s + g * DALI_S) * (20 if what == "slow run" else 1), g)
            cpu_time = (B - g) / cpu_rate
            cpu_bound = cpu_time > dev_train * B + fixed_s + g * DALI_S
            c.iteration(p + 3.0 if what == "pause" else p, B, cpu_bound=cpu_bound and what != "pause")
    return out


def assert_converges(out, within=5, tolerance=0.05):
    for g, rate, best, k in out:
        assert g <= B - STEP, "the CPU side always has work"
        if g < STEP:  # the accelerator idle: only where training needs the device (probes aside)
            assert g == 0 and rate >= (1 - tolerance) * best and k >= 1
        if k >= within:
            assert rate >= (1 - tolerance) * best, (k, g, rate, best)


@pytest.mark.parametrize("name", sorted(H100))
def test_converges_to_the_models_optimum_with_the_h100_rates(name):
    train_s, cpu_rate, workers = H100[name]
    assert_converges(simulate([(40, train_s, cpu_rate, workers)]))


@pytest.mark.parametrize("name", sorted(H100))
def test_a_runs_fixed_cost_is_folded_into_its_rate(name):
    """A DALI run costing 10 ms plus its samples (the H100's conditional graph at 4 samples)."""
    train_s, cpu_rate, workers = H100[name]
    assert_converges(simulate([(40, train_s, cpu_rate, workers)], fixed_s=0.010))


def test_follows_rates_that_change_mid_run():
    """The CPU workers slow to a third (another job took the cores), training gets 3x slower (a
    larger model), both recover, the worker count changes, training needs the whole device (G 0)
    and then no longer does: within 5 mini-batches of each change."""
    phases = [
        (30, 86e-6, 1482, 4),
        (30, 86e-6, 494, 4),
        (30, 254e-6, 494, 4),
        (30, 86e-6, 4944, 15),
        (30, 86e-6, 1482, 4),
        (30, 254e-6, 4944, 15),
        (30, 254e-6, 1482, 4),
    ]
    assert_converges(simulate(phases))
    assert_converges(simulate(phases, fixed_s=0.005))


@pytest.mark.parametrize("what", ["pause", "slow run"])
@pytest.mark.parametrize("name", sorted(H100))
def test_one_pause_or_one_slow_run_does_not_move_the_share(name, what):
    """Training pausing for 3 s once, or one DALI run held up, is not a new rate: every mini-batch after
    the controller converged stays within 5% of the optimum (before medians, one long iteration read as
    training time sent G to 0 and the run at the H100's rates (experiments/twin_gpu.py) took ~10
    mini-batches to recover)."""
    train_s, cpu_rate, workers = H100[name]
    for fixed_s in (0.0, 0.010):
        out = simulate([(40, train_s, cpu_rate, workers)], fixed_s=fixed_s, disturb={12: what, 25: what})
        assert_converges(out)


def test_no_share_where_a_runs_fixed_cost_outweighs_what_the_cpu_side_gains():
    """ResNet-50's step with CPU workers almost as fast as training (3,500 img/s; the twin's 15 workers)
    and a 10 ms run: the model's G is 2, but a run of 2-4 samples costs the device more than the CPU side
    gains: the best is no run at all, not the smallest share (3,386 img/s here; with the tail runs it
    drew, 10% of the rate in the twin)."""
    out = simulate([(40, 254e-6, 3500, 15)], fixed_s=0.010)
    assert_converges(out)
    assert [g for g, *_ in out[-10:]] == [0] * 10 and out[-1][1] == pytest.approx(out[-1][2])
    out = simulate([(40, 254e-6, 3500, 15)])  # without a fixed cost a small share pays
    assert_converges(out)
    assert out[-1][0] > 0


def test_without_a_shared_device_the_sides_finish_together():
    """DALI's CPU backend: training's time does not count against the accelerator."""
    out = simulate([(20, 500e-6, 700, 1)], shares_device=False)
    g = out[-1][0]
    assert abs((B - g) / 700 - g * DALI_S) <= STEP * max(1 / 700, DALI_S)
    assert_converges(out)


def test_best_share_balances_the_model_and_is_its_exact_argmin():
    for cpu_s in (1e-3, 2e-4, 5e-5):
        for accel_s in (1e-4, 1e-3):
            for train_s in (0.0, 1e-4, 3e-4):
                g = best_share(B, cpu_s, accel_s, train_s)
                assert 0 <= g <= B
                brute = min(period(B, x, cpu_s, accel_s, train_s) for x in range(B + 1))
                assert period(B, g, cpu_s, accel_s, train_s) == pytest.approx(brute)


def test_no_workers_all_to_the_accelerator_and_unknown_rates_split_half():
    c = ShareController(step=STEP)
    assert c.share(B, workers=0) == B
    assert c.share(B, workers=2) == B // 2
    with pytest.raises(ValueError):
        best_share(0, 1.0, 1.0)


@pytest.mark.parametrize("batch", [1, 2, 5, 7])
def test_a_mini_batch_under_two_tiny_batches_keeps_one_for_the_accelerator(batch):
    """Batches of fewer than two tiny-batches of 4: the accelerator keeps at least one sample's share (one
    tiny-batch), before the rates are measured (half of 1 was 0) and, on DALI's CPU backend, when the model's
    balance rounds to none, so its rate stays measured; it used to get G = 0 and never run again. (On a shared
    device G = 0 stays possible: training needs the device, and CPU-bound iterations push G up again.)"""
    for shares_device in (False, True):
        c = ShareController(shares_device=shares_device, step=4)
        assert c.share(batch, workers=1) >= 1
        assert c.share(batch, workers=0) == batch
    c = ShareController(shares_device=False, step=4)
    c.cpu_tiny_batch(4 * 1e-4, 4)  # a CPU side 100x the accelerator's rate: the balance is G = 0
    c.accel_run(1e-2 * 4, 4)
    assert best_share(batch, 1e-4, 1e-2) == 0
    assert 1 <= c.share(batch, workers=1) <= batch


def overlapped_period(g, train_s, cpu_rate, fixed_s, accel_s, overlap):
    """A world where a fraction `overlap` of DALI's device time runs beside training's kernels (spatial
    sharing on an H200: DALI alone beside training ran at 0.72 of its rate alone, where additive device
    times give 0.5): training is delayed by the rest, DALI's own stream takes its whole time."""
    dali = fixed_s + g * accel_s if g else 0.0
    return max(train_s * B + (1 - overlap) * dali, dali, (B - g) / cpu_rate)


def simulate_latency(train_s, cpu_rate, workers, read_s, dali_s, overlap, mini_batches=60, interval=None):
    """The controller in the overlapped world, where each run is first read (`read_s`: the input helpers) and then
    held `dali_s` by DALI's host stages before its device work: hidden behind the runs before it while DALI stays
    busy (runs in flight), added to the run's completion interval when the run finds DALI idle -- counted from its
    read's end (accel/accelerator.py), or as `interval(read_s, dali_s, busy)` says. Per mini-batch (G, rate, the
    optimum)."""
    fixed_s, accel_s = 8.3e-3, 64e-6  # our DALI graph on the H200: 10,380 img/s at runs of 256, 7,766 at 128
    c = ShareController(shares_device=True, step=STEP)
    best = max(B / overlapped_period(g, train_s, cpu_rate, fixed_s, accel_s, overlap) for g in range(B + 1))
    out = []
    for _ in range(mini_batches):
        g = c.share(B, workers)
        p = overlapped_period(g, train_s, cpu_rate, fixed_s, accel_s, overlap)
        out.append((g, B / p, best))
        for _ in range(max(1, (B - g) // STEP)):
            c.cpu_tiny_batch(STEP * workers / cpu_rate, STEP)
        if g:
            busy = fixed_s + g * accel_s
            queued = busy >= 0.98 * p  # DALI still busy with the run before when this one was taken
            alone = interval(read_s, dali_s, busy) if interval else dali_s + busy
            c.accel_run(busy if queued else alone, g, queued)
        c.iteration(p, B, cpu_bound=(B - g) / cpu_rate >= 0.98 * p)
    return out


@pytest.mark.parametrize("workers,cpu_rate", [(4, 2200), (15, 7000)])
def test_a_run_that_found_dali_idle_does_not_read_as_a_slower_dali(workers, cpu_rate):
    """A run taken after the last one completed waited out its whole latency: read as DALI's pace, it made DALI
    look slow, G shrank, DALI idled between runs, whose intervals read slower still (the H200, 2026-11-30: with
    15 workers the accelerator took every other mini-batch's share and added nothing). Such a run's interval now
    starts at its read's end and bounds the pace from above only: with ResNet-18's H200 rates, a 25 ms read, 5 ms
    of DALI's host stages and most of DALI's device time beside training's, G settles near the model's optimum."""
    out = simulate_latency(77e-6, cpu_rate, workers, 0.025, 0.005, 0.9)
    tail = out[-30:]
    assert sum(rate / best for _, rate, best in tail) / len(tail) >= 0.97
    assert min(g for g, _, _ in tail) > 0  # the accelerator takes a share of every mini-batch


def test_a_rate_read_only_from_runs_that_found_dali_idle_can_rise_again():
    """When no run is queued (DALI never holds two), a fast reading or two must not hold the rate low for good while
    DALI got slower (a review's find): after 2 * ACCEL_WINDOW such runs in a row their readings count again."""
    c = ShareController(shares_device=True, step=STEP)
    c.accel_run(0.1, 100, queued=False)
    c.accel_run(0.04, 100, queued=False)
    c.accel_run(0.04, 100, queued=False)
    assert c.accel_s == 0.04 / 100
    for _ in range(2 * ACCEL_WINDOW + ACCEL_WINDOW):
        c.accel_run(0.2, 100, queued=False)
    assert c.accel_s == 0.2 / 100


def test_a_run_that_found_dali_idle_only_lowers_the_rate():
    c = ShareController(shares_device=True, step=STEP)
    c.accel_run(0.05, 100, queued=False)  # the first: the only estimate there is
    assert c.accel_s == 0.05 / 100
    for _ in range(ACCEL_WINDOW):
        c.accel_run(0.02, 100)  # runs queued behind others: DALI's pace
    assert c.accel_s == 0.02 / 100
    c.accel_run(0.06, 100, queued=False)  # its latency: not the pace
    assert c.accel_s == 0.02 / 100
    for _ in range(ACCEL_WINDOW):
        c.accel_run(0.01, 100, queued=False)  # faster, even with its latency: DALI got faster
    assert c.accel_s == 0.01 / 100
