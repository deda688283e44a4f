"""The packing plan: a deterministic global plan from per-sample lengths, so a loader can pack
exactly and reproducibly, independent of any buffer size.

The plan walks the samples in a seeded random order, a window of 256 (the loader's packing
buffer) at a time, and packs each window with the loader's own `largest_first_knapsack` (open a
sequence with the largest sample, fill the rest as full as possible by subset-sum). Unlike the
online packer, which must emit every sequence of its buffer, the plan carries the samples of
sequences filled below 99.5 % into the next window (at most half a window of them), where they
meet new partners; only the very end of the data is emitted as it is. On the synthetic mix that
lifts the efficiency from about 98.6 % (online) to over 99.5 % at 8K (tests/test_pack_plan.py).
Samples longer than N go alone into a sequence (`over_length`; the loader truncates their text
or drops them). The result is a pure function of (lengths, N, seed). The global order's planner
(mmdata/global_order/planner.py) packs its pool of drawn samples with the same `windowed_knapsack`:
the plan is that computation done ahead for a whole epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from mmdata.packing.balance import BalanceReport, StepShape, plan_balance, row_costs, tiered_order
from mmdata.packing.report import PackingReport, report_from_bins
from mmdata.packing.knapsack import largest_first_knapsack

WINDOW = 256  # the loader's packing buffer (energon_loaders.packing.DEFAULT_PACKING_BUFFER)
CARRY_BELOW = 0.995  # sequences filled less than this go back into the next window ...
MAX_CARRY = WINDOW // 2  # ... up to this many samples
CHUNK = 1 << 20  # samples planned independently (in parallel); about a minute of CPU each
BALANCE_STREAM = 1  # the balanced order's random stream: default_rng([seed, BALANCE_STREAM])


@dataclass
class PackPlan:
    """A plan's sequences: each a list of positions in `lengths` (see the module docstring)."""

    seq_length: int
    bins: list[np.ndarray]  # per sequence (plan order): sample positions in the lengths array
    lengths: np.ndarray  # the lengths the plan was made from

    def sequence_sums(self, per_sample: np.ndarray, clip: bool = False) -> np.ndarray:
        """Per sequence (plan order), the sum of a per-sample array (`clip`: lengths as packed, at
        most seq_length)."""
        values = (np.minimum(per_sample, self.seq_length) if clip else np.asarray(per_sample)).astype(np.int64)
        if not self.bins:
            return np.zeros(0, dtype=np.int64)
        starts = np.cumsum([0] + [len(b) for b in self.bins[:-1]])
        return np.add.reduceat(values[np.concatenate(self.bins)], starts)  # (bins are never empty)

    def balanced(self, tiles: np.ndarray, shape: StepShape, tile_tokens: float, seed: int) -> PackPlan:
        """The same sequences in the order of vision-aware balancing for `shape` (balance.tiered_order:
        steps of whole tiers of equal-cost sequences), seeded apart from the samples' order."""
        costs = row_costs(self.sequence_sums(self.lengths, clip=True), self.sequence_sums(tiles), tile_tokens)
        order = tiered_order(costs, shape.dp, np.random.default_rng([seed, BALANCE_STREAM]))
        return PackPlan(self.seq_length, [self.bins[i] for i in order], self.lengths)

    def vision_balance(self, tiles: np.ndarray, shape: StepShape, tile_tokens: float, balanced: bool) -> BalanceReport:
        """`balance.plan_balance` of this plan's order: dealt as the plain contract deals it, or
        placed per step as a balanced plan's loader places it."""
        return plan_balance(
            self.sequence_sums(self.lengths, clip=True), self.sequence_sums(tiles), shape, tile_tokens, balanced
        )

    @property
    def over_length(self) -> int:
        return int((self.lengths > self.seq_length).sum())

    @property
    def efficiency(self) -> float:
        """Real tokens (an over-length sample counts as N) over the slots of all sequences."""
        if not self.bins:
            return 0.0
        return float(np.minimum(self.lengths, self.seq_length).sum()) / (len(self.bins) * self.seq_length)

    def report(self, cp: int = 1, tp: int = 1) -> PackingReport:
        """Bin fill and executed-token efficiency of the plan's sequences as rows trained at
        context parallelism `cp` and tensor parallelism `tp` (packing/report.py)."""
        if not self.bins:
            return report_from_bins(np.zeros(0, np.int64), np.zeros(0, np.int64), self.seq_length, cp=cp, tp=tp)
        pos = np.concatenate(self.bins)
        rows = np.repeat(np.arange(len(self.bins), dtype=np.int64), [len(b) for b in self.bins])
        return report_from_bins(rows, self.lengths[pos], self.seq_length, num_rows=len(self.bins), cp=cp, tp=tp)


def windowed_knapsack(
    order: np.ndarray, clipped: np.ndarray, seq_length: int, flush: bool = True
) -> tuple[list[np.ndarray], np.ndarray]:
    """The windowed knapsack with carry-over, shared by the offline plan (`plan_packing`) and the
    global order's planner (mmdata/global_order/planner.py): `order` (positions into `clipped`,
    the lengths at most `seq_length`) packed WINDOW positions at a time by `largest_first_knapsack`,
    the samples of sequences filled below CARRY_BELOW carried into the next window (at most
    MAX_CARRY). Returns the sequences (each sorted) and the positions still carried after the last
    window: none when `flush` (the last window emits everything, as a plan's end does)."""
    bins: list[np.ndarray] = []
    pool = np.zeros(0, dtype=np.int64)
    for start in range(0, len(order), WINDOW):
        pool = np.concatenate([pool, order[start : start + WINDOW]])
        last = flush and start + WINDOW >= len(order)
        packed = [pool[np.asarray(b)] for b in largest_first_knapsack(clipped[pool].tolist(), seq_length)]
        fill = [int(clipped[b].sum()) for b in packed]
        carry: list[np.ndarray] = []
        carried = 0
        # the least filled sequences are carried first, while they fit the carry budget
        for j in sorted(range(len(packed)), key=lambda j: (fill[j], j)):
            b = packed[j]
            if not last and fill[j] < CARRY_BELOW * seq_length and carried + len(b) <= MAX_CARRY:
                carry.append(b)
                carried += len(b)
        kept = {id(b) for b in carry}
        bins.extend(np.sort(b) for b in packed if id(b) not in kept)
        pool = np.concatenate(carry) if carry else np.zeros(0, dtype=np.int64)
    return bins, pool


def _pack_chunk(order: np.ndarray, clipped: np.ndarray, seq_length: int) -> list[np.ndarray]:
    """The sequences of one chunk of the seeded order (windows with carry-over, flushed at its end)."""
    return windowed_knapsack(order, clipped, seq_length, flush=True)[0]


def plan_packing(
    lengths: np.ndarray, seq_length: int, seed: int = 0, jobs: int = 1, on_chunk: Callable[[int], None] | None = None
) -> PackPlan:
    """Windowed largest-first knapsack with carry-over (see the module docstring). The seeded
    order is cut into chunks of CHUNK samples packed independently (in `jobs` processes) and
    concatenated in order, so the plan does not depend on `jobs`. `on_chunk(total)` is called
    once per packed chunk (progress)."""
    if seq_length <= 0:
        raise ValueError("seq_length must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    clipped = np.minimum(lengths, seq_length)
    order = np.random.default_rng(seed).permutation(len(lengths))
    chunks = [order[i : i + CHUNK] for i in range(0, len(order), CHUNK)]
    if jobs > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(min(jobs, len(chunks))) as pool:
            parts = []
            for part in pool.map(_pack_chunk, chunks, [clipped] * len(chunks), [seq_length] * len(chunks)):
                parts.append(part)
                if on_chunk is not None:
                    on_chunk(len(chunks))
    else:
        parts = []
        for c in chunks:
            parts.append(_pack_chunk(c, clipped, seq_length))
            if on_chunk is not None:
                on_chunk(len(chunks))
    return PackPlan(seq_length, [b for part in parts for b in part], lengths)
