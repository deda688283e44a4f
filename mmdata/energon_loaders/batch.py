"""The batch contract every family's task encoder fulfils, and the one spelling of the ignore index.

`PackedBatch` holds what the shared training runtime reads from any family's batch (token
stream, shifted labels, packing metadata, sample ids for `metrics.jsonl`, loader counters);
a family's batch type (e.g. `llava_ov.batch.LlavaOVBatch`) subclasses it and adds its inputs.

Conventions:
- `labels` are ALREADY SHIFTED (Megatron convention): `labels[b, t]` is the target for the
  prediction made at position t, i.e. the token at t+1 of the same packed sample;
  IGNORE_INDEX where no loss applies (prompt turns, media tokens, the last position of each
  sample, padding).
- Packing: each row holds one or more samples back to back, then padding. `position_ids`
  restart at 0 for each sample. `cu_seqlens` are cumulative lengths over the flattened
  `[B*S]` token stream (THD layout), one segment per sample and one per padding run, so
  attention can be restricted to within a segment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch is imported where tensors are made; this module stays import-light
    import torch

#: label value that takes no loss (transformers' and megatron's convention)
IGNORE_INDEX = -100

_B = TypeVar("_B", bound="PackedBatch")


@dataclass(kw_only=True)
class PackedBatch:
    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, shifted, IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # [B, S] int64, restart per packed sample
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 over the flattened B*S stream
    max_seqlen: int
    sample_ids: list[list[str]] = field(default_factory=list)  # per row, the packed sample ids
    num_loss_tokens: int = 0  # number of labels != IGNORE_INDEX
    sample_keys: list[list[str]] = field(default_factory=list)  # per row, the shard keys (unique)
    num_real_tokens: int = 0  # non-padding positions (packing efficiency = this / B*S)
    #: per-worker counters since that worker's previous batch ("skipped/<reason>", "truncated");
    #: the loader sums them into its `stats`
    stats: dict[str, int] = field(default_factory=dict)

    def to(self: _B, device: Any) -> _B:
        """A copy with every tensor moved to `device`."""
        import torch

        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        }
        return type(self)(**moved)
