"""Packing efficiency estimate on sampled sequence lengths, done the way the loader packs.

The loader collects `packing_buffer_size` samples (default 256, `DEFAULT_PACKING_BUFFER` in
`mmdata.energon_loaders.packing`) and packs each buffer with `largest_first_knapsack` from
`mmdata.energon_loaders.packing` (its `select_samples_to_pack` hook). Here the sampled lengths,
in stream order, are cut into buffers of the same size and packed with that same function, so
the estimate includes the partly filled last sequence of every buffer, as training sees it.
Samples longer than the context are counted as `over_length` and clipped to it (the loader
truncates their text, or drops them when an image would be cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER, largest_first_knapsack, packing_efficiency

#: the loader's default packing buffer
PACKING_BUFFER = DEFAULT_PACKING_BUFFER


@dataclass
class PackingEstimate:
    context: int
    efficiency: float  # real tokens / slots
    sequences: int  # packed sequences needed
    over_length: int  # samples longer than the context (clipped)


def estimate_packing(lengths: Sequence[int], context: int, buffer: int = PACKING_BUFFER) -> PackingEstimate:
    clipped = [min(int(n), context) for n in lengths if int(n) > 0]
    packed: list[list[int]] = []
    for start in range(0, len(clipped), buffer):
        chunk = clipped[start : start + buffer]
        packed.extend([chunk[i] for i in b] for b in largest_first_knapsack(chunk, context))
    return PackingEstimate(context, packing_efficiency(packed, context), len(packed),
                           sum(1 for n in lengths if int(n) > context))


#: samples of the length index the online-vs-plan comparison uses (packing them costs ~1 s)
LENGTH_INDEX_SAMPLE = 8192


def length_index_packing(root: Path, context_lengths: Sequence[int]) -> dict | None:
    """The offline plan's efficiency against the online packer's, on the same samples: the
    first LENGTH_INDEX_SAMPLE rows of `lengths.parquet` (stream order: the shards are already
    shuffled); plus the efficiency of any `pack-plan-<N>.parquet` file (over the whole
    dataset). None when the folder has no length index."""
    from mmdata.preprocess.lengths import LENGTHS_NAME
    from mmdata.preprocess.pack_plan import plan_packing, plan_path, read_plan_info

    path = Path(root) / LENGTHS_NAME
    if not path.is_file():
        return None
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["total_tokens"])
    lengths = table.column("total_tokens").to_numpy()
    used = lengths[:LENGTH_INDEX_SAMPLE]
    out: dict = {"samples": int(len(lengths)), "compared": int(len(used)),
                 "text_tokens": (pq.read_schema(path).metadata or {}).get(b"mmdata.text_tokens", b"").decode(),
                 "packing": {}}
    for c in context_lengths:
        plan_file = plan_path(Path(root), c)
        out["packing"][str(c)] = {
            "online": round(estimate_packing(used.tolist(), c).efficiency, 4) if len(used) else None,
            "plan": round(plan_packing(used, c).efficiency, 4) if len(used) else None,
            "plan_file": read_plan_info(plan_file)["efficiency"] if plan_file.is_file() else None,
        }
    return out
