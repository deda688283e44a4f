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
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

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

    #: fields the model reads on the host (`.tolist()`, `int()`, python loops): `to()` leaves them
    #: on the CPU, so reading them never waits for the device. A family adds its own.
    HOST_FIELDS: ClassVar[tuple[str, ...]] = ("cu_seqlens_host",)
    #: fields only the first pipeline stage reads (media inputs): other stages leave them on the host
    FIRST_STAGE_FIELDS: ClassVar[tuple[str, ...]] = ()

    #: host copy of `cu_seqlens` (attention needs the device copy, layouts/losses read this one);
    #: None until `to()` fills it
    cu_seqlens_host: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def host_cu_seqlens(self) -> torch.Tensor:
        """`cu_seqlens` on the CPU without a device-to-host read when the batch came through `to()`."""
        if self.cu_seqlens_host is not None:
            return self.cu_seqlens_host
        return self.cu_seqlens.cpu()  # a batch built on the device by hand: one read

    def pin_memory(self: _B) -> _B:
        """A copy with every tensor in page-locked memory. torch's DataLoader pin thread calls
        this (`torch/utils/data/_utils/pin_memory.py` pins objects with a `pin_memory()`
        method); without it a dataclass batch stays pageable and every H2D copy blocks."""
        import torch

        return self._map(lambda name, v: v.pin_memory() if isinstance(v, torch.Tensor) else v)

    def to(self: _B, device: Any, first_stage: bool = True) -> _B:
        """A copy with the model's inputs on `device` (asynchronous from pinned memory); the
        host metadata (`HOST_FIELDS`, and `cu_seqlens_host`) stays on the CPU, and with
        `first_stage=False` so do the inputs only the first pipeline stage reads."""
        import torch

        device = torch.device(device)
        stay = set(self.HOST_FIELDS) | (set() if first_stage else set(self.FIRST_STAGE_FIELDS))

        def move(name: str, v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or name in stay:
                return v
            return v.to(device, non_blocking=v.device.type == "cpu" and v.is_pinned())

        moved = self._map(move)
        if moved.cu_seqlens_host is None and self.cu_seqlens.device.type == "cpu":
            moved.cu_seqlens_host = self.cu_seqlens
        return moved

    def _map(self: _B, fn: Any) -> _B:
        return type(self)(**{f.name: fn(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)})


def host_to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A small host tensor (an index the model computed on the CPU) on `device`, without a
    stream sync: a copy from pageable memory to a CUDA device waits for the stream, one from
    pinned memory with `non_blocking=True` does not. Keyed on the target device."""
    import torch

    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t.to(device)
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())
