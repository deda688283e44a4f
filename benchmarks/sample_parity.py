"""Did two training runs train on the same samples, step by step? The check the training
benchmarks make before comparing speed (a faster run on other data measures nothing); a module
of its own so that tests (tests/test_sample_parity.py) check the very code the benchmarks run.

Samples are named as the trainer names them (`train_data.batch_sample_ids`: the unique sample
keys `DATASET#SHARD_KEY`), so like is compared with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmtrain.runtime.train_data import batch_sample_ids


class SampleParityError(ValueError):
    """The runs trained on other samples, in another order, or for another number of steps."""


def check_logged_steps_match(records: Sequence[dict], steps: Sequence[Sequence[Any]]) -> None:
    """Raise SampleParityError unless every step of a run's metrics.jsonl (`records`, each with
    its `sample_ids`) trained on the samples of the matching step of `steps` (each a list of
    packed micro-batches), in order; a missing step counts as a mismatch."""
    if len(records) != len(steps):
        raise SampleParityError(f"ours logged {len(records)} steps, the baseline trained {len(steps)}")
    for rec, step in zip(records, steps):
        ids = [sid for mb in step for sid in batch_sample_ids(mb)]
        if not ids or rec["sample_ids"] != ids:
            raise SampleParityError(
                f"step {rec['step']}: ours trained on other samples than the baseline "
                f"(ours {rec['sample_ids'][:3]}..., baseline {ids[:3]}...)"
            )


def check_rounds_match(runs: dict[str, Sequence[dict]]) -> None:
    """Raise SampleParityError unless every round of every side (`runs[side]`: rounds, each with
    `sample_ids` per step) trained on the samples of the baseline's first round, step by step
    (empty or missing steps count as a mismatch)."""
    ref = runs["baseline"][0]["sample_ids"]
    if not ref or not all(ref):
        raise SampleParityError("the baseline drew no samples")
    for name, rounds in runs.items():
        for i, r in enumerate(rounds, 1):
            if r["sample_ids"] != ref:
                step = next(
                    (k for k, (a, b) in enumerate(zip(r["sample_ids"], ref), 1) if a != b),
                    min(len(r["sample_ids"]), len(ref)) + 1,
                )
                raise SampleParityError(
                    f"{name} round {i}, step {step}: ours trained on other samples than the baseline"
                )
