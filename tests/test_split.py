"""The accelerator's share of a mini-batch (fusionflow/scheduling/split.py), against the model's
optimum found by brute force over every G, in simulated worlds with the H100's rates (issue 41)."""

import pytest

from fusionflow.scheduling.split import ShareController, best_share, period

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
