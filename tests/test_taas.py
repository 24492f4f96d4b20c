"""TAAS K search: exhaustive over small worlds where the truth is known."""

import itertools

import pytest

from fusionflow.scheduling.taas import KSearch, cpu_may_take


def simulate(best_k: int, k_max: int, rounds: int = 40):
    """A world where the CPU side finishes last while K < best_k and the GPU side when K > best_k;
    makespan grows with the distance from best_k."""
    s = KSearch(k_max=k_max)
    trace = []
    for _ in range(rounds):
        k = s.k
        cpu_last = k < best_k or (k == best_k and len(trace) % 2 == 0)  # at the optimum it ties either way
        trace.append(k)
        s.observe(cpu_last, 1.0 + abs(k - best_k))
    return s, trace


@pytest.mark.parametrize("best_k,k_max", [(b, m) for m in range(0, 9) for b in range(0, m + 1)])
def test_search_settles_on_the_best_k(best_k, k_max):
    s, trace = simulate(best_k, k_max)
    assert s.k == best_k
    assert trace[-5:] == [best_k] * 5
    assert s.settled or best_k in (0, k_max)  # at a bound the search simply stays pinned
    assert all(0 <= k <= k_max for k in trace)


def test_k_moves_one_step_per_batch_and_restart_searches_again():
    s = KSearch(k_max=10)
    assert [s.observe(True, 1.0) for _ in range(3)] == [1, 2, 3]
    s.observe(False, 0.5)  # flip 1: down to 2
    assert s.k == 2
    s.observe(True, 2.0)  # flip 2: settles between 2 and 3 on the lower mean makespan
    assert s.settled and s.k == 3  # K=3 had 0.5, K=2 had 2.0
    assert s.observe(True, 9.0) == 3  # settled: observations no longer move K
    s.restart(k_max=2)
    assert not s.settled and s.k == 2
    assert s.observe(False, 1.0) == 1


def test_cpu_may_take():
    for remaining, reserved in itertools.product(range(6), range(6)):
        assert cpu_may_take(remaining, reserved) == (remaining > reserved)


def test_choose_sharing():
    from fusionflow.scheduling.sharing import choose_sharing

    gib = 1 << 30
    assert choose_sharing([1.0, 1.1, 1.2], [0.8, 0.9, 0.7], 10 * gib, 80 * gib) == "spatial"
    assert choose_sharing([1.0, 1.1, 1.2], [1.3, 1.4, 1.2], 10 * gib, 80 * gib) == "temporal"
    assert choose_sharing([1.0], [0.5], 2 * gib, 80 * gib) == "temporal"  # < 5% free while spatial
    assert choose_sharing([], [0.5], 10 * gib, 80 * gib) == "temporal"
