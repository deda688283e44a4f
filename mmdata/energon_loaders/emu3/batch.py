"""`Emu3Batch`: what the Emu3 task encoder yields and `mmtrain.emu3` consumes.

Emu3 is one decoder over text and VQ visual tokens, so a batch is a `PackedBatch` (token
stream with images already serialised as visual tokens, shifted labels, packing metadata) plus
the task of each packed sample, for inspection and per-task accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mmdata.energon_loaders.batch import PackedBatch


@dataclass(kw_only=True)
class Emu3Batch(PackedBatch):
    #: per row, the task of each packed sample ("understanding" | "generation"), parallel to sample_ids
    tasks: list[list[str]] = field(default_factory=list)

    ROW_FIELDS: ClassVar[tuple[str, ...]] = PackedBatch.ROW_FIELDS + ("tasks",)
