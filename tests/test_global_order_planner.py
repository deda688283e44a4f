"""The global order's planner (mmdata/global_order/planner.py): steps as a pure function of the
lengths, the blend, the seed and the global batch, resumable from a layout-free document."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmdata.global_order import OrderSource, OrderState, StepPlanner, placement
from mmdata.packing.balance import StepShape

pytestmark = pytest.mark.unit


def _source(name: str, n: int, seed: int) -> OrderSource:
    rng = np.random.default_rng(seed)
    return OrderSource.from_arrays(name, rng.integers(100, 3000, n), rng.integers(0, 6, n))


def _sets(steps) -> list[list[tuple[int, ...]]]:
    return [[r.members for r in s.rows] for s in steps]


def test_smoke_window_is_deterministic_and_resumes_from_its_document():
    sources = [_source("a", 300, 0), _source("b", 200, 1)]
    planner = StepPlanner(sources, None, 4096, 4, seed=3)
    it = planner.steps_from(planner.initial_state())
    run = [next(it) for _ in range(40)]
    again = StepPlanner(sources, None, 4096, 4, seed=3).steps_from(planner.initial_state())
    assert _sets(s for s, _ in run) == _sets(next(again)[0] for _ in range(40))
    assert all(len(s.rows) == 4 and [r.cost for r in s.rows] for s, _ in run)
    step, start = run[23]
    doc = json.loads(json.dumps(planner.document(start, step.step)))
    resumed = planner.resume(doc)
    assert _sets(next(resumed)[0] for _ in range(17)) == _sets(s for s, _ in run[23:])
    assert OrderState.from_dict(doc["window_start"]) == start
    placed = placement(run[0][0], StepShape(2, 1, 4))
    assert sorted(i for rank in placed for mb in rank for i in mb) == [0, 1, 2, 3]
