"""Context-parallel core attention without Transformer Engine: K/V all-gather over the CP group.
Design notes: docs/training.md, "Context-parallel attention without Transformer Engine"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from mmtrain.models.attention import SDPACoreAttention
from mmtrain.private_api import cpu_flash_attention


@dataclass(frozen=True)
class ChunkGroup:
    """Local query chunks of one shape: `n` chunks of `length` queries at offset `offset` of
    their (padded) sequence."""

    length: int
    offset: int
    queries: torch.Tensor  # [n * length] local rows
    prefix_keys: torch.Tensor  # [n * offset] rows of the gathered (padded, global) stream
    diag_keys: torch.Tensor  # [n * length] rows of the gathered stream

    @property
    def n(self) -> int:
        return self.queries.numel() // self.length


@dataclass(frozen=True)
class CPAttentionPlan:
    """Host-side bookkeeping of one micro-batch, shared by every layer."""

    local_tokens: int
    #: [cp * local_tokens] position in the global padded stream of every gathered row
    gathered_to_global: torch.Tensor
    #: [global padded tokens] gathered row holding each global position
    global_to_gathered: torch.Tensor
    groups: tuple[ChunkGroup, ...]
    #: [local_tokens] row of each local token in the concatenated group outputs
    unstack: torch.Tensor

    @classmethod
    def build(cls, cu_padded: list[int], cp: int, rank: int) -> "CPAttentionPlan":
        starts = torch.tensor(cu_padded[:-1], dtype=torch.long)
        lens = torch.tensor(cu_padded[1:], dtype=torch.long) - starts
        keep = lens > 0
        starts, lens = starts[keep], lens[keep]
        chunk = lens // (2 * cp)
        if bool((chunk * 2 * cp != lens).any()):
            raise ValueError(f"context parallelism needs every sequence padded to a multiple of 2*cp={2 * cp}")

        def rank_positions(r: int) -> torch.Tensor:
            first = [torch.arange(s + r * c, s + (r + 1) * c) for s, c in zip(starts.tolist(), chunk.tolist())]
            second = [
                torch.arange(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c)
                for s, c in zip(starts.tolist(), chunk.tolist())
            ]
            return torch.cat([t for pair in zip(first, second) for t in pair])

        gathered_to_global = torch.cat([rank_positions(r) for r in range(cp)])
        local = gathered_to_global.numel() // cp
        global_to_gathered = torch.empty_like(gathered_to_global)
        global_to_gathered[gathered_to_global] = torch.arange(gathered_to_global.numel())

        # local chunks: (length, offset) -> [(local rows, prefix keys, diagonal keys)]
        shapes: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        row = 0
        for s, c in zip(starts.tolist(), chunk.tolist()):
            for o in (rank * c, (2 * cp - 1 - rank) * c):
                shapes.setdefault((c, o), []).append(
                    (torch.arange(row, row + c), torch.arange(s, s + o), torch.arange(s + o, s + o + c))
                )
                row += c
        groups, order = [], []
        for (c, o), items in shapes.items():
            q, kp, kd = (torch.cat(parts) for parts in zip(*items))
            groups.append(ChunkGroup(c, o, q, kp, kd))
            order.append(q)
        unstack = torch.empty(local, dtype=torch.long)
        unstack[torch.cat(order)] = torch.arange(local)
        return cls(local, gathered_to_global, global_to_gathered, tuple(groups), unstack)


class _GatherSequence(torch.autograd.Function):
    """All-gather this rank's [t, ...] over the CP group into the global padded order; the
    backward sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, plan: CPAttentionPlan) -> torch.Tensor:
        ctx.group, ctx.plan = group, plan
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts).index_select(0, plan.global_to_gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        plan = ctx.plan
        gathered = grad.index_select(0, plan.gathered_to_global).contiguous()
        dist.all_reduce(gathered, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        t = plan.local_tokens
        return gathered[rank * t : (rank + 1) * t], None, None


class _PrefixCausalAttention(torch.autograd.Function):
    """q [n, np, c, hn] attending prefix keys [n, ng, o, hn] fully and its own c keys causally."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, scale: float
    ) -> torch.Tensor:
        _flash_fwd, _ = cpu_flash_attention()
        out, lse = _flash_fwd(q, kd, vd, 0.0, True, scale=scale)
        if kp.size(2) > 0:
            out_p, lse_p = _flash_fwd(q, kp, vp, 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse_p)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + out_p * torch.exp(lse_p - merged).unsqueeze(-1)
            lse = merged
        out = out.contiguous()
        ctx.save_for_backward(q, kp, vp, kd, vd, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, kp, vp, kd, vd, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        _, _flash_bwd = cpu_flash_attention()
        dq, dkd, dvd = _flash_bwd(grad, q, kd, vd, out, lse, 0.0, True, scale=ctx.scale)
        dkp = dvp = None
        if kp.size(2) > 0:
            dq_p, dkp, dvp = _flash_bwd(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq_p
        else:
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        return dq, dkp, dvp, dkd, dvd, None


def _rows(x: torch.Tensor, index: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """Rows `index` of x [t, heads, hn] as [n, heads, length, hn]."""
    return x.index_select(0, index).view(n, length, *x.shape[1:]).transpose(1, 2)


class KVAllGatherCoreAttention(SDPACoreAttention):
    """CPU context-parallel core attention (see the module docstring)."""

    handles_context_parallel = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)  # SDPACoreAttention's arguments, as megatron's build_module passes them
        pg_collection = self.pg_collection
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        if self.dropout_p > 0.0:
            raise NotImplementedError("attention dropout is not supported with context parallelism on CPU")

    def _check_inputs(self, mask_type: AttnMaskType, attention_bias: Optional[torch.Tensor], thd: bool) -> None:
        if not thd or attention_bias is not None:
            raise NotImplementedError(
                "context-parallel attention takes THD packed sequences "
                "(context_parallel.CPLayout.packed_seq_params) and no attention bias"
            )
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError("context-parallel attention is causal (decoders)")

    def _thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams, causal: bool
    ) -> torch.Tensor:
        """SDPACoreAttention.forward's THD path (the only one here): causal attention of this
        rank's queries over the K/V gathered from the CP group."""
        plan = self._plan(params)
        if query.size(0) != plan.local_tokens:
            raise ValueError(f"{query.size(0)} local tokens, but the CP layout gives this rank {plan.local_tokens}")
        k_all = _GatherSequence.apply(key, self.cp_group, plan)
        v_all = _GatherSequence.apply(value, self.cp_group, plan)
        outs = []
        for g in plan.groups:
            outs.append(
                _PrefixCausalAttention.apply(
                    _rows(query, g.queries, g.n, g.length),
                    _rows(k_all, g.prefix_keys, g.n, g.offset),
                    _rows(v_all, g.prefix_keys, g.n, g.offset),
                    _rows(k_all, g.diag_keys, g.n, g.length),
                    _rows(v_all, g.diag_keys, g.n, g.length),
                    self.softmax_scale,
                )
            )
        flat = [o.transpose(1, 2).reshape(-1, *o.shape[1:2], o.shape[-1]) for o in outs]
        out = torch.cat(flat).index_select(0, plan.unstack)
        return out.reshape(out.size(0), -1)

    def _plan(self, params: PackedSeqParams) -> CPAttentionPlan:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        build = lambda: CPAttentionPlan.build(cu.tolist(), cp, rank)  # noqa: E731
        cached = getattr(params, "plan", None)
        return cached("cp_all_gather", build) if cached is not None else build()
