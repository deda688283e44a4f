"""Blends of the global order (mmdata/global_order/blend.py): shares over steps, stepwise or
linear, in samples or tokens; the realised shares follow the targets within 2% over 1,000 steps
of the tiny recipe's shape; a resume across a schedule boundary is exact; bad blends are refused
in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.mixes import llava_ov_mix
from mmdata.errors import UserError
from mmdata.global_order import Blend, BlendError, OrderSource, StepPlanner
from mmdata.global_order.planner import MAX_WAIT

pytestmark = pytest.mark.unit

NAMES = ("a", "b", "c")
TINY_SEQ, TINY_G = 2048, 2  # recipes/llava-ov-tiny.yaml: train.seq_length, train.global_batch_size
STEPS = 1000


def _sources() -> list[OrderSource]:
    out = []
    for i, name in enumerate(NAMES):
        tokens, tiles = llava_ov_mix(700 + 300 * i, seed=20 + i)
        out.append(OrderSource.from_arrays(name, tokens // (i + 1), tiles))  # the sources differ in length
    return out


def test_shares_at_follows_the_schedule():
    b = Blend.parse({"schedule": [{"step": 0, "weights": {"a": 3, "b": 1}}, {"step": 100, "weights": {"c": 1}}]}, NAMES)
    assert b.shares_at(0).tolist() == [0.75, 0.25, 0.0] == b.shares_at(99).tolist()
    assert b.shares_at(100).tolist() == [0.0, 0.0, 1.0] == b.shares_at(10**6).tolist()
    lin = Blend.parse(
        {"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 10, "weights": {"b": 1}}], "ramp": "linear"}, NAMES
    )
    assert lin.shares_at(5).tolist() == [0.5, 0.5, 0.0] and lin.shares_at(20).tolist() == [0.0, 1.0, 0.0]
    assert Blend.parse(None, NAMES).shares_at(7).tolist() == pytest.approx([1 / 3] * 3)
    assert Blend.parse({"weights": {"a": 1, "b": 1, "c": 2}}, NAMES).describe([0]) == [
        "step 0: a 25.0%, b 25.0%, c 50.0%"
    ]


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"weights": {"a": 1, "d": 1}}, "unknown source 'd'"),
        ({"weights": {"a": -1, "b": 1}}, "a weight must be a finite number >= 0"),
        ({"weights": {"a": float("nan")}}, "a weight must be a finite number >= 0"),
        ({"weights": {"a": 0, "b": 0}}, "all zero"),
        ({"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 0, "weights": {"b": 1}}]}, "strictly increasing"),
        ({"schedule": [{"step": 5, "weights": {"a": 1}}]}, "must be step 0"),
        ({"schedule": [{"step": -1, "weights": {"a": 1}}]}, "whole number >= 0"),
        ({"schedule": [{"step": 0, "weights": {"a": 1}}, {"weights": {"b": 1}}]}, r"schedule\[1\] has no step"),
        ({"weights": {"a": 1}, "mode": "x"}, "unknown key 'mode'"),
        ({"weights": {"a": 1}, "unit": "bytes"}, "unit 'bytes' is unknown"),
        ({"weights": {"a": 1}, "ramp": "cosine"}, "ramp 'cosine' is unknown"),
        ({"weights": {"a": 1}, "schedule": []}, "exactly one of"),
        ({"schedule": []}, "non-empty list"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_blends_are_refused_in_one_line(doc, match):
    with pytest.raises(BlendError, match=match) as e:
        Blend.parse(doc, NAMES)
    assert "\n" not in str(e.value) and isinstance(e.value, UserError)


def test_a_bad_weight_is_named_as_the_user_wrote_it():
    """The plain form's entries are `data.blend.weights`, a schedule's `data.blend.schedule[i].weights`."""
    with pytest.raises(BlendError) as e:
        Blend.parse({"weights": {"a": -1, "b": 1}}, NAMES)
    assert str(e.value).startswith("data.blend.weights['a'] = -1:") and "schedule" not in str(e.value)
    with pytest.raises(BlendError) as e:
        Blend.parse({"weights": {"d": 1}}, NAMES)
    assert str(e.value).startswith("data.blend.weights names unknown source 'd'")
    with pytest.raises(BlendError) as e:
        Blend.parse({"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 9, "weights": {"a": 0}}]}, NAMES)
    assert str(e.value).startswith("data.blend.schedule[1].weights are all zero")


def _realised(blend: Blend, steps: int = STEPS) -> tuple[StepPlanner, list]:
    planner = StepPlanner(_sources(), blend, TINY_SEQ, TINY_G, seed=5)
    it = planner.steps_from(planner.initial_state())
    return planner, [next(it) for _ in range(steps)]


@pytest.mark.parametrize(
    "doc",
    [
        {"schedule": [{"step": 0, "weights": {"a": 3, "b": 1}}, {"step": 500, "weights": {"a": 1, "b": 1, "c": 2}}]},
        {"schedule": [{"step": 0, "weights": {"a": 1, "c": 1}}, {"step": 1000, "weights": {"b": 1}}], "ramp": "linear"},
        {"weights": {"a": 1, "b": 2, "c": 1}, "unit": "tokens"},
        {"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 400, "weights": {"b": 1, "c": 3}}], "unit": "tokens"},
    ],
    ids=["stepwise", "linear", "tokens", "stepwise-tokens"],
)
def test_realised_shares_follow_the_targets_within_two_percent(doc):
    """Over 1,000 steps of the tiny recipe's shape (G 2 at 2K tokens): the units each source trained
    (samples or tokens, as the blend counts) against the target shares of each step times that
    step's units, within 2 percentage points over the run and over each quarter of it, but for
    the quarters within MAX_WAIT + 1 windows after a stepwise boundary (samples drawn before it
    may wait in the pool that long: a lag, not a loss, the run's total holds it)."""
    blend = Blend.parse(doc, NAMES)
    planner, run = _realised(blend)
    units = np.asarray([s.units for s, _ in run])
    targets = np.asarray([blend.shares_at(s.step) for s, _ in run]) * units.sum(axis=1, keepdims=True)
    lag = (MAX_WAIT + 1) * planner.window_steps
    jumps = [p.step for p in blend.points[1:]] if blend.ramp == "step" else []
    spans = [(0, STEPS)] + [
        (a, a + STEPS // 4)
        for a in range(0, STEPS, STEPS // 4)
        if not any(j < a + STEPS // 4 and a < j + lag for j in jumps)
    ]
    assert len(spans) >= 3
    for a, b in spans:
        got, want = units[a:b].sum(axis=0), targets[a:b].sum(axis=0)
        assert np.abs(got / got.sum() - want / want.sum()).max() <= 0.02, (a, b, got / got.sum(), want / want.sum())


def test_resume_across_a_schedule_boundary_is_exact():
    """Documents taken just before, at and after the boundary (inside windows) resume to the same
    steps as the uninterrupted run, for a stepwise token-weighted and a linear schedule."""
    for doc in (
        {"schedule": [{"step": 0, "weights": {"a": 3, "b": 1}}, {"step": 50, "weights": {"c": 1}}], "unit": "tokens"},
        {"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 40, "weights": {"b": 1}}], "ramp": "linear"},
    ):
        blend = Blend.parse(doc, NAMES)
        planner, run = _realised(blend, steps=100)
        for t in (33, 39, 40, 49, 50, 51, 65):
            step, start = run[t]
            saved = json.loads(json.dumps(planner.document(start, t)))
            again = StepPlanner(_sources(), Blend.parse(doc, NAMES), TINY_SEQ, TINY_G, seed=5).resume(saved)
            assert [[r.members for r in next(again)[0].rows] for _ in range(100 - t)] == [
                [r.members for r in s.rows] for s, _ in run[t:]
            ]


def test_a_stepwise_point_is_not_smeared_over_a_window():
    """G 8, K 4, a -> b at step 6: the window of step 4 is cut short at 6, so b trains from step 6
    on, never before; a trains after it only with the samples drawn before the point and not yet
    trained (the pool at step 6, a bounded spare); a resume across the point is exact."""
    doc = {"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 6, "weights": {"b": 1}}]}
    planner = StepPlanner(_sources(), Blend.parse(doc, NAMES), TINY_SEQ, 8, seed=5, window_steps=4)
    run = [next(it) for it in [planner.steps_from(planner.initial_state())] for _ in range(16)]
    assert [start.step for _, start in run] == [0] * 4 + [4] * 2 + [6] * 4 + [10] * 4 + [14] * 2
    assert all(a != 1 for s, _ in run[:6] for a, _ in s.members())  # no b before step 6
    leftover = {(a, p) for a, p, _ in run[6][1].pool}
    late_a = [(a, p) for s, _ in run[6:] for a, p in s.members() if a == 0]
    assert late_a and set(late_a) <= leftover  # a after 6: only samples drawn before it
    for t in (3, 5, 6, 7):
        saved = json.loads(json.dumps(planner.document(run[t][1], t)))
        again = StepPlanner(_sources(), Blend.parse(doc, NAMES), TINY_SEQ, 8, seed=5, window_steps=4).resume(saved)
        assert [[r.members for r in next(again)[0].rows] for _ in range(16 - t)] == [
            [r.members for r in s.rows] for s, _ in run[t:]
        ]


def test_a_resume_with_another_blend_continues_from_the_same_position():
    """A schedule point appended to a running job, inside the window being trained: the document
    records the blend its window was planned with, so the resume re-plans that window as it was
    and continues at the same step, nothing trained twice, the old window's untrained samples not
    lost; the new point applies."""
    first = {"weights": {"a": 1, "b": 1}}
    later = {"schedule": [{"step": 0, "weights": {"a": 1, "b": 1}}, {"step": 14, "weights": {"c": 1}}]}
    planner = StepPlanner(_sources(), Blend.parse(first, NAMES), TINY_SEQ, 8, seed=5, window_steps=8)
    it = planner.steps_from(planner.initial_state())
    run = [next(it) for _ in range(16)]
    doc = json.loads(json.dumps(planner.document(run[11][1], 11)))
    assert Blend.parse(doc["blend"], NAMES) == planner.blend
    after = StepPlanner(_sources(), Blend.parse(later, NAMES), TINY_SEQ, 8, seed=5, window_steps=8)
    rest = [next(r)[0] for r in [after.resume(doc)] for _ in range(20)]
    assert [s.step for s in rest] == list(range(11, 31))
    now = [m for s, _ in run[:11] for m in s.members()] + [m for s in rest for m in s.members()]
    assert len(now) == len(set(now))  # nothing twice
    assert {m for s, _ in run[11:16] for m in s.members()} <= set(now)  # nothing lost
    assert all(a != 2 for s in rest[:3] for a, _ in s.members())  # c only from step 14 on
    assert sum(a == 2 for s in rest[3:] for a, _ in s.members()) > sum(a != 2 for s in rest[3:] for a, _ in s.members())
    old = {k: v for k, v in doc.items() if k != "blend"}  # a document from before the blend was recorded
    same = StepPlanner(_sources(), Blend.parse(first, NAMES), TINY_SEQ, 8, seed=5, window_steps=8).resume(old)
    assert [[r.members for r in next(same)[0].rows] for _ in range(5)] == [
        [r.members for r in s.rows] for s, _ in run[11:16]
    ]
