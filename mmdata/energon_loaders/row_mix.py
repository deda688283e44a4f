"""Rows of even vision work: the online packer (`pack_buffer`, energon's `select_samples_to_pack`).

`largest_first_knapsack` fills each row of a packing buffer to `capacity` tokens by length only, so
one row holds three 5-tile images and the next four 2-tile ones and a caption: rows of equal tokens
differ 1.5x and more in the tiles (and video frames) the vision tower encodes for them. At one row
per DP rank per step nothing can be moved between ranks afterwards, so the rank drawing the row with
most tiles sets the step's time.

`even_vision_rows` takes the knapsack's rows and exchanges samples between rows of the same buffer
until every row's tiles are near the buffer's mean. Every exchange keeps each row within `capacity`
and no row empties, so the rows keep their number and bin fill is exactly the knapsack's. Two moves,
each taken only when it strictly lowers the sum of squared row tiles (so the pass ends):

1. the best move of one sample to another row, or swap of two samples, over the whole buffer
   (vectorised: the buffer's samples against its samples and rows);
2. when no such move is left, a re-split of two rows (one above the mean, most tiles first, with one
   below it, fewest tiles first): of every split of their samples with tiles (at
   most `RESPLIT_MAX_TILED` of them), the most even one whose samples without tiles still fit, laid
   into the roomier row largest first. Then 1. again.

Family-free: it sees (tokens, tiles) per sample; a buffer without tiles (Emu3, text) keeps the
knapsack's rows. Deterministic in the buffer (ties go to the lowest index), so a restored loader
re-packs a buffer exactly as before. What it cannot do: a sample with more tiles than the mean row
(a 25-tile image of 7.4K tokens in an 8K row against a mean of 13) keeps its row above the mean;
samples are never split.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from mmdata.packing.knapsack import largest_first_knapsack

#: samples with tiles two rows may hold together to be re-split (2^n splits are tried)
RESPLIT_MAX_TILED = 12


def pack_buffer(lengths: Sequence[int], tiles: Sequence[int], capacity: int) -> list[list[int]]:
    """The online packer: rows as full as `largest_first_knapsack` fills them, with even vision
    work (`even_vision_rows`). Indices into the buffer per row, rows in the knapsack's order."""
    return even_vision_rows(largest_first_knapsack(lengths, capacity), lengths, tiles, capacity)


def even_vision_rows(
    bins: Sequence[Sequence[int]], lengths: Sequence[int], tiles: Sequence[int], capacity: int
) -> list[list[int]]:
    """`bins` (each within `capacity` tokens) with samples exchanged between them until their tiles
    are as even as single moves, swaps and pair re-splits make them; same number of bins, none over
    `capacity`, none empty. Bins without any tiles are returned as they are."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1)
    if len(bins) < 2 or not t.any():
        return [list(b) for b in bins]
    rows = _Rows(bins, np.asarray(lengths, dtype=np.int64).reshape(-1), t, int(capacity))
    budget = 4 * len(t)  # moves at most: a bound on the cost, far above what a buffer needs
    while budget > 0:
        budget -= rows.swap_until_stuck(budget)
        if budget <= 0 or not rows.resplit_one():
            break
        budget -= 1
    return rows.bins()


class _Rows:
    """The buffer's rows: which row holds each sample, each row's tokens and tiles."""

    def __init__(self, bins: Sequence[Sequence[int]], n: np.ndarray, t: np.ndarray, capacity: int) -> None:
        self.n, self.t, self.capacity = n, t, capacity
        self.count = len(bins)
        self.row = np.empty(len(n), dtype=np.int64)
        for r, b in enumerate(bins):
            self.row[list(b)] = r
        self.tokens = np.bincount(self.row, weights=n, minlength=self.count).astype(np.int64)
        self.tiles = np.bincount(self.row, weights=t, minlength=self.count).astype(np.int64)
        self.version = np.zeros(self.count, dtype=np.int64)  # bumped when a row changes
        self.failed: set[tuple[int, int, int, int]] = set()  # (row, version, row, version) re-splits that cannot help
        # exchange sample i with sample j, or with row j - len(n)'s empty slot (a move): only pairs
        # where tiles leave i's row can lower the spread (the heavier row gives)
        n_j = np.concatenate([n, np.zeros(self.count, dtype=np.int64)])
        t_j = np.concatenate([t, np.zeros(self.count, dtype=np.int64)])
        self.ii, self.jj = np.nonzero(t[:, None] > t_j[None, :])
        self.moved, self.tokens_moved = t[self.ii] - t_j[self.jj], n[self.ii] - n_j[self.jj]

    def bins(self) -> list[list[int]]:
        """Samples per row, by index."""
        order = np.argsort(self.row, kind="stable")
        return [part.tolist() for part in np.split(order, np.cumsum(np.bincount(self.row, minlength=self.count))[:-1])]

    def _changed(self, *rows: int) -> None:
        for r in rows:
            m = self.row == r
            self.tokens[r], self.tiles[r] = int(self.n[m].sum()), int(self.t[m].sum())
            self.version[r] += 1

    def swap_until_stuck(self, budget: int) -> int:
        """Apply the best single move or swap while one lowers the sum of squared row tiles;
        returns the number applied (at most `budget`)."""
        ii, jj, moved, tokens_moved, c, size = (
            self.ii,
            self.jj,
            self.moved,
            self.tokens_moved,
            self.capacity,
            len(self.n),
        )
        is_move, slots = jj >= size, np.arange(self.count)
        done = 0
        while done < budget:
            a, b = self.row[ii], np.concatenate([self.row, slots])[jj]
            gap = self.tiles[a] - self.tiles[b]
            ok = (moved < gap) & (self.tokens[a] - tokens_moved <= c) & (self.tokens[b] + tokens_moved <= c)
            ok &= ~is_move | (np.bincount(self.row, minlength=self.count) > 1)[a]  # a move never empties a row
            if not ok.any():
                break
            k = int(np.argmax(np.where(ok, moved * (gap - moved), -1)))  # half the drop of the sum of squares
            self.row[ii[k]] = b[k]
            if jj[k] < size:
                self.row[jj[k]] = a[k]
            self._changed(int(a[k]), int(b[k]))
            done += 1
        return done

    def resplit_one(self) -> bool:
        """Re-split the first pair of rows (above-mean rows by falling tiles, each with the
        below-mean rows by rising tiles) whose best split is more even than they are."""
        mean = float(self.tiles.mean())
        order = np.lexsort((np.arange(self.count), self.tiles))  # fewest tiles first, ties by index
        partners = [int(r) for r in order if self.tiles[r] < mean]
        members = self.bins()
        for a in (int(r) for r in order[::-1] if self.tiles[r] > mean):
            for b in partners:
                gap = int(self.tiles[a] - self.tiles[b])
                if gap <= 1:
                    break
                key = (a, int(self.version[a]), b, int(self.version[b]))
                if key in self.failed:
                    continue
                split = _best_split(members[a] + members[b], self.n, self.t, self.capacity, gap)
                if split is None:
                    self.failed.add(key)
                    continue
                self.row[split[0]], self.row[split[1]] = a, b
                self._changed(a, b)
                return True
        return False


@lru_cache(maxsize=RESPLIT_MAX_TILED + 1)
def _subsets(k: int) -> np.ndarray:
    """[2^k, k] 0/1: row m is the subset of bit pattern m."""
    return ((np.arange(1 << k)[:, None] >> np.arange(k)[None, :]) & 1).astype(np.int64)


def _best_split(
    samples: list[int], n: np.ndarray, t: np.ndarray, capacity: int, gap: int
) -> tuple[list[int], list[int]] | None:
    """The two rows `samples` can make, each within `capacity` and not empty, whose tiles differ
    least and by less than `gap` (heavier row first); None if there is none."""
    tiled = [i for i in samples if t[i] > 0]
    if len(tiled) > RESPLIT_MAX_TILED:
        return None
    fillers = sorted((i for i in samples if t[i] == 0), key=lambda i: (-int(n[i]), i))
    filler_tokens = int(n[fillers].sum())
    subsets = _subsets(len(tiled))
    tokens, tiles = subsets @ n[tiled], subsets @ t[tiled]
    total_tokens, total_tiles = int(n[tiled].sum()), int(t[tiled].sum())
    diff = 2 * tiles - total_tiles  # the heavier side is the subset: diff >= 0
    ok = (diff >= 0) & (diff < gap) & (tokens <= capacity) & (total_tokens - tokens <= capacity)
    ok &= 2 * capacity - total_tokens >= filler_tokens
    for m in (int(m) for m in np.flatnonzero(ok)[np.argsort(diff[ok], kind="stable")]):
        placed = _lay_fillers(fillers, n, capacity - int(tokens[m]), capacity - total_tokens + int(tokens[m]))
        if placed is None:
            continue
        heavy = [i for i, bit in zip(tiled, subsets[m]) if bit] + placed[0]
        light = [i for i, bit in zip(tiled, subsets[m]) if not bit] + placed[1]
        if heavy and light:
            return heavy, light
    return None


def _lay_fillers(fillers: list[int], n: np.ndarray, room_a: int, room_b: int) -> tuple[list[int], list[int]] | None:
    """Samples without tiles (largest first) each into the roomier of two rows; None if one does not fit."""
    a: list[int] = []
    b: list[int] = []
    for i in fillers:
        size = int(n[i])
        if room_a >= room_b and size <= room_a:
            a.append(i)
            room_a -= size
        elif size <= room_b:
            b.append(i)
            room_b -= size
        else:
            return None
    return a, b
