"""TAAS's reservation rule and the sharing choice."""

import itertools

from fusionflow.scheduling.taas import cpu_may_take


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
