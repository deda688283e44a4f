"""Context parallelism (CP): which tokens of a packed stream each CP rank holds.
Design notes: docs/training.md, "Context parallelism: which tokens each CP rank holds"."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from mmdata.energon_loaders.batch import host_to_device


@dataclass
class PackedSequence(PackedSeqParams):
    """megatron's THD parameters plus host-side plans that the CPU attentions build once per
    micro-batch and reuse in every layer (megatron hands the same object to each layer)."""

    _plans: dict = field(default_factory=dict, repr=False, compare=False)
    #: host copy of `cu_seqlens_q`, for plans built on the host (no device-to-host read)
    cu_seqlens_host: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def plan(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]


def padding_multiple(cp: int, tp: int) -> int:
    """What every sequence is padded to under CP: megatron's `2*cp`, times `tp` so that
    sequence parallelism can split each rank's share (applied whether or not SP is on, so the
    layout depends on the parallel sizes only)."""
    return 2 * cp * tp if cp > 1 else 1


@dataclass(frozen=True)
class CPLayout:
    """This CP rank's share of a flattened packed stream of `total` tokens."""

    cp: int
    rank: int
    total: int
    #: [t_local] positions in the stream this rank holds, in its local order; `total` marks a
    #: padding slot. None: the identity (cp == 1)
    index: Optional[torch.Tensor]
    #: [num_sequences + 1] int32 boundaries of the (padded) sequences over the whole stream
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def local_tokens(self) -> int:
        return self.total if self.index is None else int(self.index.numel())

    def split(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """`x [total, ...]` -> this rank's `[t_local, ...]` (padding slots hold `fill`)."""
        if self.index is None:
            return x
        ext = torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])
        return ext.index_select(0, host_to_device(self.index, x.device))

    def scatter(self, local: torch.Tensor) -> torch.Tensor:
        """`local [t_local, ...]` -> `[total, ...]`, zero at positions other ranks hold
        (differentiable: the gradient flows back to the local values)."""
        if self.index is None:
            return local
        out = local.new_zeros((self.total + 1, *local.shape[1:]))
        return out.index_copy(0, host_to_device(self.index, local.device), local)[: self.total]

    def held(self) -> torch.Tensor:
        """[total] bool: the stream positions this rank holds."""
        if self.index is None:
            return torch.ones(self.total, dtype=torch.bool)
        mask = torch.zeros(self.total + 1, dtype=torch.bool)
        mask[self.index] = True
        return mask[: self.total]

    def packed_seq_params(self, device: torch.device | str | None = None) -> PackedSequence:
        """THD parameters of this rank's share. The sequence boundaries are the global padded
        ones (megatron's RoPE and TE's CP attention divide them by cp themselves); the padding
        slots count as tokens of their sequence, which is exact under causal attention."""
        host = self.cu_seqlens.to(dtype=torch.int32)
        cu = host if device is None else host_to_device(host, device)  # pinned + async: no stream sync
        padded = cu if self.cp > 1 else None
        return PackedSequence(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            cu_seqlens_host=host if host.device.type == "cpu" else None,
        )


def cp_layout(
    cu_seqlens: torch.Tensor, cp: int, rank: int, multiple: int, max_seqlen: Optional[int] = None
) -> CPLayout:
    """The layout of a stream segmented by `cu_seqlens` on CP rank `rank` of `cp`, every
    sequence padded to a multiple of `multiple` (a multiple of 2*cp; see `padding_multiple`)."""
    cu = cu_seqlens.detach().to(device="cpu", dtype=torch.int64)
    total = int(cu[-1])
    if cp == 1:
        lens = cu[1:] - cu[:-1]
        longest = int(lens.max()) if lens.numel() else 0
        return CPLayout(1, 0, total, None, cu.to(torch.int32), max_seqlen if max_seqlen is not None else longest)
    if multiple % (2 * cp):
        raise ValueError(f"CP padding multiple {multiple} is not a multiple of 2*cp = {2 * cp}")
    lens = cu[1:] - cu[:-1]
    keep = lens > 0
    starts, lens = cu[:-1][keep], lens[keep]
    padded = (lens + multiple - 1) // multiple * multiple
    chunk = padded // (2 * cp)
    per_rank = 2 * chunk
    seg = torch.repeat_interleave(torch.arange(lens.numel()), per_rank)
    local_starts = torch.cumsum(per_rank, 0) - per_rank
    j = torch.arange(int(per_rank.sum())) - local_starts[seg]  # 0 .. 2*chunk-1 inside the sequence
    c = chunk[seg]
    offset = torch.where(j < c, rank * c + j, (2 * cp - 1 - rank) * c + (j - c))
    index = torch.where(offset < lens[seg], starts[seg] + offset, torch.full_like(offset, total))
    cu_padded = torch.zeros(padded.numel() + 1, dtype=torch.int64)
    cu_padded[1:] = torch.cumsum(padded, 0)
    return CPLayout(cp, rank, total, index, cu_padded.to(torch.int32), int(padded.max()) if padded.numel() else 0)


def current_layout(cu_seqlens: torch.Tensor, max_seqlen: Optional[int] = None) -> CPLayout:
    """`cp_layout` for this process's CP rank (sizes from megatron's parallel_state). Pass the
    host copy (`PackedBatch.host_cu_seqlens()`): a device tensor costs a device-to-host read."""
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() <= 1:
        return cp_layout(cu_seqlens, 1, 0, 1, max_seqlen)
    cp = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return _cached_layout(cu_seqlens, cp, rank, padding_multiple(cp, tp), max_seqlen)


def _cached_layout(cu_seqlens: torch.Tensor, cp: int, rank: int, multiple: int, max_seqlen: Optional[int]) -> CPLayout:
    """The model, the loss mask and the per-sample losses all ask for the same micro-batch's
    layout; compute it once per distinct `cu_seqlens`."""
    key = tuple(cu_seqlens.detach().cpu().tolist())
    return _layout_from_key(key, cp, rank, multiple, max_seqlen)


@functools.lru_cache(maxsize=16)
def _layout_from_key(cu: tuple, cp: int, rank: int, multiple: int, max_seqlen: Optional[int]) -> CPLayout:
    return cp_layout(torch.tensor(cu, dtype=torch.int64), cp, rank, multiple, max_seqlen)
