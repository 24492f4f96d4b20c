"""The global manager's lending rule, over many random progress tables."""

import numpy as np
import pytest

from fusionflow.scheduling.lending import Loan, Progress, plan_lending


def random_table(rng, lms):
    table = []
    for lm in range(lms):
        waiting = int(rng.integers(0, 8)) if rng.random() < 0.6 else 0
        active = tuple(float(f) for f in rng.random(int(rng.integers(0, 4))))
        table.append(Progress(lm, 3, waiting, active, int(rng.integers(0, 5))))
    return table


@pytest.mark.parametrize("seed", range(300))
def test_plan_invariants(seed):
    rng = np.random.default_rng(seed)
    table = random_table(rng, int(rng.integers(1, 9)))
    loans = plan_lending(table)
    by = {p.lm: p for p in table}
    lent, got = {}, {}
    for loan in loans:
        assert loan.count > 0 and loan.lender != loan.borrower
        assert by[loan.lender].waiting == 0  # only LMs with nothing left to start lend
        lent[loan.lender] = lent.get(loan.lender, 0) + loan.count
        got[loan.borrower] = got.get(loan.borrower, 0) + loan.count
    assert all(lent[lm] <= by[lm].idle_workers for lm in lent)  # a worker serves one LM at a time
    assert all(got[lm] <= by[lm].need for lm in got)  # never more than it can use
    supply = sum(p.idle_workers for p in table if p.waiting == 0)
    need = sum(p.need for p in table)
    assert sum(got.values()) == min(supply, need)  # nothing idle while someone waits
    if supply < need:  # proportional to need, within rounding
        for p in table:
            if p.need:
                assert abs(got.get(p.lm, 0) - supply * p.need / need) < 1
    assert plan_lending(list(reversed(table))) == loans  # deterministic, order-independent


def test_active_past_half_counts_as_one_fewer():
    assert Progress(0, 0, waiting=3, active=(0.7, 0.4, 0.51)).need == 1
    loans = plan_lending([Progress(0, 0, 0, (), 4), Progress(1, 0, 3, (0.9,), 0), Progress(2, 0, 2, (0.2,), 0)])
    assert loans == [Loan(0, 1, 2), Loan(0, 2, 2)]


def test_proportional_split_with_largest_remainder():
    table = [Progress(0, 1, 0, (), 3), Progress(1, 1, 4), Progress(2, 1, 2), Progress(3, 1, 0, (), 0)]
    assert plan_lending(table) == [Loan(0, 1, 2), Loan(0, 2, 1)]  # 3 * 4/6 = 2, 3 * 2/6 = 1
