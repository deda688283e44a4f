"""Rows made of chosen samples, read by global index: what the offline plan's loader
(plan_packing.py) and the global order's loader (global_order.py) share.

A sample is read with energon's random access (its tar index) from one shard folder, its key
checked against what the planner was told, the family's planned per-sample choice handed over as
the subflavor PLAN_VARIANT, and encoded with the family's hooks (`encode`). `fill_row` fills one
row with its planned samples: one whose encoded length does not fit what is left (lengths that
were estimates) is carried into the next row, in order; the carry holds at most a given number of
samples, one more is skipped as PLAN_OVERFLOW; a sample longer than the sequence on its own is
skipped as PLAN_TOO_LONG (the encoder truncates text, so only a family that does not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from megatron.energon import SkipSample, TaskEncoder, WorkerConfig
from megatron.energon.dataset_config import get_dataset_from_config

from mmdata.energon_configs import dataset_config
from mmdata.energon_loaders.task_encoding import sample_key
from mmdata.packing.plan_file import PlanError

PLAN_OVERFLOW = "plan_overflow"  # the carry was full: the sample did not fit its row nor a later one
PLAN_TOO_LONG = "plan_too_long"  # longer than the sequence on its own: no row can hold it
PLAN_CARRIED = "plan_carried"  # counter: samples carried into a later row (they train there)
#: samples a worker carries into later rows at most, as members that the next row reads again; the
#: offline plan's loader state holds them, the global order's layout-free document does not (a
#: sample carried at a save trains in a later epoch)
PLAN_CARRY_LIMIT = 256
#: the subflavor that hands a sample's planned variant to the task encoder (a plan with a `variant`
#: column: the family drew per-sample choices that change lengths, e.g. Emu3's task and CFG drop)
PLAN_VARIANT = "plan_variant"


class ShardReader:
    """One shard folder's samples by global index, opened on first use (in the loader worker:
    file handles are not shared across forks)."""

    def __init__(self, root: Path, worker_config: WorkerConfig, decoder: Any, described_by: str = "the plan"):
        self.root, self.worker_config, self.decoder, self.described_by = root, worker_config, decoder, described_by
        self._reader: Any = None

    def read(self, index: int, key: str, variant: int | None = None) -> Any:
        """Sample `index`, checked to have `key`, with its planned `variant` (None: none planned)."""
        if self._reader is None:
            factory = get_dataset_from_config(
                self.root,
                dataset_config=dataset_config(self.root),
                split_config="split.yaml",
                split_part="train",
                training=False,
                worker_config=self.worker_config,
                decoder=self.decoder,
            )
            self._reader = factory.build()
        sample = self._reader.restore_sample(("MapDataset", index, "Webdataset", int(index)))
        if sample.__key__ != key:
            raise PlanError(
                f"sample {index} of {self.root} has key {sample.__key__!r}, {self.described_by} says {key!r}: "
                f"{self.described_by} does not describe these shards"
            )
        return with_variant(sample, variant)


def with_variant(sample: Any, variant: int | None) -> Any:
    """`sample` with its planned variant as the subflavor PLAN_VARIANT (unchanged for None)."""
    if variant is not None:
        sample.__subflavors__ = {**(sample.__subflavors__ or {}), PLAN_VARIANT: variant}
    return sample


def encode(task_encoder: TaskEncoder, sample: Any) -> Any:
    """One sample through the family's encoding hooks, as energon's pipeline would call them."""
    cls = type(task_encoder)
    if cls.preencode_sample is not TaskEncoder.preencode_sample:
        sample = task_encoder.preencode_sample(sample)
        if cls.postencode_sample is not TaskEncoder.postencode_sample:
            sample = task_encoder.postencode_sample(sample)
        return sample
    return task_encoder.encode_sample(sample)


def fill_row(
    te: Any,
    members: Iterable[Sequence[Any]],
    read: Callable[[Sequence[Any]], Any],
    *,
    where: str,
    carry_limit: int,
) -> tuple[list[Any], list[list[Any]]]:
    """(the encoded samples of one row, the members carried into the next row). `members`: the
    row's planned samples (the previous row's carry first), as `read(member)` takes them to give
    the raw sample; `where` names the row in messages. A skip names the sample by its record id,
    else by `DATASET#KEY` (a member is a source number and position, or an index, not a name).
    Skips and counters go through the task encoder (`_skip`, `_count`)."""
    row: list[Any] = []
    carry: list[list[Any]] = []
    used = 0
    for member in members:
        try:
            encoded = encode(te, read(member))
        except SkipSample:  # counted by the encoder
            continue
        n = len(encoded.input_ids)
        sid = str(encoded.id) if getattr(encoded, "id", None) is not None else sample_key(encoded)
        if n > te.seq_length:
            te._skip(PLAN_TOO_LONG, sid, f"{n} tokens > seq_length {te.seq_length}")
        elif used + n <= te.seq_length:
            used += n
            row.append(encoded)
        elif len(carry) < carry_limit:
            carry.append(list(member))
            te._count(PLAN_CARRIED)
        else:
            te._skip(
                PLAN_OVERFLOW,
                sid,
                f"{n} tokens do not fit the {te.seq_length - used} left in {where}, "
                f"and {carry_limit} samples are carried already",
            )
    return row, carry
