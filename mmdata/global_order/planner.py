"""The global order's steps: step t's rows as a pure function of the sources' lengths, the blend,
the seed, `seq_length` and `global_batch_size`, never of the DP size, micro-batch or workers.

The planner works a window of K steps at a time (cut short at a stepwise schedule's next point, so
a jump is not smeared over the window's steps; every rank and worker repeats it, from lengths
only, without talking):
1. the blend draws samples into the pool (samples drawn, not yet trained, oldest first) until it
   holds (1 + SLACK) x the window's tokens (without packing: the window's K x G samples);
2. the pool is packed by the offline plan's windowed knapsack (packing/algorithm.py);
3. the K x G rows filled best are taken (first the rows holding a sample drawn over MAX_WAIT x K
   steps before this window's start, i.e. from its fourth window of K steps on: while such rows
   fit the window it trains there; a batch or window decrease, or more of them than the window
   takes, delays it further, never drops it); the other rows' samples go back to the pool;
4. the rows, sorted by cost (balance.row_costs), are cut into K tiers of G rows, one per step, the
   steps in a seeded order: every step's rows cost about the same, so any placement over ranks
   (`placement`) is balanced.

Its state (`OrderState`) is a position in every source's stream, the draw's credits and the pool:
layout-free, JSON. A checkpoint stores the state at the start of the window and the next step;
resuming re-plans that window and skips the trained steps (`StepPlanner.resume`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mmdata.errors import UserError
from mmdata.global_order.blend import Blend, Draw
from mmdata.global_order.sources import OrderSource, Streams, check_names
from mmdata.packing.algorithm import windowed_knapsack
from mmdata.packing.balance import DEFAULT_TILE_TOKENS, StepShape, assign_block, row_costs, vision_balance

SLACK = 0.15  # the pool holds this much more than the window's rows need, so the best-filled are taken
MAX_WAIT = 2  # a row with a sample drawn over MAX_WAIT x K steps before the window start is taken first
AUTO_WINDOW_ROWS = 256  # window_steps "auto": about this many rows per window (fewer: steps of less even cost) ...
AUTO_WINDOW_STEPS = 32  # ... in at most this many steps (more: a blend's schedule followed more coarsely)
TIER_STREAM = 2  # the steps' order in a window: default_rng([seed, TIER_STREAM, window start])
DOC_VERSION = 1
AHEAD = 512  # stream positions looked up at once while drawing
WINDOWS_KEPT = 2  # windows a planner keeps planned (the one a loader trains and a save or restore looks into)


@dataclass
class OrderState:
    """Where the global order stands before step `step` (the start of a window): samples drawn so
    far per source, the draw's credits, and the pool as [source, position, window drawn in], oldest
    first. No DP size, micro-batch, worker or rank: any layout resumes from it."""

    step: int
    positions: list[int]
    credits: list[float]
    pool: list[list[int]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "positions": list(self.positions),
            "credits": list(self.credits),
            "pool": [list(m) for m in self.pool],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> OrderState:
        try:
            state = cls(
                int(doc["step"]),
                [int(p) for p in doc["positions"]],
                [float(c) for c in doc["credits"]],
                [[int(x) for x in m] for m in doc["pool"]],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"the global order's state is damaged ({e!r}): resume from another checkpoint") from None
        if len(state.positions) != len(state.credits) or any(len(m) != 3 for m in state.pool):
            raise UserError("the global order's state is damaged (sources disagree): resume from another checkpoint")
        return state


def initial_state(num_sources: int) -> OrderState:
    """The state of a fresh run: every stream at its start, no credit, an empty pool."""
    return OrderState(0, [0] * num_sources, [0.0] * num_sources, [])


@dataclass(frozen=True)
class PlannedRow:
    """One packed row: its samples as (source, stream position), their sample numbers in the
    sources' arrays, its tokens (each sample at most seq_length), tiles and balancing cost."""

    members: tuple[tuple[int, int], ...]
    samples: tuple[int, ...]
    tokens: int
    tiles: int
    cost: float


@dataclass(frozen=True)
class PlannedStep:
    """Step `step`'s exactly G rows (cost order) and the units (samples or tokens, as the blend
    counts them) each source gives it."""

    step: int
    rows: tuple[PlannedRow, ...]
    units: tuple[float, ...]

    @property
    def costs(self) -> list[float]:
        return [r.cost for r in self.rows]

    def members(self) -> list[tuple[int, int]]:
        return [m for r in self.rows for m in r.members]


def placement(step: PlannedStep, shape: StepShape, balance: bool = True) -> list[list[list[int]]]:
    """Per rank and micro-batch, the row numbers of `step` it trains: `assign_block` of the rows'
    costs when `balance`, else rank r takes rows r, r + dp, ... in micro-batches. The only part
    of the order that depends on the layout."""
    if len(step.rows) != shape.global_batch_size:
        raise ValueError(f"a step of {len(step.rows)} rows for global batch size {shape.global_batch_size}")
    if balance:
        return assign_block(step.costs, shape)
    m = shape.micro_batch_size
    mine = [list(range(r, shape.global_batch_size, shape.dp)) for r in range(shape.dp)]
    return [[rows[i : i + m] for i in range(0, len(rows), m)] for rows in mine]


def placed_balance(step: PlannedStep, shape: StepShape, balance: bool = True) -> float | None:
    """`vision_balance` of `step` as `placement` puts it on `shape`'s ranks (max / mean tiles)."""
    placed = placement(step, shape, balance)
    return vision_balance([sum(step.rows[i].tiles for micro in rank for i in micro) for rank in placed])


def checkpoint_doc(
    window_start: OrderState, step: int, global_batch_size: int, window_steps: int, tile_tokens: float, blend: Blend
) -> dict[str, Any]:
    """The loader's layout-free checkpoint: the state at the start of the window holding `step`
    (the next step to train), the step, and what cut the window into steps (a resume with other
    values re-plans it as it was: `StepPlanner.resume`)."""
    return {
        "version": DOC_VERSION,
        "window_start": window_start.to_dict(),
        "step": int(step),
        "global_batch_size": int(global_batch_size),
        "window_steps": int(window_steps),
        "tile_tokens": float(tile_tokens),
        "blend": blend.to_doc(),
    }


def read_checkpoint_doc(doc: dict[str, Any]) -> tuple[OrderState, int]:
    """(window-start state, next step) of a checkpoint document, checked."""
    if isinstance(doc, dict) and "plan" in doc:
        raise UserError(
            "the loader checkpoint follows a packing plan (data.packing: plan): resume with the same packing"
        )
    if not isinstance(doc, dict) or doc.get("version") != DOC_VERSION:
        got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise UserError(f"the loader checkpoint is no global-order document of version {DOC_VERSION} (got {got!r})")
    state = OrderState.from_dict(doc.get("window_start"))
    step = doc.get("step")
    if not isinstance(step, int) or step < state.step:
        raise UserError(f"the loader checkpoint's step {step!r} is before its window's start {state.step}")
    return state, step


class StepPlanner:
    """Plans the global order's steps (see the module docstring)."""

    def __init__(
        self,
        sources: Sequence[OrderSource],
        blend: Blend | None,
        seq_length: int,
        global_batch_size: int,
        seed: int = 0,
        tile_tokens: float = DEFAULT_TILE_TOKENS,
        window_steps: int | Literal["auto"] = "auto",
        packing: bool = True,
    ) -> None:
        self.sources = list(sources)
        check_names(self.sources)
        names = [s.name for s in self.sources]
        self.blend = blend if blend is not None else Blend.parse(None, names)
        if list(self.blend.names) != names:
            raise UserError(f"the blend names sources {list(self.blend.names)}, the data has {names}")
        if seq_length <= 0 or global_batch_size <= 0:
            raise UserError(f"seq_length {seq_length} and global_batch_size {global_batch_size} must be positive")
        if window_steps == "auto":
            window_steps = min(AUTO_WINDOW_STEPS, max(1, math.ceil(AUTO_WINDOW_ROWS / global_batch_size)))
        if not isinstance(window_steps, int) or window_steps < 1:
            raise UserError(f"data.order_window must be a whole number >= 1 or auto, got {window_steps!r}")
        self.seq_length, self.global_batch_size, self.seed = seq_length, global_batch_size, seed
        self.tile_tokens, self.window_steps, self.packing = float(tile_tokens), window_steps, packing
        self.streams = Streams(self.sources, seed)
        self._tokens_unit = self.blend.unit == "tokens"
        self._windows: dict[tuple, tuple[list[PlannedStep], OrderState]] = {}  # by window-start state

    def initial_state(self) -> OrderState:
        return initial_state(len(self.sources))

    @property
    def roots(self) -> list[Path]:
        """The sources' shard folders, in source order (a loader's readers)."""
        return [s.root for s in self.sources]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def sample_of(self, source: int, position: int) -> int:
        """The sample number (into the source's arrays) at a stream position."""
        return self.streams.sample(source, position)

    def sample_at(self, member: Sequence[int]) -> tuple[int, int, str, int | None, int]:
        """What a loader reads for a planned row's (source, stream position) member: (source,
        global index in its shards, key, planned variant, bytes in its tar)."""
        s = int(member[0])
        k, source = self.sample_of(s, int(member[1])), self.sources[s]
        variant = self.streams.variant(s, int(member[1]))  # Emu3: drawn in the position's epoch
        return s, int(source.index[k]), source.key(k), variant, int(source.sample_bytes[k])

    def rows_per_epoch(self) -> int:
        """Rows of one epoch of every source (about: each source packed on its own)."""
        if not self.packing:
            return sum(len(source) for source in self.sources)
        s = self.seq_length  # (Emu3: its lengths are the mean over the variants)
        return sum(-(-int(np.minimum(source.lengths, s).sum()) // s) for source in self.sources)

    # ------------------------------------------------------------------ one window

    def window(self, state: OrderState) -> tuple[list[PlannedStep], OrderState]:
        """The K steps from `state` (a window start) and the state after them: planned once per
        start state (the last WINDOWS_KEPT kept), so a loader's restore, its saves and its own
        iteration inside one window plan it once. Callers must not change what it returns."""
        key = (state.step, tuple(state.positions), tuple(state.credits), tuple(tuple(m) for m in state.pool))
        if key not in self._windows:
            self._windows[key] = self._plan_window(state)
            while len(self._windows) > WINDOWS_KEPT:
                del self._windows[next(iter(self._windows))]
        return self._windows[key]

    def window_length(self, start: int) -> int:
        """Steps of the window starting at `start`: K, cut short at the next point of a stepwise
        schedule, so that no window's cost tiers move samples across a jump. A pure function of
        (start, blend, K): the same at every layout and on resume."""
        if self.blend.ramp != "step":
            return self.window_steps
        after = [p.step for p in self.blend.points if p.step > start]
        return min(self.window_steps, after[0] - start) if after else self.window_steps

    def _plan_window(self, state: OrderState) -> tuple[list[PlannedStep], OrderState]:
        g, start = self.global_batch_size, state.step
        k = self.window_length(start)
        if len(state.positions) != len(self.sources):
            raise UserError(f"the order's state has {len(state.positions)} sources, the data {len(self.sources)}")
        if any(not 0 <= m[0] < len(self.sources) for m in state.pool):
            raise UserError("the order's state names a source the data does not have: resume with the same data.paths")
        positions, pool = list(state.positions), [list(m) for m in state.pool]
        draw = Draw(state.credits, self.blend.shares_at(start))
        need = k * g * (self.seq_length * (1 + SLACK) if self.packing else 1)
        per_step = g * (self.seq_length if self.packing else 1)
        src, pos, born, samples, clipped = self._pool_arrays(pool)
        held = float(np.maximum(clipped, 1).sum()) if self.packing else float(len(pool))
        drawn = 0.0
        while True:
            if held < need:
                new, added = self._draw(draw, positions, start, k, need - held, drawn, per_step)
                pool += new
                src, pos, born, samples, clipped = self._pool_arrays(pool)
                held, drawn = held + added, drawn + added
            rows, rest = self._rows(clipped, born, start)
            if len(rows) >= k * g:
                break
            need = held * (1 + SLACK)  # too few rows (a pool of long samples): draw more
        taken = rows[: k * g]
        keep = np.sort(np.concatenate([rest, *rows[k * g :]])).astype(np.int64)
        tiles = self._tiles(src, samples)
        steps = self._tiers(taken, src, pos, samples, clipped, tiles, start)
        nxt = OrderState(start + k, positions, list(draw.credits), [pool[int(i)] for i in keep])
        return steps, nxt

    def _pool_arrays(self, pool: list[list[int]]) -> tuple[np.ndarray, ...]:
        """The pool's sources, positions, windows drawn in, sample numbers and clipped lengths."""
        a = np.asarray(pool, dtype=np.int64).reshape(-1, 3)
        src, pos, born = a[:, 0], a[:, 1], a[:, 2]
        samples = np.empty(len(a), dtype=np.int64)
        clipped = np.empty(len(a), dtype=np.int64)
        for s in np.unique(src):
            m = src == s
            samples[m] = self.streams.samples(int(s), pos[m])
            clipped[m] = np.minimum(self.streams.lengths(int(s), pos[m]), self.seq_length)
        return src, pos, born, samples, clipped

    def _tiles(self, src: np.ndarray, samples: np.ndarray) -> np.ndarray:
        tiles = np.zeros(len(src), dtype=np.int64)
        for s in np.unique(src):
            m = src == s
            tiles[m] = self.sources[s].tiles[samples[m]]
        return tiles

    def _draw(
        self, draw: Draw, positions: list[int], start: int, k: int, want: float, drawn: float, per_step: float
    ) -> tuple[list[list[int]], float]:
        """Samples drawn by the blend until `want` units of the pool (tokens, or samples without
        packing) are added, and the units added; the shares are those of the step the draw fills."""
        ahead: dict[int, tuple[int, list[int]]] = {}

        def length(s: int, p: int) -> int:
            first, block = ahead.get(s, (0, []))
            if not first <= p < first + len(block):
                first = p
                block = np.minimum(self.streams.lengths(s, np.arange(p, p + AHEAD)), self.seq_length).tolist()
                ahead[s] = (first, block)
            return block[p - first]

        out: list[list[int]] = []
        got, step = 0.0, -1
        while got < want:
            j = min(k - 1, int((drawn + got) // per_step))
            if j != step:
                draw.set_shares(self.blend.shares_at(start + j))
            step = j
            s = draw.choose()
            p = positions[s]
            positions[s] = p + 1
            n = length(s, p)
            draw.charge(s, n if self._tokens_unit else 1.0)
            out.append([s, p, start])
            got += max(n, 1) if self.packing else 1  # (an empty sample still takes a draw: the loop ends)
        return out, got

    def _rows(self, clipped: np.ndarray, born: np.ndarray, start: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The pool's rows, the ones to take first first, and the pool positions no row holds."""
        if not self.packing:
            return [np.asarray([i]) for i in range(len(clipped))], np.zeros(0, dtype=np.int64)
        bins, carried = windowed_knapsack(np.arange(len(clipped)), clipped, self.seq_length)
        if not bins:
            return [], carried
        fill = np.asarray([int(clipped[b].sum()) for b in bins])
        oldest = np.asarray([int(b[0]) for b in bins])  # bins are sorted: their first is the oldest
        waited = np.asarray([int(born[b].min()) for b in bins]) < start - MAX_WAIT * self.window_steps
        order = np.lexsort((oldest, np.where(waited, oldest, -fill), ~waited))
        return [bins[i] for i in order], carried

    def _tiers(
        self,
        rows: list[np.ndarray],
        src: np.ndarray,
        pos: np.ndarray,
        samples: np.ndarray,
        clipped: np.ndarray,
        tiles: np.ndarray,
        start: int,
    ) -> list[PlannedStep]:
        """The window's rows cut by cost into its steps of G rows, in a seeded order."""
        g = self.global_batch_size
        k = len(rows) // g
        tokens = np.asarray([int(clipped[b].sum()) for b in rows])
        row_tiles = np.asarray([int(tiles[b].sum()) for b in rows])
        costs = row_costs(tokens, row_tiles, self.tile_tokens)
        oldest = np.asarray([int(b.min()) for b in rows])
        order = np.lexsort((oldest, -costs)).reshape(k, g)
        which = np.random.default_rng([self.seed, TIER_STREAM, start]).permutation(k)
        units = (clipped if self._tokens_unit else np.ones(len(clipped))).astype(np.float64)
        steps = []
        for j in range(k):
            picked = order[which[j]]
            out = []
            for i in picked:
                b = rows[int(i)]
                members = tuple((int(src[x]), int(pos[x])) for x in b)
                out.append(
                    PlannedRow(
                        members, tuple(int(samples[x]) for x in b), int(tokens[i]), int(row_tiles[i]), float(costs[i])
                    )
                )
            flat = np.concatenate([rows[int(i)] for i in picked])
            per_source = np.bincount(src[flat], weights=units[flat], minlength=len(self.sources))
            steps.append(PlannedStep(start + j, tuple(out), tuple(float(u) for u in per_source)))
        return steps

    # ------------------------------------------------------------------ many windows, resume

    def steps_from(self, state: OrderState) -> Iterator[tuple[PlannedStep, OrderState]]:
        """Every step from the window start `state` on, each with the state of its window's start."""
        while True:
            steps, nxt = self.window(state)
            for st in steps:
                yield st, state
            state = nxt

    def state_at(self, state: OrderState, steps_done: int) -> OrderState:
        """The start state of the window holding step `state.step + steps_done`."""
        target = state.step + steps_done
        while target >= state.step + self.window_length(state.step):
            state = self.window(state)[1]
        return state

    def document(self, window_start: OrderState, step: int) -> dict[str, Any]:
        """`checkpoint_doc` with this planner's batch, window, tile cost and blend."""
        return checkpoint_doc(
            window_start, step, self.global_batch_size, self.window_steps, self.tile_tokens, self.blend
        )

    def resume(self, doc: dict[str, Any]) -> Iterator[tuple[PlannedStep, OrderState]]:
        """`steps_from` at a checkpoint document's next step: its window re-planned, the trained
        steps skipped. A document made with another global batch size, window, `tile_tokens`
        (which sorts the window's rows into steps) or blend continues from the same position: its
        window is re-planned as it was, and the samples of its untrained steps go back to the pool
        (`carried_state`), from which this planner's windows start."""
        state, step = read_checkpoint_doc(doc)
        maker = self._maker(doc)
        if maker is not None:
            yield from self.steps_from(maker.carried_state(state, step))
            return
        state = self.state_at(state, step - state.step)
        for st, start in self.steps_from(state):
            if st.step >= step:
                yield st, start

    def _maker(self, doc: dict[str, Any]) -> StepPlanner | None:
        """The planner that made `doc` where it is not this one's twin, else None (a document
        without `tile_tokens` or `blend`, older than them, was made with this planner's)."""
        made = (doc.get("global_batch_size"), doc.get("window_steps"))
        tiles = doc.get("tile_tokens", self.tile_tokens)
        blend = Blend.parse(doc["blend"], self.names) if "blend" in doc else self.blend
        if made == (self.global_batch_size, self.window_steps) and tiles == self.tile_tokens and blend == self.blend:
            return None
        if not all(isinstance(x, int) and x > 0 for x in made):
            raise UserError(
                f"the loader checkpoint names no valid global batch size and window ({made}): resume from another"
            )
        if isinstance(tiles, bool) or not isinstance(tiles, int | float) or not tiles >= 0:
            raise UserError(f"the loader checkpoint names no valid tile_tokens ({tiles!r}): resume from another")
        return StepPlanner(
            self.sources, blend, self.seq_length, made[0], self.seed, float(tiles), made[1], self.packing
        )

    def carried_state(self, state: OrderState, step: int) -> OrderState:
        """A window-start state at `step` (inside a window of this planner that `state` starts or
        precedes): the steps before it trained, every sample of the window's later steps back in
        the pool (oldest first: by the window drawn in, then source and position)."""
        state = self.state_at(state, step - state.step)
        steps, nxt = self.window(state)
        born = {(m[0], m[1]): m[2] for m in state.pool}
        back = [[a, p, born.get((a, p), state.step)] for st in steps if st.step >= step for a, p in st.members()]
        pool = sorted(back + [list(m) for m in nxt.pool], key=lambda m: (m[2], m[0], m[1]))
        return OrderState(step, nxt.positions, nxt.credits, pool)
