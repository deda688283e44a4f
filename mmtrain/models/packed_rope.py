"""RoPE on packed (THD) sequences without host reads: megatron's result, one position table per micro-batch.
Design notes: docs/gpu.md, "packed_rope: THD RoPE without host reads"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.models.context_parallel import PackedSequence


def thd_rope_positions(
    cu_seqlens: torch.Tensor, tokens: int, freqs_len: int, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """[tokens] int64: the row of megatron's `freqs` each local token of a THD stream reads.

    `cu_seqlens`: the (padded, global) boundaries megatron's RoPE gets; each sequence holds
    `len // cp_size` local tokens. Device ops only: nothing is read back to the host.
    `freqs_len` (the frequency table's length) picks megatron's mode: a table as long as the
    whole stream (`freqs_len == tokens * cp_size`) is indexed by stream position, otherwise by
    position inside the sequence."""
    cu = cu_seqlens.to(torch.int64)
    lens = (cu[1:] - cu[:-1]) // cp_size
    local_cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    k = torch.arange(tokens, device=cu.device)
    seg = torch.searchsorted(local_cu[1:], k, right=True)
    j = k - local_cu[seg]  # index inside this rank's share of the sequence
    if cp_size > 1:
        c = lens[seg] // 2  # megatron's cp_seg; full_seqlen = cp_size * local length
        full = lens[seg] * cp_size
        j = torch.where(j < c, cp_rank * c + j, full - (cp_rank + 1) * c + (j - c))
    if freqs_len == tokens * cp_size:  # megatron's "exact mapping": offset by the sequence's start
        j = j + cu[seg]
    return j


def apply_thd_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    config: TransformerConfig,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """RoPE of `t` ([T, h, d] as megatron's THD path takes it, or [T, 1, h, d]) at `positions`
    (`thd_rope_positions`), by megatron's public `apply_rotary_pos_emb` on the per-token table."""
    squeeze = t.dim() == 3
    positions = positions.to(freqs.device, non_blocking=True)  # a no-op where they were made (cu_seqlens' device)
    out = apply_rotary_pos_emb(
        t.unsqueeze(1) if squeeze else t,
        freqs.index_select(0, positions),
        config=config,
        cu_seqlens=None,
        cp_group=cp_group,
    )
    return out.squeeze(1) if squeeze else out


def _cu_for_rope(params: PackedSeqParams, which: str) -> torch.Tensor:
    """The boundaries megatron's attention hands its RoPE (`attention.py`: the padded ones when set)."""
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    return padded if padded is not None else getattr(params, f"cu_seqlens_{which}")


@dataclass
class _PendingRoPE:
    """What `forward` hands `get_query_key_value_tensors` for this call."""

    q_freqs: Optional[torch.Tensor]
    k_freqs: Optional[torch.Tensor]
    params: PackedSeqParams


class PackedRoPESelfAttention(SelfAttention):
    """megatron's `SelfAttention` with THD RoPE applied without host syncs (module docstring).
    Same parameters, names and results as `SelfAttention`."""

    _pending_rope: Optional[_PendingRoPE] = None

    def _takes_over(self, kwargs: dict[str, Any]) -> Optional[_PendingRoPE]:
        params = kwargs.get("packed_seq_params")
        rope = kwargs.get("rotary_pos_emb")
        cfg = self.config
        if (
            params is None
            or params.qkv_format != "thd"
            or rope is None
            or cfg.apply_rope_fusion
            or kwargs.get("inference_context") is not None
            or kwargs.get("inference_params") is not None
            or cfg.no_rope_freq
            or getattr(cfg, "mrope_section", None) is not None
            or hasattr(cfg, "yarn_rotary_scaling_factor")
        ):
            return None
        q, k = rope if isinstance(rope, tuple) else (rope, rope)
        return _PendingRoPE(q, k, params)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        pending = None if args else self._takes_over(kwargs)
        if pending is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._pending_rope = pending
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._pending_rope = None

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> tuple:
        out = super().get_query_key_value_tensors(*args, **kwargs)
        pending = self._pending_rope
        if pending is None:
            return out
        query, key, *rest = out  # THD always splits q/k/v (attention.py: split_qkv)
        if pending.q_freqs is not None:
            query = self._rotate(query, pending.q_freqs, pending.params, "q")
        if pending.k_freqs is not None:
            key = self._rotate(key, pending.k_freqs, pending.params, "kv")
        return (query, key, *rest)

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor, params: PackedSeqParams, which: str) -> torch.Tensor:
        """`t` [T, 1, heads, d] rotated as megatron's THD path would."""
        cp_group = self.pg_collection.cp
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cu = _cu_for_rope(params, which)
        tokens, freqs_len = t.size(0), freqs.size(0)

        def build() -> torch.Tensor:
            return thd_rope_positions(cu, tokens, freqs_len, cp_size, cp_rank)

        if isinstance(params, PackedSequence):  # once per micro-batch: megatron hands every layer this object
            positions = params.plan(f"thd_rope_positions:{id(cu)}:{tokens}:{freqs_len}:{cp_size}:{cp_rank}", build)
        else:
            positions = build()
        return apply_thd_rope(t, freqs, positions, self.config, cp_group)
