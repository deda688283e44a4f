"""The plan file, `DIR/pack-plan-<N>.parquet` (docs/preprocess.md, "Packing plan"): one row per
sample in plan order, `bin` (the sequence's number, 0..bins-1 in plan order), `index` (the
sample's global index; its shard key is `f"{index:010d}"`), `tokens` (its length), plus per-sample
columns of the plan's inputs (`tiles`; an Emu3 plan's `key` and `variant`). The schema metadata
`mmdata.pack_plan` holds the settings and the checks a loader needs (`format`, `seq_length`,
`seed`, `bins`, `lengths_sha256`, `geometry`, `packing_report`, a balanced plan's `balance`, ...).
A plan of another `format` is refused: rerun pack-plan.

One plan per sequence length: the name holds only that, so a loader finds its plan from the
recipe's `train.seq_length` alone. A second pack-plan at the same length replaces the first and
says which settings differed (`replaced_settings`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata.errors import UserError
from mmdata.packing.algorithm import PackPlan

PLAN_FORMAT = 2  # 2: every plan records its geometry
META_KEY = b"mmdata.pack_plan"


class PlanError(UserError):
    """A plan that this data or loader cannot follow (missing, stale, other sequence length)."""


def plan_path(root: Path, seq_length: int) -> Path:
    return root / f"pack-plan-{seq_length}.parquet"


#: the plan settings a user chooses, compared when a new plan replaces an old one
SETTINGS = ("geometry", "seed", "balance", "lengths_estimated", "lengths_sha256")


def replaced_settings(path: Path, new: dict) -> list[str] | None:
    """What differs between the plan at `path` and a new one with metadata `new` (the settings
    in SETTINGS, as "key old → new"); None when there is no plan there. An unreadable old plan
    (another format) reads as one difference."""
    if not path.is_file():
        return None
    try:
        old = json.loads(pq.read_schema(path).metadata[META_KEY])
    except (KeyError, TypeError, ValueError, OSError, pa.ArrowException):
        return ["an unreadable plan"]
    if old.get("format") != PLAN_FORMAT:
        return [f"format {old.get('format')} → {PLAN_FORMAT}"]
    out: list[str] = []
    for key in SETTINGS:
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "lengths_sha256":
            out.append("the length index (rerun preprocess)")
        elif isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k} {a.get(k)} → {b.get(k)}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
        else:
            out.append(f"{key} {_short(a)} → {_short(b)}")
    return out


def _short(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {v}" for k, v in value.items()) + ")"
    return str(value)


def write_plan(
    root: Path, plan: PackPlan, index: np.ndarray, seed: int, meta: dict, columns: dict | None = None
) -> Path:
    """The plan file; `columns` (per planned sample, aligned with `index`: numpy or pyarrow
    arrays) are written beside bin, index and tokens (the samples' vision `tiles`; an Emu3
    plan's `key` and `variant`)."""
    sizes = np.array([len(b) for b in plan.bins], dtype=np.int64)
    pos = np.concatenate(plan.bins) if plan.bins else np.zeros(0, dtype=np.int64)
    info = {
        "format": PLAN_FORMAT,
        "seq_length": plan.seq_length,
        "seed": seed,
        "bins": len(plan.bins),
        "samples": int(len(pos)),
        "tokens": int(plan.lengths.sum()),
        "efficiency": round(plan.efficiency, 6),
        "over_length": plan.over_length,
        **meta,
    }
    extra = {
        name: col.take(pa.array(pos)) if isinstance(col, (pa.Array, pa.ChunkedArray)) else col[pos]
        for name, col in (columns or {}).items()
    }
    table = pa.table(
        {
            "bin": np.repeat(np.arange(len(sizes), dtype=np.int64), sizes),
            "index": index[pos],
            "tokens": plan.lengths[pos].astype(np.int32),
            **extra,
        }
    )
    table = table.replace_schema_metadata({META_KEY: json.dumps(info, sort_keys=True)})
    out = plan_path(root, plan.seq_length)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(out)
    return out


def read_plan_info(path: Path) -> dict:
    """A plan file's metadata; PlanError for a plan of another format."""
    info = json.loads(pq.read_schema(path).metadata[META_KEY])
    if info.get("format") != PLAN_FORMAT:
        raise PlanError(
            f"packing plan {path} has format {info.get('format')}, this mmdata reads format "
            f"{PLAN_FORMAT}: rerun `mmdata pack-plan` (or `mmtrain pack-plan RECIPE.yaml`) to rebuild it"
        )
    return info
