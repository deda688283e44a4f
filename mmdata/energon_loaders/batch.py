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
- Rows are independent: `split_rows` / `join_rows` cut a batch into one-row batches and join
  any of them back (vision-aware balancing moves whole rows between micro-batches and
  data-parallel ranks), `to_bytes` / `from_bytes` carry one over the wire (safetensors + JSON).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence, TypeVar

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from mmdata.energon_loaders.labels import IGNORE_INDEX as IGNORE_INDEX  # re-exported: the batch's label convention

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
    #: where a batch of the global order stands in it (`data.sharding: global`; None otherwise):
    #: step, micro_batch, micro_batches, bytes_read (this rank, this micro-batch), units (per source,
    #: the whole step): energon_loaders/global_order.py
    global_order: dict[str, Any] | None = None

    #: fields the model reads on the host (`.tolist()`, `int()`, python loops): `to()` leaves them
    #: on the CPU, so reading them never waits for the device. A family adds its own.
    HOST_FIELDS: ClassVar[tuple[str, ...]] = ("cu_seqlens_host",)
    #: fields only the first pipeline stage reads (media inputs): other stages leave them on the host
    FIRST_STAGE_FIELDS: ClassVar[tuple[str, ...]] = ()
    #: fields with one entry per row ([B, ...] tensors, per-row lists): `split_rows` cuts them
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("input_ids", "labels", "position_ids", "sample_ids", "sample_keys")
    #: host copies `to()` fills in: left out when rows are split, joined or sent
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = ("cu_seqlens_host",)

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
        return self._map(lambda name, v: v.pin_memory() if isinstance(v, torch.Tensor) else v)

    def to(self: _B, device: Any, first_stage: bool = True) -> _B:
        """A copy with the model's inputs on `device` (asynchronous from pinned memory); the
        host metadata (`HOST_FIELDS`, and `cu_seqlens_host`) stays on the CPU, and with
        `first_stage=False` so do the inputs only the first pipeline stage reads."""
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

    # -- rows --------------------------------------------------------------------------------

    def split_rows(self: _B) -> list[_B]:
        """One batch per row (on the host, before `to()`): its tokens, its `cu_seqlens` segments
        (a row's samples, then its padding run), its samples and counters, and the family's
        per-row items (`row_items`); the batch's `stats` go with row 0."""
        b, s = (int(n) for n in self.input_ids.shape)
        cu = [int(x) for x in self.host_cu_seqlens().tolist()]
        segments: list[list[int]] = [[] for _ in range(b)]
        for start, end in zip(cu[:-1], cu[1:]):
            if end > start:
                segments[start // s].append(end - start)
        items = self.row_items()
        rows = []
        for r in range(b):
            fields = {name: getattr(self, name) for name in self._field_names() if name not in self.DERIVED_FIELDS}
            for name in self.ROW_FIELDS:
                fields[name] = fields[name][r : r + 1]  # a [1, ...] tensor, or a one-row list ([] when unset)
            samples = len(self.sample_ids[r]) if self.sample_ids else None
            if samples is None and b > 1:
                raise ValueError("split_rows needs the batch's sample_ids (its rows' samples among their segments)")
            lens = segments[r]
            fields.update(
                items[r],
                cu_seqlens=_cumsum(lens),
                max_seqlen=max(lens, default=0),
                num_loss_tokens=int((self.labels[r] != IGNORE_INDEX).sum()),
                num_real_tokens=sum(lens[:samples]) if samples is not None else self.num_real_tokens,
                stats=dict(self.stats) if r == 0 else {},
            )
            rows.append(type(self)(**fields))
        return rows

    @classmethod
    def join_rows(cls: type[_B], rows: Sequence[_B]) -> _B:
        """The batch of these one-or-more-row batches, rows in order (the inverse of `split_rows`)."""
        if not rows:
            raise ValueError("join_rows needs at least one row")
        first = rows[0]
        fields = {name: getattr(first, name) for name in cls._field_names() if name not in cls.DERIVED_FIELDS}
        for name in cls.ROW_FIELDS:
            values = [getattr(r, name) for r in rows]
            fields[name] = torch.cat(values) if hasattr(values[0], "shape") else [x for v in values for x in v]
        lens: list[int] = []
        for r in rows:
            cu = [int(x) for x in r.host_cu_seqlens().tolist()]
            lens += [e - a for a, e in zip(cu[:-1], cu[1:]) if e > a]
        stats: dict[str, int] = {}
        for r in rows:
            for k, v in r.stats.items():
                stats[k] = stats.get(k, 0) + v
        fields.update(
            cls.join_items(rows),
            cu_seqlens=_cumsum(lens),
            max_seqlen=max(lens, default=0),
            num_loss_tokens=sum(r.num_loss_tokens for r in rows),
            num_real_tokens=sum(r.num_real_tokens for r in rows),
            stats=stats,
        )
        return cls(**fields)

    def row_items(self) -> list[dict[str, Any]]:
        """Per row, the values of the family's fields that are flattened over the rows (e.g. media);
        a family with such fields implements this and `join_items`."""
        return [{} for _ in range(int(self.input_ids.shape[0]))]

    @classmethod
    def join_items(cls, rows: Sequence["PackedBatch"]) -> dict[str, Any]:
        """The family's flattened fields of rows joined in order (see `row_items`)."""
        return {}

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    # -- bytes -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The batch as safetensors bytes: its tensors, and its other fields as JSON in the
        metadata (no pickle: `from_bytes` on the receiving side runs no code)."""
        tensors, other, tuples = {}, {}, []
        for name in self._field_names():
            v = getattr(self, name)
            if name in self.DERIVED_FIELDS or v is None:
                continue
            if hasattr(v, "shape"):
                tensors[name] = v.detach().contiguous().clone()
            else:
                other[name] = v
                if isinstance(v, tuple):
                    tuples.append(name)
        # one metadata key: safetensors writes several in no fixed order, and the same batch should
        # give the same bytes in every process
        return save_tensors(tensors, metadata={"mmdata.batch": json.dumps({"fields": other, "tuples": tuples})})

    @classmethod
    def from_bytes(cls: type[_B], data: bytes) -> _B:
        """The batch `to_bytes` wrote."""
        # safetensors' layout: an 8-byte little-endian header size, then the JSON header
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        meta = json.loads(header["__metadata__"]["mmdata.batch"])
        other = meta["fields"]
        for name in meta["tuples"]:
            other[name] = tuple(other[name])
        return cls(**load_tensors(data), **other)


def _cumsum(lengths: Sequence[int]) -> "torch.Tensor":
    """`cu_seqlens` (int32) of segment lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def host_to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A small host tensor (an index the model computed on the CPU) on `device`, without a
    stream sync: a copy from pageable memory to a CUDA device waits for the stream, one from
    pinned memory with `non_blocking=True` does not. Keyed on the target device."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t.to(device)
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())
