"""The global order (issue 46) against today's online packer, from lengths: fill, per-step vision
balance and planning time per row on the benchmark mix (benchmarks/mixes.py, the synthetic
Infinity-MM mix at 8K tokens).

- Today (baseline): each DP rank packs its own contiguous part of the samples in buffers of 256
  (`mmdata.inspect.packing.online_rank_rows`: the loader's `pack_buffer`, knapsack + evened vision
  rows), and the train loop's RowBalancer places each step's rows (`balance.simulate`: `assign_step`,
  or `assign_window` over `auto_window` steps at few rows per rank).
- Ours: one `StepPlanner` over the same samples (every rank plans the same, no exchange), each
  step's rows placed by `placement` (assign_block).

Printed side by side for DP 2, 4 and 8 at 1 and 4 rows per rank (micro-batch 1): fill (real tokens
over row slots), vision balance (max / mean tiles over ranks per step: mean and worst step) and
planning time per row (ours: the whole global plan, which every rank repeats; today's: one rank's
packing per row it yields). Ends with two lines (DP 8 at 1 row per rank, the hardest case):

  BENCH global_order_fill baseline=<today's fill> ours=<ours> unit=fill ratio=<ours/today>
  BENCH global_order_balance baseline=<today's mean> ours=<ours> unit=max/mean ratio=<today/ours>

  python -m benchmarks.bench_global_order [--quick] [--rows 8192] [--seq-length 8192]

`--quick` (a smoke run): 128 rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.mixes import llava_ov_mix
from mmdata.global_order import OrderSource, StepPlanner, placed_balance
from mmdata.inspect.packing import online_rank_rows
from mmdata.packing.balance import DEFAULT_TILE_TOKENS, BalanceReport, StepShape, auto_window, simulate

SEED = 0


def today(tokens: np.ndarray, tiles: np.ndarray, seq: int, shape: StepShape) -> tuple[float, BalanceReport, float]:
    """(fill, balance, ms per row) of the online packer and the RowBalancer."""
    t0 = time.perf_counter()
    rank_rows = online_rank_rows(tokens, tiles, seq, shape.dp)
    rows = sum(len(r) for r in rank_rows)
    ms = 1000 * (time.perf_counter() - t0) / rows
    fill = sum(n for r in rank_rows for n, _ in r) / (rows * seq)
    window = auto_window(shape.rows_per_rank)
    report = simulate(rank_rows, shape, DEFAULT_TILE_TOKENS, window=window)
    return fill, report["windowed" if window > 1 else "balanced"], ms


def ours(
    tokens: np.ndarray, tiles: np.ndarray, seq: int, shape: StepShape, rows: int
) -> tuple[float, BalanceReport, float]:
    """(fill, balance, ms per row) of the global order over `rows` rows."""
    planner = StepPlanner([OrderSource.from_arrays("mix", tokens, tiles)], None, seq, shape.global_batch_size, SEED)
    t0 = time.perf_counter()
    it = planner.steps_from(planner.initial_state())
    steps = [next(it)[0] for _ in range(max(1, rows // shape.global_batch_size))]
    ms = 1000 * (time.perf_counter() - t0) / (len(steps) * shape.global_batch_size)
    fill = float(np.mean([r.tokens for s in steps for r in s.rows])) / seq
    return fill, BalanceReport.of([placed_balance(s, shape) for s in steps]), ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 rows")
    ap.add_argument("--rows", type=int, default=8192, help="rows planned per configuration")
    ap.add_argument("--seq-length", type=int, default=8192)
    args = ap.parse_args()
    rows = 128 if args.quick else args.rows
    seq = args.seq_length
    # samples enough for `rows` rows (a row holds about seq / mean tokens of them), and then some
    tokens, tiles = llava_ov_mix(int(rows * seq / 1900) + 512, seed=SEED)
    print(f"mix: {len(tokens):,} samples, {int(tokens.sum()):,} tokens, {int(tiles.sum()):,} tiles; seq {seq}")
    head = f"{'layout':<24}{'fill today/ours':>18}{'balance today (worst)':>26}{'ours (worst)':>18}"
    print(f"{head}{'ms/row today/ours':>20}")
    last = None
    for dp in (2, 4, 8):
        for per_rank in (1, 4):
            shape = StepShape(dp, 1, dp * per_rank)
            t_fill, t_bal, t_ms = today(tokens, tiles, seq, shape)
            o_fill, o_bal, o_ms = ours(tokens, tiles, seq, shape, rows)
            print(
                f"{f'DP{dp}, {per_rank} row/rank':<24}{f'{t_fill:.4f}/{o_fill:.4f}':>18}"
                f"{f'{t_bal.mean:.3f} ({t_bal.worst:.3f})':>26}{f'{o_bal.mean:.3f} ({o_bal.worst:.3f})':>18}"
                f"{f'{t_ms:.3f}/{o_ms:.3f}':>20}"
            )
            last = (t_fill, o_fill, t_bal.mean, o_bal.mean) if (dp, per_rank) == (8, 1) else last
    t_fill, o_fill, t_bal, o_bal = last
    print(f"BENCH global_order_fill baseline={t_fill:.4f} ours={o_fill:.4f} unit=fill ratio={o_fill / t_fill:.3f}")
    print(f"BENCH global_order_balance baseline={t_bal:.3f} ours={o_bal:.3f} unit=max/mean ratio={t_bal / o_bal:.3f}")


if __name__ == "__main__":
    main()
