"""The global order's second row source (`data.sharding: global` with `data.packing: plan`,
mmdata/energon_loaders/plan_steps.py): step t is the plan's G sequences at stream positions
[tG, (t+1)G) whatever the layout; the placement over ranks and micro-batches covers each row of
a step once at DP 1..4 and micro-batch 1..2; a plan balanced for one step shape is followed at
any; the layout-free document resumes exactly, after a global batch change from the same
position; documents of another plan or of the online planner, and a plan shorter than a step,
are refused. Without reading."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig

from mmdata.energon_loaders.global_order import GlobalOrderDataset
from mmdata.energon_loaders.plan_packing import PlanError, PlanSequences
from mmdata.energon_loaders.plan_steps import PlanSteps
from mmdata.errors import UserError
from mmdata.global_order import OrderSource, StepPlanner
from mmdata.packing.balance import row_costs

pytestmark = pytest.mark.unit

G = 24  # divisible by every dp x micro-batch below


def _plan(sequences: int = 60, seed: int = 0, balanced_dp: int | None = None) -> PlanSequences:
    """A plan of `sequences` rows of 1-4 samples (shuffled global indices) with their costs."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, sequences)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    indices = rng.permutation(int(starts[-1])).astype(np.int32)
    tokens, tiles = rng.integers(500, 4096, sequences), rng.integers(0, 30, sequences)
    info = {"seq_length": 4096, "bins": sequences}
    if balanced_dp:
        info["balance"] = {"dp": balanced_dp, "micro_batch_size": 1, "global_batch_size": balanced_dp, "tile_tokens": 1}
    return PlanSequences(indices, starts, info, costs=row_costs(tokens, tiles, 210.0), tokens=tokens, tiles=tiles)


def _steps(plan: PlanSequences, **kw) -> PlanSteps:
    return PlanSteps(Path("shards"), Path("pack-plan.parquet"), plan, kw.pop("g", G), 7, np.arange(len(plan.indices)))


def _members(steps) -> list[list[tuple]]:
    return [[r.members for r in s.rows] for s in steps]


def test_each_step_is_the_plans_next_sequences_and_every_layout_places_them_once():
    plan = _plan(balanced_dp=2)  # balanced for DP 2: followed at every layout
    steps = _steps(plan)
    first = [s for _, (s, _) in zip(range(6), steps.resume(steps.document(0, 0)))]
    n = plan.num_sequences
    stream = [steps.stream.sequence(p) for p in range(3 * n)]
    epoch1 = stream[n : 2 * n]
    assert stream[:n] == list(range(n)) and sorted(epoch1) == list(range(n)) and epoch1 != stream[:n]
    # epoch 1 moves the plan's tiers (of its DP size) whole
    assert all(epoch1[2 * i] // 2 == epoch1[2 * i + 1] // 2 for i in range(n // 2))
    for t, planned in enumerate(first):
        want = [plan.sequence(b).tolist() for b in stream[t * G : (t + 1) * G]]
        assert [[int(plan.indices[p]) for _, p in r.members] for r in planned.rows] == want
        assert planned.units == (float(sum(len(w) for w in want)),)
    start = steps.document(0, 0)
    for dp in (1, 2, 3, 4):
        for micro in (1, 2):
            made: dict[int, list[int]] = defaultdict(list)
            for rank in range(dp):
                wc = WorkerConfig(rank=rank, world_size=dp, num_workers=0)
                ds = GlobalOrderDataset(
                    steps, None, start=start, micro_batch_size=micro, balance=True, worker_config=wc
                )
                for planned, _, rows in ds.micro_batches(0):
                    if planned.step >= len(first):
                        break
                    assert planned.rows == first[planned.step].rows  # the same rows at every layout
                    made[planned.step] += rows
            assert all(sorted(made[t]) == list(range(G)) for t in range(len(first))), (dp, micro)


def test_the_document_resumes_exactly_and_after_a_global_batch_change_from_the_same_position():
    plan = _plan(seed=1)
    steps = _steps(plan)
    run = list(zip(range(8), steps.resume(steps.document(0, 0))))
    for t in (0, 3, 5):
        _, (planned, position) = run[t]
        doc = steps.document(position, t)
        again = [s for _, (s, _) in zip(range(8 - t), _steps(plan).resume(doc))]
        assert _members(again) == _members([s for _, (s, _) in run[t:]])
    # at G 12 from step 3 of G 24: the next sequences of the stream, step numbers going on
    smaller = _steps(plan, g=12)
    later = [s for _, (s, _) in zip(range(4), smaller.resume(steps.document(run[3][1][1], 3)))]
    assert [s.step for s in later] == [3, 4, 5, 6]
    assert _members(later[:2]) == [m[:12] for m in _members([run[3][1][0]])] + [
        m[12:] for m in _members([run[3][1][0]])
    ]


def test_documents_of_another_plan_or_of_the_online_planner_are_refused():
    steps, other = _steps(_plan(seed=2)), _steps(_plan(seed=3))
    with pytest.raises(UserError, match="follows another packing plan"):
        next(steps.resume(other.document(0, 0)))
    planner = StepPlanner([OrderSource.from_arrays("a", np.full(100, 300))], None, 1024, 4)
    with pytest.raises(UserError, match="planned online"):
        next(steps.resume(planner.document(planner.initial_state(), 0)))
    with pytest.raises(UserError, match="follows a packing plan"):
        next(planner.resume(steps.document(0, 0)))
    with pytest.raises(PlanError, match="has 10 sequences, fewer than one step's 24"):
        _steps(_plan(sequences=10))
    with pytest.raises(UserError, match="damaged"):
        next(steps.resume({**steps.document(0, 0), "position": -1}))
