"""Core attention for the local (non-Transformer-Engine) layer specs: PyTorch SDPA.
Design notes: docs/training.md, "Core attention on the local spec: SDPA"."""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

#: two sequences share an SDPA call when the padding this adds (in token^2 of attention work,
#: leader^2 - length^2) is below what a separate call costs; measured on CPU (1 thread, head dims
#: 16..128) a call costs about as much as 96^2..128^2 token pairs of causal attention
MERGE_BUDGET = 128 * 128


# ----------------------------------------------------------------------------- grouped varlen


@dataclass(frozen=True)
class VarlenPlan:
    """How the sequences of a THD stream are stacked for `grouped_varlen_sdpa`."""

    #: (number of sequences, padded length) per SDPA call
    groups: tuple[tuple[int, int], ...]
    #: [sum n*L] stream position of every stacked slot (`total` = a zero padding row); None when
    #: the stream already is one equal-length stack (no copy needed)
    gather: Optional[torch.Tensor]
    #: [total] slot of every stream position in the stacked layout; None with `gather`
    scatter: Optional[torch.Tensor]

    @classmethod
    def build(cls, bounds: list[int], merge_budget: int = MERGE_BUDGET) -> "VarlenPlan":
        """From `cu_seqlens` as a Python list (host side, once per micro-batch)."""
        total = bounds[-1]
        lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        nonzero = [n for n in lens if n > 0]
        if nonzero and len(set(nonzero)) == 1:  # e.g. unpacked rows of one sequence each
            return cls(((len(nonzero), nonzero[0]),), None, None)
        order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i])
        groups: list[list[int]] = []  # [leader length, member indices...]
        for i in order:
            if groups and groups[-1][0] ** 2 - lens[i] ** 2 <= merge_budget:
                groups[-1].append(i)
            else:
                groups.append([lens[i], i])
        gather, scatter = [], torch.empty(total, dtype=torch.long)
        slot = 0
        for leader, *members in groups:
            for i in members:
                start, n = bounds[i], lens[i]
                idx = torch.full((leader,), total, dtype=torch.long)
                idx[:n] = torch.arange(start, start + n)
                gather.append(idx)
                scatter[start : start + n] = torch.arange(slot, slot + n)
                slot += leader
        return cls(tuple((len(m), g) for g, *m in groups), torch.cat(gather), scatter)

    def stack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[total, heads, dim] -> per group [n, heads, L, dim] (SDPA's layout)."""
        if self.gather is None:
            flat = [x]
        else:
            ext = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            flat = ext.index_select(0, self.gather.to(x.device)).split([n * L for n, L in self.groups])
        return [t.view(n, L, *x.shape[1:]).transpose(1, 2) for t, (n, L) in zip(flat, self.groups)]

    def unstack(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Per group [n, heads, L, dim] -> [total, heads, dim] in stream order."""
        flat = [o.transpose(1, 2).reshape(-1, *o.shape[1:2], o.shape[-1]) for o in outs]
        out = torch.cat(flat) if len(flat) > 1 else flat[0]
        return out if self.scatter is None else out.index_select(0, self.scatter.to(out.device))

    def key_masks(self, device: torch.device) -> list[Optional[torch.Tensor]]:
        """Per group [n, 1, 1, L] True where a key is real (only bidirectional attention needs
        it: under causal attention the padding keys follow every real query)."""
        if self.gather is None:
            return [None] * len(self.groups)
        valid = (self.gather < self.scatter.numel()).to(device).split([n * L for n, L in self.groups])
        return [m.view(n, 1, 1, L) for m, (n, L) in zip(valid, self.groups)]


def varlen_plan(packed_seq_params: PackedSeqParams) -> VarlenPlan:
    """The plan of a micro-batch, built once and reused by every layer when the params can
    hold it (`context_parallel.PackedSequence`)."""
    host = getattr(packed_seq_params, "cu_seqlens_host", None)  # PackedSequence: no device read
    cu = host if host is not None else packed_seq_params.cu_seqlens_q
    build = lambda: VarlenPlan.build(cu.tolist())  # noqa: E731
    plan = getattr(packed_seq_params, "plan", None)
    return plan("varlen", build) if plan is not None else build()


def grouped_varlen_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, *, causal: bool, scale: float, sdpa: Any = None
) -> torch.Tensor:
    """Per-sequence attention of a THD stream: q [t, np, hn], k/v [t, ng, hn] -> [t, np, hn].
    `sdpa(q, k, v, causal, mask)` runs one group ([n, heads, L, hn]); default: plain SDPA."""
    if sdpa is None:

        def sdpa(a, b, c, is_causal, mask):
            return F.scaled_dot_product_attention(
                a, b, c, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=a.size(1) != b.size(1)
            )

    masks = [None] * len(plan.groups) if causal else plan.key_masks(q.device)
    outs = [sdpa(qq, kk, vv, causal, m) for qq, kk, vv, m in zip(plan.stack(q), plan.stack(k), plan.stack(v), masks)]
    return plan.unstack(outs)


# ----------------------------------------------------------------------------- GPU varlen flash


def _flash_attn_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # lazy: optional GPU dependency, probed when chosen

        return flash_attn_varlen_func
    except ImportError:
        return None


def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: only in newer torch releases, probed when chosen
    except ImportError:
        return None
    return varlen_attn


def gpu_varlen_backend(dtype: torch.dtype) -> str | None:
    """Which varlen flash kernel serves THD attention on this GPU: "flash_attn", "torch", or None
    (fp32, or neither available: the grouped SDPA path)."""
    if not torch.cuda.is_available() or dtype not in (torch.float16, torch.bfloat16):
        return None
    if _flash_attn_varlen() is not None:
        return "flash_attn"
    if _torch_varlen() is not None:
        return "torch"
    return None


def gpu_varlen_attention(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """[t, np, hn] varlen flash attention (GQA natively)."""
    cu = cu.to(device=q.device, dtype=torch.int32)
    if backend == "flash_attn":
        return _flash_attn_varlen()(
            q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=causal
        )
    varlen_attn = _torch_varlen()
    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale * math.sqrt(q.size(-1)) - 1.0) > 1e-6:  # older signature: default scale only
        q = q * (scale * math.sqrt(q.size(-1)))
    if "is_causal" in params:  # torch 2.10
        kw["is_causal"] = causal
    elif causal:  # torch >= 2.12 spells causal as a (left, right) window
        kw["window_size"] = (-1, 0)
    if q.size(1) != k.size(1):
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)


# ----------------------------------------------------------------------------- the module


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1 and not self.handles_context_parallel:
            raise NotImplementedError(
                "SDPACoreAttention runs whole sequences; context parallelism needs "
                "KVAllGatherCoreAttention (CPU) or TEDotProductAttention (GPU)"
            )
        self.attn_mask_type = attn_mask_type
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.pg_collection = pg_collection  # the CP subclass reads its group from it

    #: subclasses that split sequences over the CP group set this
    handles_context_parallel = False

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn]."""
        dropout = self._dropout()
        gqa = q.size(1) != k.size(1)
        if mask is not None:
            causal = False
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=causal,
                    scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        self._check_inputs(mask_type, attention_bias, thd)
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

        if thd:
            return self._thd(query, key, value, packed_seq_params, causal)

        # [s, b, np, hn] -> [b, np, s, hn]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask = None
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            # megatron convention: True = masked out; SDPA: True = may attend
            mask = ~attention_mask
        out = self._sdpa(q, k, v, causal, mask)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _check_inputs(self, mask_type: AttnMaskType, attention_bias: Optional[torch.Tensor], thd: bool) -> None:
        """What this attention cannot run, refused before any work."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")

    def _thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams, causal: bool
    ) -> torch.Tensor:
        """[t, np, hn] packed sequences -> [t, np*hn]."""
        backend = gpu_varlen_backend(query.dtype) if query.is_cuda else None
        dropout = self._dropout()
        if backend == "torch" and dropout > 0.0:  # PyTorch's varlen kernel has no dropout
            backend = None
        if backend is not None:
            # the dropout mask from megatron's model-parallel RNG tracker (not under sequence parallelism)
            fork = dropout > 0.0 and not self.config.sequence_parallel
            with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
                out = gpu_varlen_attention(
                    backend,
                    query,
                    key,
                    value,
                    params.cu_seqlens_q,
                    params.max_seqlen_q,
                    causal=causal,
                    scale=self.softmax_scale,
                    dropout=dropout,
                )
        else:
            out = grouped_varlen_sdpa(
                query, key, value, varlen_plan(params), causal=causal, scale=self.softmax_scale, sdpa=self._sdpa
            )
        return out.reshape(out.size(0), -1)
