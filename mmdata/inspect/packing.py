"""Packing efficiency estimate on sampled sequence lengths, done the way the loader packs.

The loader collects `packing_buffer_size` samples (default 256, `DEFAULT_PACKING_BUFFER` in
`mmdata.energon_loaders.packing`) and packs each buffer with `pack_buffer` from
`mmdata.energon_loaders.row_mix` (its `select_samples_to_pack` hook: `largest_first_knapsack`,
then rows evened in vision tiles). Here the sampled lengths (and tiles, where known), in stream
order, are cut into buffers of the same size and packed with that same function, so the estimate
includes the partly filled last sequence of every buffer, as training sees it.
Samples longer than the context are counted as `over_length` and clipped to it (the loader
truncates their text, or drops them when an image would be cut).

Each estimate carries the packing report (`mmdata.packing.report`): bin fill and
executed-token efficiency, CP padding counted for the `cp`/`tp` asked for (`--cp`/`--tp`).

The length index counts image tokens with LLaVA-OV's own geometry (384-px tiles). A plan file
made for another geometry (a recipe's smaller tiles) counts other lengths: `length_index_packing`
compares a plan file beside the online packer and the offline plan only when it was counted with
the index's geometry; `plan_files` lists every `pack-plan-<N>.parquet` present, each labelled
with its own geometry.

`length_index_balance` simulates `--dp` data-parallel ranks training on the length index's
samples (online: each rank packing its own part of the stream; the plan: the global order) and
reports the vision balance per step, as the ranks draw their rows today and balanced
(`mmdata.packing.balance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq

from mmdata.packing.balance import StepShape, auto_window, simulate
from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER, packing_efficiency
from mmdata.packing.report import PackingReport, report_from_bins, report_from_rows
from mmdata.energon_loaders.row_mix import pack_buffer
from mmdata.packing.algorithm import plan_packing
from mmdata.packing.inputs import require_vision_tiles
from mmdata.packing.geometry import DEFAULT_GEOMETRY
from mmdata.packing.plan_file import PlanError, plan_path, read_plan_info
from mmdata.shard_job.lengths import LENGTHS_NAME, VISION_TILES

#: the loader's default packing buffer
PACKING_BUFFER = DEFAULT_PACKING_BUFFER


@dataclass
class PackingEstimate:
    context: int
    efficiency: float  # real tokens / slots
    sequences: int  # packed sequences needed
    over_length: int  # samples longer than the context (clipped)
    report: PackingReport  # bin fill and executed-token efficiency at the asked cp/tp


def estimate_packing(
    lengths: Sequence[int],
    context: int,
    buffer: int = PACKING_BUFFER,
    cp: int = 1,
    tp: int = 1,
    tiles: Sequence[int] | None = None,
) -> PackingEstimate:
    """The loader's packing of `lengths` (and their vision `tiles`, None: unknown, packed as
    without tiles) into rows of `context` tokens, `buffer` samples at a time."""
    kept = [i for i, n in enumerate(lengths) if int(n) > 0]
    clipped = [min(int(lengths[i]), context) for i in kept]
    kept_tiles = [int(tiles[i]) for i in kept] if tiles is not None else [0] * len(kept)
    packed: list[list[int]] = []
    for start in range(0, len(clipped), buffer):
        chunk = clipped[start : start + buffer]
        packed.extend([chunk[i] for i in b] for b in pack_buffer(chunk, kept_tiles[start : start + buffer], context))
    return PackingEstimate(
        context,
        packing_efficiency(packed, context),
        len(packed),
        sum(1 for n in lengths if int(n) > context),
        report_from_rows(packed, context, cp, tp),
    )


#: samples of the length index the online-vs-plan comparison uses (packing them costs ~1 s)
LENGTH_INDEX_SAMPLE = 8192


def plan_file_report(path: Path, cp: int = 1, tp: int = 1) -> PackingReport:
    """The packing report of a `pack-plan-<N>.parquet` file at `cp`/`tp`, from its `bin` and
    `tokens` columns (whatever CP size the plan was made for)."""
    info = read_plan_info(path)
    table = pq.read_table(path, columns=["bin", "tokens"])
    return report_from_bins(
        table.column("bin").to_numpy(),
        table.column("tokens").to_numpy(),
        info["seq_length"],
        num_rows=info["bins"],
        cp=cp,
        tp=tp,
    )


def length_index_packing(
    root: Path, context_lengths: Sequence[int], cp: int = 1, tp: int = 1, plans: dict | None = None
) -> dict | None:
    """The offline plan's efficiency against the online packer's, on the same samples: the
    first LENGTH_INDEX_SAMPLE rows of `lengths.parquet` (stream order: the shards are already
    shuffled); plus the efficiency of any `pack-plan-<N>.parquet` file (over the whole
    dataset). Beside each efficiency, `bin_fill` and `executed_token_efficiency` of the same
    three at `cp`/`tp`. None when the folder has no length index of `mmdata preprocess`. `plans`
    (a dict) receives the plan made per context length, for `length_index_balance`."""
    path = Path(root) / LENGTHS_NAME
    if not path.is_file():
        return None
    names = pq.read_schema(path).names
    if "total_tokens" not in names:  # token shards' index: lengths per Emu3 task
        return None
    require_vision_tiles(path, names)
    table = pq.read_table(path, columns=["total_tokens", VISION_TILES])
    lengths = table.column("total_tokens").to_numpy()
    used = lengths[:LENGTH_INDEX_SAMPLE]
    used_tiles = table.column(VISION_TILES).to_numpy()[:LENGTH_INDEX_SAMPLE].tolist()
    out: dict = {
        "samples": int(len(lengths)),
        "compared": int(len(used)),
        "text_tokens": (pq.read_schema(path).metadata or {}).get(b"mmdata.text_tokens", b"").decode(),
        "cp": cp,
        "tp": tp,
        "packing": {},
    }
    for c in context_lengths:
        plan_file = plan_path(Path(root), c)
        # a plan counted with another geometry has other lengths: listed in plan_files, not compared here
        same = plan_file.is_file() and _index_geometry(plan_file)
        online = estimate_packing(used.tolist(), c, cp=cp, tp=tp, tiles=used_tiles) if len(used) else None
        plan = plan_packing(used, c) if len(used) else None
        if plans is not None:
            plans[c] = plan
        reports = {
            "online": None if online is None else online.report,
            "plan": plan.report(cp, tp) if plan is not None else None,
            "plan_file": plan_file_report(plan_file, cp, tp) if same else None,
        }
        out["packing"][str(c)] = {
            "online": None if online is None else round(online.efficiency, 4),
            "plan": None if reports["plan"] is None else round(reports["plan"].bin_fill, 4),
            "plan_file": read_plan_info(plan_file)["efficiency"] if same else None,
            **{
                key: {side: None if r is None else round(getattr(r, key), 4) for side, r in reports.items()}
                for key in ("bin_fill", "executed_token_efficiency")
            },
        }
    return out


def _index_geometry(path: Path) -> bool:
    """Whether a plan file counted its samples with the length index's geometry."""
    try:
        return read_plan_info(path).get("geometry") == DEFAULT_GEOMETRY.as_dict()
    except PlanError:
        return False


def plan_files(root: Path, cp: int = 1, tp: int = 1) -> list[dict]:
    """Every `pack-plan-<N>.parquet` in `root`, by sequence length: its geometry (and whether it
    is the length index's), whether its text lengths are estimates, samples, sequences, and its
    bin fill and executed-token efficiency at `cp`/`tp`; a plan of another format has `error`."""
    out: list[dict] = []
    found = [(p, p.stem.removeprefix("pack-plan-")) for p in Path(root).glob("pack-plan-*.parquet")]
    for path, _ in sorted(found, key=lambda x: (not x[1].isdigit(), int(x[1]) if x[1].isdigit() else 0, x[1])):
        try:
            info = read_plan_info(path)
        except PlanError as err:
            out.append({"file": path.name, "error": str(err)})
            continue
        report = plan_file_report(path, cp, tp)
        geometry = info.get("geometry") or {}
        out.append(
            {
                "file": path.name,
                "seq_length": info["seq_length"],
                "geometry": geometry,
                "index_geometry": geometry == DEFAULT_GEOMETRY.as_dict(),
                "lengths_estimated": bool(info.get("lengths_estimated")),
                "samples": info.get("samples"),
                "sequences": info["bins"],
                "seed": info.get("seed"),
                "balanced": "balance" in info,
                "bin_fill": round(report.bin_fill, 4),
                "executed_token_efficiency": round(report.executed_token_efficiency, 4),
            }
        )
    return out


def online_rank_rows(
    lengths: Sequence[int], tiles: Sequence[int], context: int, dp: int, buffer: int = PACKING_BUFFER
) -> list[list[tuple[int, int]]]:
    """Each of `dp` ranks' packed rows as (tokens, tiles), in stream order: rank r reads the r-th
    contiguous part of the samples (energon gives each DP rank its own slices of the shards,
    already shuffled) and packs it as the loader does (`pack_buffer`), `buffer` samples at a time.
    Each rank's rows are in the order its buffers yield them: with fewer than a few buffers per
    rank, the ranks' buffers start on the same step (a long run's drift apart)."""
    n = len(lengths)
    out = []
    for r in range(dp):
        part = range(r * n // dp, (r + 1) * n // dp)
        clipped = [min(int(lengths[i]), context) for i in part]
        part_tiles = [int(tiles[i]) for i in part]
        rows: list[tuple[int, int]] = []
        for start in range(0, len(clipped), buffer):
            chunk, chunk_tiles = clipped[start : start + buffer], part_tiles[start : start + buffer]
            rows += [
                (sum(chunk[i] for i in b), sum(chunk_tiles[i] for i in b))
                for b in pack_buffer(chunk, chunk_tiles, context)
            ]
        out.append(rows)
    return out


def length_index_balance(
    root: Path, context_lengths: Sequence[int], shape: StepShape, tile_tokens: float, plans: dict | None = None
) -> dict | None:
    """`vision_balance` (max / mean vision work per DP rank per step, mean over steps and the
    worst step) of the online packer and of the offline plan at `shape`, today and balanced
    (packing/balance.py; online also over windows of `auto_window` steps, `windowed`), on
    the length index's first LENGTH_INDEX_SAMPLE samples (the plans `length_index_packing` made of
    them, when given). None without a length index."""
    path = Path(root) / LENGTHS_NAME
    if not path.is_file():
        return None
    names = pq.read_schema(path).names
    if "total_tokens" not in names:  # token shards' index: no vision tower encodes them
        return None
    require_vision_tiles(path, names)
    window = auto_window(shape.rows_per_rank)
    head = {**shape.as_dict(), "tile_tokens": tile_tokens, "window": window}
    table = pq.read_table(path, columns=["total_tokens", VISION_TILES])
    lengths = table.column("total_tokens").to_numpy()[:LENGTH_INDEX_SAMPLE].astype(np.int64)
    tiles = table.column(VISION_TILES).to_numpy()[:LENGTH_INDEX_SAMPLE].astype(np.int64)
    out: dict = {**head, "compared": int(len(lengths)), "packing": {}}
    for c in context_lengths:
        online = simulate(online_rank_rows(lengths, tiles, c, shape.dp), shape, tile_tokens, window)
        plan = (plans or {}).get(c) or plan_packing(lengths, c)
        out["packing"][str(c)] = {
            "online": {k: v.as_dict() for k, v in online.items()},
            "plan": {
                "today": plan.vision_balance(tiles, shape, tile_tokens, balanced=False).as_dict(),
                "balanced": plan.balanced(tiles, shape, tile_tokens, seed=0)
                .vision_balance(tiles, shape, tile_tokens, balanced=True)
                .as_dict(),
            },
        }
    return out
