"""The allocator bridge's ledger bookkeeping at many lent blocks, as the bridge did it per prep window until
2026-11-28 (since then it lends one arena, once: one record): what lending
`n` blocks and taking them back costs in the shared ledger, the way the bridge did it before (one
`yield_blocks`, then one `borrow_block` and later one `release_block` per block, each scanning the
ledger: O(n^2)) against the bulk calls it makes now (`lend_to_self`, `release_blocks`: one pass
each). Both end with `take_back_released`. No GPU needed: the ledger is plain shared memory (the
GPU side of a window -- torch.cuda.memory_snapshot(), the native resource -- is not included).
Alternating, medians over repeats, in one process.

    .venv/bin/python -m experiments.ledger_window_bench [--blocks 320 1000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import time

from experiments.harness import RESULTS, medians, provenance, rounds, write_json
from fusionflow.accel.bridge.ledger import Block, BlockLedger

PIECE = 64 << 20  # the per-window bridge lent in pieces of at most 64 MiB


def per_block(ledger: BlockLedger, blocks: list[Block]) -> None:
    ledger.yield_blocks(blocks, sum(b.size for b in blocks))
    for _ in blocks:
        ledger.borrow_block(1)
    for b in blocks:
        ledger.release_block(b.address)
    ledger.take_back_released()


def bulk(ledger: BlockLedger, blocks: list[Block]) -> None:
    ledger.lend_to_self(blocks)
    ledger.release_blocks([b.address for b in blocks])
    ledger.take_back_released()


def window_ms(fn, ledger: BlockLedger, blocks: list[Block]) -> float:
    t0 = time.perf_counter()
    fn(ledger, blocks)
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[320, 1000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(RESULTS, "ledger_window.json"))
    args = ap.parse_args()
    rows = []
    for n in args.blocks:
        blocks = [Block(0x7F0000000000 + k * PIECE, PIECE, 0) for k in range(n)]
        ledger = BlockLedger(capacity=max(4096, n))

        def window(fn):
            def go() -> float:
                ms = window_ms(fn, ledger, blocks)
                assert ledger.totals() == {"lent_bytes": 0, "borrowed_bytes": 0}
                return ms

            return go

        try:
            times = rounds({"per_block": window(per_block), "bulk": window(bulk)}, args.repeats, warmup=False)
        finally:
            ledger.close()
        med = medians(times)
        rows.append(
            {
                "blocks": n,
                "per_block_ms": med["per_block"],
                "bulk_ms": med["bulk"],
                "speedup": med["per_block"] / med["bulk"],
                "samples_ms": times,
            }
        )
        print(
            f"{n:5d} blocks: per-block {med['per_block']:8.2f} ms   bulk {med['bulk']:6.2f} ms   "
            f"x{med['per_block'] / med['bulk']:.0f}"
        )
    write_json({**provenance(), "repeats": args.repeats, "piece_bytes": PIECE, "results": rows}, args.out)


if __name__ == "__main__":
    main()
