"""`benchmarks.sample_parity`: the training benchmarks' same-samples checks (bench_train_llava,
bench_train_emu3) compare keys with keys and fail on other samples, another order or a missing
step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.sample_parity import SampleParityError, check_logged_steps_match, check_rounds_match

pytestmark = pytest.mark.unit


def _batch(keys: list[list[str]], ids: list[list[str]]) -> SimpleNamespace:
    """What batch_sample_ids reads of a packed batch: per row, the sample keys and record ids."""
    return SimpleNamespace(sample_keys=keys, sample_ids=ids)


def test_logged_steps_check_compares_keys_and_stays_strict() -> None:
    """Metrics name samples by key (`DATASET#SHARD_KEY`): the check compares keys with keys, and
    still fails on other samples, another order or a missing step."""
    steps = [
        [_batch([["d#0001", "d#0002"]], [["r1", "r2"]]), _batch([["d#0003"]], [["r3"]])],
        [_batch([["d#0004"]], [["r4"]]), _batch([["d#0005"]], [["r5"]])],
    ]
    good = [{"step": 1, "sample_ids": ["d#0001", "d#0002", "d#0003"]}, {"step": 2, "sample_ids": ["d#0004", "d#0005"]}]
    check_logged_steps_match(good, steps)
    for bad in (
        [{**good[0], "sample_ids": ["d#0002", "d#0001", "d#0003"]}, good[1]],  # another order
        [good[0], {**good[1], "sample_ids": ["d#0004", "d#0009"]}],  # another sample
        [good[0]],  # a step missing
        # record ids instead of keys: what the benchmark compared before the fix
        [{"step": 1, "sample_ids": ["r1", "r2", "r3"]}, {"step": 2, "sample_ids": ["r4", "r5"]}],
    ):
        with pytest.raises(SampleParityError, match="other samples|logged 1 steps"):
            check_logged_steps_match(bad, steps)


def test_rounds_check_stays_strict() -> None:
    ref = [["d#1", "d#2"], ["d#3"]]
    check_rounds_match({"baseline": [{"sample_ids": ref}], "ours": [{"sample_ids": ref}, {"sample_ids": ref}]})
    for ours in ([["d#1", "d#2"]], [["d#1", "d#2"], ["d#4"]], [["d#2", "d#1"], ["d#3"]]):
        with pytest.raises(SampleParityError, match="other samples"):
            check_rounds_match({"baseline": [{"sample_ids": ref}], "ours": [{"sample_ids": ours}]})
