"""`mmdata inspect`'s reads per rank in the global order (mmdata/inspect/global_reads.py): each DP
rank reads the bytes of the rows `placement` gives it, the ranks' add up to the step's (what every
rank reads with `replicated`), and the table prints them. Without a dataset (`unit`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.mixes import llava_ov_mix
from mmdata.global_order import OrderSource, StepPlanner, placement
from mmdata.inspect.global_reads import rank_bytes, reads_report
from mmdata.inspect.render import global_reads_table
from mmdata.packing.balance import StepShape

pytestmark = pytest.mark.unit


def test_each_rank_reads_its_placed_rows_and_the_ranks_read_the_step():
    tokens, tiles = llava_ov_mix(3000, 4)
    sizes = 20_000 + 150_000 * tiles + np.random.default_rng(1).integers(0, 5000, len(tiles))  # bytes grow with images
    source = dataclasses.replace(OrderSource.from_arrays("mix", tokens, tiles), sample_bytes=sizes)
    planner = StepPlanner([source], None, 8192, 16, seed=2)
    shape = StepShape(4, 2, 16)
    got = rank_bytes(planner, shape, steps=6)
    for planned, _ in planner.steps_from(planner.initial_state()):
        if planned.step >= 6:
            break
        placed = placement(planned, shape)
        for r in range(shape.dp):
            samples = [k for mb in placed[r] for i in mb for k in planned.rows[i].samples]
            assert got[planned.step, r] == sizes[samples].sum()
        assert got[planned.step].sum() == sizes[[k for row in planned.rows for k in row.samples]].sum()
    report = reads_report(got)
    assert report["step_bytes"] == pytest.approx(got.sum(axis=1).mean())
    assert report["rank_max"] == pytest.approx(got.max(axis=1).mean()) and report["rank_max"] >= report["rank_mean"]
    # by cost, which counts the tiles the bytes grow with: no rank reads far more than its quarter
    assert report["rank_share"] == pytest.approx(0.25) and report["rank_max"] < 1.5 * report["rank_mean"]


def test_the_table_prints_the_step_and_the_ranks():
    per_rank = np.asarray([[1024, 3072], [2048, 2048]])
    gr = {"dp": 2, "micro_batch_size": 1, "global_batch_size": 4, "packing": {"4096": reads_report(per_rank)}}
    title, headers, rows = global_reads_table(gr)
    assert "first 2 steps; DP2, micro-batch 1, global batch 4" in title and len(headers) == len(rows[0])
    assert rows == [["4,096", "4 KiB", "2 KiB", "2.5 KiB", "0.5"]]
