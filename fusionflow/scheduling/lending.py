"""The global manager's lending rule: which local managers (ranks) lend idle CPU workers to which.
Pure: it sees one snapshot of the progress table and returns loans.

Rule (issue 5): an LM with no Waiting tiny-batches left in its current iteration lends its idle
workers to the LMs still working, in proportion to their need; an LM's need is its Waiting count
minus one for every Active tiny-batch more than half done (that worker frees up soon) and minus the
workers already on their way to it. Nobody gets
more workers than it needs; shares are rounded by largest remainder, ties to the lower LM id, so the
plan is deterministic. A worker serves one LM at a time, so only idle workers are lent; borrowed
workers go home when the borrower's iteration completes: that is not a GM decision but the
borrower's own (runtime/gm/agent.py: a guest takes tiny-batches only up to the iteration it was
lent for, and is sent home when none of those is left for it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    lm: int
    iteration: int
    waiting: int  # tiny-batches of the current iteration not yet started
    active: tuple[float, ...] = ()  # fraction done of each running tiny-batch
    idle_workers: int = 0  # workers it holds (own or borrowed) that run nothing now
    incoming: int = 0  # workers already lent to it that have not arrived yet
    can_borrow: bool = True  # False: lent workers cannot run its samples (e.g. its dataset does not pickle)

    @property
    def need(self) -> int:
        if not self.can_borrow:
            return 0
        return max(0, self.waiting - sum(1 for f in self.active if f > 0.5) - self.incoming)


@dataclass(frozen=True)
class Loan:
    lender: int
    borrower: int
    count: int


def plan_lending(table: list[Progress]) -> list[Loan]:
    lenders = [(p.lm, p.idle_workers) for p in sorted(table, key=lambda p: p.lm) if p.waiting == 0 and p.idle_workers]
    borrowers = [p for p in sorted(table, key=lambda p: p.lm) if p.need > 0]
    supply = sum(n for _, n in lenders)
    if not supply or not borrowers:
        return []
    total_need = sum(p.need for p in borrowers)
    if supply >= total_need:
        shares = {p.lm: p.need for p in borrowers}
    else:
        exact = {p.lm: supply * p.need / total_need for p in borrowers}
        shares = {lm: int(x) for lm, x in exact.items()}
        left = supply - sum(shares.values())
        for lm in sorted(exact, key=lambda lm: (-(exact[lm] - shares[lm]), lm))[:left]:
            shares[lm] += 1
    loans = []
    pool = [[lm, n] for lm, n in lenders]
    for p in borrowers:
        want = shares[p.lm]
        for entry in pool:
            if not want:
                break
            take = min(want, entry[1])
            if take:
                loans.append(Loan(entry[0], p.lm, take))
                entry[1] -= take
                want -= take
    return loans
