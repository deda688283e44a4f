"""Vision-aware balancing: spread a training step's packed rows over the data-parallel ranks and
over the micro-batches of each rank by their cost, language tokens plus vision-tower work.

A row's cost is `tokens + tile_tokens * tiles` in language-token equivalents: `tiles` counts the
tiles and video frames the vision tower encodes for the row (1 + grid per anyres image, 1 per
image of a multi-image sample, 1 per sampled frame), `tile_tokens` is the tower's FLOPs per tile
over the decoder's FLOPs per token (mmtrain's cost model gives it for a recipe,
`mmtrain.models.flops.tile_token_cost`; `DEFAULT_TILE_TOKENS` is SigLIP-so400m/384 under Qwen2.5-1.5B, the
Aquila-VL-2B pair). Rows are packed full, so their tokens hardly differ; what differs 10x between
rows is their tiles, and the vision tower's share of a rank's step time with them.

`assign_step` is the one balancing decision: longest-processing-time first (rows by falling cost,
each to the least loaded rank that still has room, then within the rank to its least loaded
micro-batch), deterministic, every rank and micro-batch keeping its number of rows. The offline
plan (`mmdata pack-plan --dp ...`, followed by `plan_packing`) and the train loop's online
exchange (`mmtrain.runtime.row_exchange`) both call it, and `mmdata inspect` / `pack-plan`
simulate with it. Balancing only moves whole rows: what a sample contributes to the loss does
not change.

The figure reported everywhere (`vision_balance`): max / mean vision work over the DP ranks of a
step, the vision work of a rank being its tiles (all tiles cost the same FLOPs, so the ratio of
FLOPs is the ratio of tiles); `BalanceReport` takes the mean over steps and the worst step.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: FLOPs of one 384-px tile through SigLIP-so400m + the mlp2x projector over the FLOPs of one token
#: through the Qwen2.5-1.5B decoder and its LM head (Aquila-VL-2B; tests/test_vision_balance.py
#: checks it against mmtrain's cost model)
DEFAULT_TILE_TOKENS = 210.0


@dataclass(frozen=True)
class StepShape:
    """How a global batch is cut: `dp` ranks, each `global_batch_size / dp` rows in micro-batches
    of `micro_batch_size` rows."""

    dp: int
    micro_batch_size: int
    global_batch_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of dp x micro_batch_size "
                f"= {self.dp} x {self.micro_batch_size}"
            )

    @property
    def rows_per_rank(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per step."""
        return self.rows_per_rank // self.micro_batch_size

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size}

    def describe(self) -> str:
        return f"DP{self.dp}, micro-batch {self.micro_batch_size}, global batch {self.global_batch_size}"


def row_costs(tokens: Any, tiles: Any, tile_tokens: float) -> np.ndarray:
    """`tokens + tile_tokens * tiles` per row (float64)."""
    return np.asarray(tokens, dtype=np.float64) + float(tile_tokens) * np.asarray(tiles, dtype=np.float64)


#: (source rank, its row index) of a row: where a rank drew it
RowRef = tuple[int, int]


def assign_step(costs: Sequence[Sequence[float]], micro_rows: Sequence[Sequence[int]]) -> list[list[list[RowRef]]]:
    """Balance one step: `costs[r][k]` is the cost of the k-th row rank `r` drew (its micro-batches'
    rows in order), `micro_rows[r]` the row counts of rank r's micro-batches (they add up to
    `len(costs[r])`). Returns, per rank and micro-batch, the rows it trains, as (source rank,
    source row), in that order; every rank and micro-batch keeps its row count.

    Longest-processing-time first: rows by falling cost (ties: by source) go to the least loaded
    rank with room (ties: the row's own rank, then the lowest), then within each rank the same over
    its micro-batches. Pure and deterministic in its inputs, so ranks that see the same costs
    agree without talking."""
    _check_shapes(costs, micro_rows)
    return _place([(float(c), r, k) for r, cs in enumerate(costs) for k, c in enumerate(cs)], micro_rows)


def _check_shapes(costs: Sequence[Sequence[float]], micro_rows: Sequence[Sequence[int]]) -> None:
    if len(costs) != len(micro_rows):
        raise ValueError(f"{len(costs)} ranks of costs but {len(micro_rows)} of micro-batch sizes")
    for r, (c, m) in enumerate(zip(costs, micro_rows)):
        if sum(m) != len(c):
            raise ValueError(f"rank {r}: {len(c)} rows but micro-batches of {list(m)} rows")


def _by_falling_cost(rows: Sequence[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    """(cost, source rank, source row) by falling cost, ties by source: one order on every rank."""
    return sorted(rows, key=lambda x: (-x[0], x[1], x[2]))


def _place(rows: list[tuple[float, int, int]], micro_rows: Sequence[Sequence[int]]) -> list[list[list[RowRef]]]:
    """`assign_step` over `rows` as (cost, source rank, source row), rank d taking `sum(micro_rows[d])`."""
    rows = _by_falling_cost(rows)
    room = [sum(m) for m in micro_rows]
    load = [0.0] * len(room)
    version = [0] * len(room)  # a rank's heap entry is current while its version matches
    heap = [(0.0, d, 0) for d in range(len(room)) if room[d] > 0]
    taken: list[list[tuple[float, int, int]]] = [[] for _ in room]
    for cost, r, k in rows:
        while heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        least, d, _ = heap[0]
        if room[r] > 0 and load[r] == least:  # the row's own rank is among the least loaded: it stays
            d = r
        taken[d].append((cost, r, k))
        load[d] += cost
        room[d] -= 1
        version[d] += 1
        if room[d] > 0:
            heapq.heappush(heap, (load[d], d, version[d]))
    return [_spread(mine, micro_rows[d]) for d, mine in enumerate(taken)]


#: rows per rank a look-ahead window holds with `data.balance_window: auto` (steps = this / rows per rank)
AUTO_WINDOW_ROWS = 8


def auto_window(rows_per_rank: int) -> int:
    """Steps balanced together by default: enough that each rank holds about `AUTO_WINDOW_ROWS`
    rows (8 steps at one row per rank per step, 1 from 8 rows per rank, where one step's rows suffice)."""
    return max(1, AUTO_WINDOW_ROWS // max(1, int(rows_per_rank)))


def assign_window(
    costs: Sequence[Sequence[float]], micro_rows: Sequence[Sequence[Sequence[int]]]
) -> list[list[list[list[RowRef]]]]:
    """Balance a window of steps drawn together: `micro_rows[s][r]` is the row counts of rank r's
    micro-batches in step s, `costs[r]` the costs of every row rank r drew in the window (step by
    step, in order). Returns, per step, rank and micro-batch, the rows it trains as (source rank,
    source row); every step, rank and micro-batch keeps its row count.

    At one row per rank per step a step's rows cannot be evened by moving them between ranks;
    across steps they can. The window's rows, by falling cost, are cut into tiers of one row per
    rank, and the tiers dealt to the steps in turn (step s takes tiers s, s + W, ...), so each
    step holds rows of about one cost per tier; `assign_step`'s placement then gives each rank one
    row of each tier. The steps' order is then shuffled, seeded by the costs (the same on every
    rank and on a resumed run), so a window does not always run from heavy to light. One step
    (W = 1) is exactly `assign_step`; steps of different shapes are each balanced on their own."""
    steps = len(micro_rows)
    if steps == 0:
        return []
    dp = len(costs)
    for s, step in enumerate(micro_rows):
        if len(step) != dp:
            raise ValueError(f"{dp} ranks of costs but step {s} has micro-batch sizes for {len(step)}")
    per_step = [[sum(m) for m in step] for step in micro_rows]
    starts = np.cumsum([[0] * dp] + per_step, axis=0)  # [s, r]: rank r's first row of step s
    for r in range(dp):
        if starts[-1][r] != len(costs[r]):
            raise ValueError(f"rank {r}: {len(costs[r])} rows but the window's micro-batches hold {starts[-1][r]}")
    if steps == 1 or any(step != micro_rows[0] for step in micro_rows):
        return [
            _place(
                [(float(costs[r][k]), r, k) for r in range(dp) for k in range(starts[s][r], starts[s + 1][r])],
                micro_rows[s],
            )
            for s in range(steps)
        ]
    rows = _by_falling_cost([(float(c), r, k) for r, cs in enumerate(costs) for k, c in enumerate(cs)])
    size = sum(per_step[0])
    dealt: list[list[tuple[float, int, int]]] = [[] for _ in range(steps)]
    turn = 0
    for t in range(0, len(rows), dp):
        for row in rows[t : t + dp]:
            while len(dealt[turn % steps]) >= size:
                turn += 1
            dealt[turn % steps].append(row)
        turn += 1
    seed = zlib.crc32(np.asarray([c for c, _, _ in rows], dtype=np.float64).tobytes())
    order = np.random.default_rng(seed).permutation(steps)
    return [_place(dealt[int(i)], micro_rows[s]) for s, i in enumerate(order)]


def _spread(rows: list[tuple[float, int, int]], micro_rows: Sequence[int]) -> list[list[RowRef]]:
    """A rank's rows (by falling cost) over its micro-batches, least loaded first; each micro-batch
    lists its rows by source."""
    room = list(micro_rows)
    load = [0.0] * len(room)
    out: list[list[RowRef]] = [[] for _ in room]
    for cost, r, k in rows:
        m = min((j for j in range(len(room)) if room[j] > 0), key=lambda j: (load[j], j))
        out[m].append((r, k))
        load[m] += cost
        room[m] -= 1
    return [sorted(refs) for refs in out]


def vision_balance(work: Sequence[float]) -> float | None:
    """max / mean of the ranks' vision work (None when no rank has any)."""
    a = np.asarray(work, dtype=np.float64)
    mean = float(a.mean()) if a.size else 0.0
    return float(a.max()) / mean if mean > 0 else None


@dataclass(frozen=True)
class BalanceReport:
    """`vision_balance` over the steps of a run (steps without vision work are left out)."""

    steps: int
    mean: float | None  # mean over steps of max/mean vision work per rank
    worst: float | None  # the worst step's

    @classmethod
    def of(cls, ratios: Sequence[float | None]) -> BalanceReport:
        r = [x for x in ratios if x is not None]
        return cls(len(r), float(np.mean(r)) if r else None, float(np.max(r)) if r else None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "mean": None if self.mean is None else round(self.mean, 4),
            "worst": None if self.worst is None else round(self.worst, 4),
        }

    def line(self) -> str:
        if self.mean is None:
            return "no vision work"
        return f"{self.mean:.3f} (worst step {self.worst:.3f}, {self.steps} steps)"


def step_balance(
    tiles: Sequence[Sequence[int]], assignment: Sequence[Sequence[Sequence[RowRef]]] | None = None
) -> float | None:
    """`vision_balance` of one step whose rank r drew rows with `tiles[r]`, trained as drawn
    (`assignment` None) or as `assign_step` placed them."""
    if assignment is None:
        return vision_balance([sum(t) for t in tiles])
    return vision_balance([sum(tiles[r][k] for micro in rank for r, k in micro) for rank in assignment])


def simulate(
    rank_rows: Sequence[Sequence[tuple[int, int]]], shape: StepShape, tile_tokens: float, window: int = 1
) -> dict[str, BalanceReport]:
    """`vision_balance` of the full steps the ranks' row streams make, as drawn (`today`), balanced
    step by step by `assign_step` (`balanced`) and, with `window` > 1, `window` steps at a time by
    `assign_window` (`windowed`; the full windows' steps): `rank_rows[r]` is rank r's rows in
    stream order as (tokens, tiles), each step taking `shape.rows_per_rank` of them from every rank."""
    if len(rank_rows) != shape.dp:
        raise ValueError(f"{len(rank_rows)} rank streams for dp {shape.dp}")
    k = shape.rows_per_rank
    steps = min((len(s) for s in rank_rows), default=0) // k
    micro = [[shape.micro_batch_size] * shape.micro_batches] * shape.dp
    tiles = [[v for _, v in s[: steps * k]] for s in rank_rows]
    costs = [row_costs([n for n, _ in s[: steps * k]], t, tile_tokens) for s, t in zip(rank_rows, tiles)]

    def cut(first: int, last: int) -> tuple[list, list]:
        """Every rank's tiles and costs of the steps [first, last)."""
        return [t[first * k : last * k] for t in tiles], [c[first * k : last * k] for c in costs]

    today, balanced, windowed = [], [], []
    for t in range(steps):
        step_tiles, step_costs = cut(t, t + 1)
        today.append(step_balance(step_tiles))
        balanced.append(step_balance(step_tiles, assign_step(step_costs, micro)))
    out = {"today": BalanceReport.of(today), "balanced": BalanceReport.of(balanced)}
    if window > 1:
        for t in range(0, steps - window + 1, window):
            window_tiles, window_costs = cut(t, t + window)
            windowed += [step_balance(window_tiles, step) for step in assign_window(window_costs, [micro] * window)]
        out["windowed"] = BalanceReport.of(windowed)
    return out


# ----------------------------------------------------------------------------- balanced plans


def assign_block(costs: Sequence[float], shape: StepShape) -> list[list[list[int]]]:
    """One step of a balanced plan: its `global_batch_size` sequences (`costs` in stream order;
    position j is the one the plain contract gives rank `j % dp` as its row `j // dp`) placed by
    `assign_step`. Per rank and micro-batch, the block positions it trains."""
    d = shape.dp
    if len(costs) != shape.global_batch_size:
        raise ValueError(f"a step of {len(costs)} sequences for global batch size {shape.global_batch_size}")
    per_rank = [list(costs[r::d]) for r in range(d)]
    placed = assign_step(per_rank, [[shape.micro_batch_size] * shape.micro_batches] * d)
    return [[[k * d + r for r, k in micro] for micro in rank] for rank in placed]


def tiered_order(costs: np.ndarray, dp: int, rng: np.random.Generator) -> np.ndarray:
    """The order of a balanced plan's sequences (positions into `costs`): sorted by falling cost
    (ties at random) and cut into tiers of `dp` sequences of about the same cost; the full tiers
    follow each other in a random order, the one short tier (the cheapest) ends the order. A step
    of `global_batch_size` sequences is then `global_batch_size / dp` whole tiers."""
    costs = np.asarray(costs, dtype=np.float64)
    order = np.lexsort((rng.permutation(len(costs)), -costs))
    full = len(costs) // dp
    tiers = order[: full * dp].reshape(full, dp)[rng.permutation(full)].reshape(-1)
    return np.concatenate([tiers, order[full * dp :]]).astype(np.int64)


def shuffle_tiers(n: int, dp: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of a tiered order's `n` positions that moves whole tiers (the full tiers
    of `dp` positions among themselves; the short one stays last): a later epoch of a balanced
    plan, new steps made of the same tiers."""
    full = n // dp
    moved = np.arange(full * dp, dtype=np.int64).reshape(full, dp)[rng.permutation(full)].reshape(-1)
    return np.concatenate([moved, np.arange(full * dp, n, dtype=np.int64)])


def plan_balance(
    seq_tokens: np.ndarray, seq_tiles: np.ndarray, shape: StepShape, tile_tokens: float, balanced: bool
) -> BalanceReport:
    """`vision_balance` over the full steps of a plan's first epoch (sequences in plan order, with
    their tokens and tiles): as the plain contract deals them (rank r takes the step's sequences
    r, r + dp, ...) or, `balanced`, as `assign_block` places them."""
    g, d = shape.global_batch_size, shape.dp
    steps = len(seq_tiles) // g
    tiles = np.asarray(seq_tiles[: steps * g], dtype=np.float64).reshape(steps, g)
    if not balanced:
        return BalanceReport.of([vision_balance(t) for t in tiles.reshape(steps, g // d, d).sum(axis=1)])
    costs = row_costs(seq_tokens[: steps * g], seq_tiles[: steps * g], tile_tokens).reshape(steps, g)
    ratios = []
    for t in range(steps):
        placed = assign_block(costs[t].tolist(), shape)
        ratios.append(vision_balance([sum(tiles[t, j] for micro in rank for j in micro) for rank in placed]))
    return BalanceReport.of(ratios)
