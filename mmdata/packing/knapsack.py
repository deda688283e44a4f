"""Largest-first knapsack: which samples share a packed row. The loader's online packer
(energon's `select_samples_to_pack` hook, via `energon_loaders.row_mix.pack_buffer`) and the
offline plan (algorithm.py) both choose rows with it. Pure Python, so planning needs no torch."""

from __future__ import annotations

from typing import Sequence


def _best_subset(lengths: Sequence[int], capacity: int) -> list[int]:
    """Indices of a subset of `lengths` with the largest sum <= capacity (subset-sum over a bitset:
    a Python int, whose shifts and ors are several times cheaper than numpy's on a few thousand bits)."""
    mask = (1 << (capacity + 1)) - 1
    top = 1 << capacity
    reach = 1
    history: list[int] = []
    for n in map(int, lengths):
        history.append(reach)
        if 0 < n <= capacity:
            reach |= (reach << n) & mask
        if reach & top:
            break
    s = reach.bit_length() - 1
    chosen: list[int] = []
    for i in range(len(history) - 1, -1, -1):
        if s == 0:
            break
        if not (history[i] >> s) & 1:  # s was unreachable without item i, so item i is in the subset
            chosen.append(i)
            s -= int(lengths[i])
    return chosen


def largest_first_knapsack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group indices into bins: open each bin with the largest remaining item, then fill the
    remaining room exactly as full as possible (subset-sum) from the rest.

    Fuller rows than first-fit-decreasing would give on LLaVA-OV mixes (many 1.5K-3K image samples, few
    short text ones): the waste concentrates in the last bin of each buffer. Deterministic.
    """
    n = [int(x) for x in lengths]
    remaining = sorted(range(len(n)), key=lambda i: (-n[i], i))
    bins: list[list[int]] = []
    while remaining:
        first = remaining.pop(0)
        room = capacity - n[first]
        picked: list[int] = []
        if room > 0:
            candidates = [i for i in remaining if n[i] <= room]
            picked = [candidates[j] for j in _best_subset([n[i] for i in candidates], room)]
        if picked:
            taken = set(picked)
            remaining = [i for i in remaining if i not in taken]
        bins.append(sorted([first, *picked]))
    return bins
