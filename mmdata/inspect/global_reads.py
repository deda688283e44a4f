"""What each DP rank would read per step in the global order (`data.sharding: global`), for
`mmdata inspect`: the planner's first READ_STEPS steps of the folder (from its length index, as
every rank plans them), each step's rows placed on `--dp` ranks as the loader places them
(`placement`, by cost), and the bytes of the samples each rank reads (their sizes in the tars,
energon's index), against `replicated`, where every rank reads the whole step."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq

from mmdata.errors import UserError
from mmdata.global_order import StepPlanner, load_source, placement
from mmdata.packing.balance import StepShape
from mmdata.shard_job.lengths import LENGTHS_NAME

READ_STEPS = 8  # steps planned per context length (cheap: a window or two of the planner)


def rank_bytes(planner: StepPlanner, shape: StepShape, steps: int = READ_STEPS) -> np.ndarray:
    """(steps x dp) bytes each rank reads in the planner's first `steps` steps."""
    out = np.zeros((steps, shape.dp), dtype=np.int64)
    for planned, _ in planner.steps_from(planner.initial_state()):
        if planned.step >= steps:
            break
        row_bytes = [sum(planner.sample_at(m)[4] for m in row.members) for row in planned.rows]
        for r, micros in enumerate(placement(planned, shape)):
            out[planned.step, r] = sum(row_bytes[i] for micro in micros for i in micro)
    return out


def reads_report(per_rank: np.ndarray) -> dict:
    """Means over steps: the step's bytes (what each rank reads with `replicated`), a rank's mean
    and the most any rank reads, and the share of the step a rank reads (about 1 / DP)."""
    step = per_rank.sum(axis=1)
    return {
        "steps": int(len(per_rank)),
        "step_bytes": float(step.mean()),
        "rank_mean": float(per_rank.mean()),
        "rank_max": float(per_rank.max(axis=1).mean()),
        "rank_share": float(per_rank.mean() / step.mean()) if step.mean() else None,
    }


def global_order_reads(root: Path, context_lengths: Sequence[int], shape: StepShape, tile_tokens: float) -> dict | None:
    """`reads_report` per context length for the folder at `shape`; None without a length index
    of an image folder or an energon index (token shards: Emu3's variants need its recipe)."""
    path = Path(root) / LENGTHS_NAME
    if not path.is_file() or "total_tokens" not in pq.read_schema(path).names:
        return None
    try:
        source = load_source(root)
    except UserError:  # no energon index (a bare tar folder): no sizes to report
        return None
    out: dict = {**shape.as_dict(), "packing": {}}
    for c in context_lengths:
        planner = StepPlanner([source], None, c, shape.global_batch_size, tile_tokens=tile_tokens)
        out["packing"][str(c)] = reads_report(rank_bytes(planner, shape))
    return out
