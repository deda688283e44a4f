"""Packing efficiency estimate on sampled sequence lengths, with the loader's own packer.

The loader packs each buffer of samples with `mmdata.energon_loaders.packing`'s
`largest_first_knapsack` (its `select_samples_to_pack` hook); here the same function packs the
sampled lengths as one buffer. Samples longer than the context are counted
as `over_length` and clipped to it (the loader truncates their text, or drops them when an
image would be cut). The final, partly filled sequence is counted, so with few samples the
estimate is a slight underestimate (by at most one sequence's worth of slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mmdata.energon_loaders.packing import largest_first_knapsack, packing_efficiency


@dataclass
class PackingEstimate:
    context: int
    efficiency: float  # real tokens / slots
    sequences: int  # packed sequences needed
    over_length: int  # samples longer than the context (clipped)


def estimate_packing(lengths: Sequence[int], context: int) -> PackingEstimate:
    clipped = [min(int(n), context) for n in lengths if int(n) > 0]
    bins = largest_first_knapsack(clipped, context)
    eff = packing_efficiency([[clipped[i] for i in b] for b in bins], context)
    return PackingEstimate(context, eff, len(bins), sum(1 for n in lengths if int(n) > context))
