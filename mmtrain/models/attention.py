"""Core attention for the local (non-Transformer-Engine) layer specs: PyTorch SDPA.

Why our own module: megatron's local `DotProductAttention` refuses packed sequences
(`packed_seq_params`) and forks the CUDA RNG; TE is GPU-only. This module keeps megatron's
core-attention contract (same constructor and call signature, [s, b, np, hn] in, [s, b, np*hn]
out; THD [t, np, hn] in when `packed_seq_params.qkv_format == "thd"`) and runs
`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU,
the fused CPU kernel on CPU). Packed samples never attend across their boundaries: THD input is
processed one `cu_seqlens` segment at a time, so no S x S mask is ever materialised.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
        if config.context_parallel_size > 1:
            raise NotImplementedError("SDPACoreAttention does not implement context parallelism")
        self.attn_mask_type = attn_mask_type
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn]."""
        dropout = self.dropout_p if self.training else 0.0
        gqa = q.size(1) != k.size(1)
        if mask is not None:
            causal = False
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                    scale=self.softmax_scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=gqa)

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
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, np, hn]; one segment at a time keeps packed samples apart
            cu = packed_seq_params.cu_seqlens_q
            bounds = cu.tolist()
            outs = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end <= start:
                    continue
                q = query[start:end].transpose(0, 1).unsqueeze(0)
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
                outs.append(self._sdpa(q, k, v, causal)[0].transpose(0, 1))
            out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
            return out.reshape(out.size(0), -1)

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
