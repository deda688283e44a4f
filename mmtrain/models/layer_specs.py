"""megatron-core layer specs on local modules (no TE/apex): the pre-norm transformer layer
every tower uses (causal decoders, bidirectional encoders) and the plain MLP.

The parameter names these produce (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`,
`input_layernorm`, `pre_mlp_layernorm`) are the ones the state-dict adapters map.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmtrain.models.attention import SDPACoreAttention
from mmtrain.models.cp_attention import KVAllGatherCoreAttention
from mmtrain.models.norm import TorchNorm


def te_attention() -> type | None:
    """Transformer Engine's attention when TE is importable on a GPU machine, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except Exception:  # TE not installed (or broken): our SDPA / varlen-flash attention
        return None
    return TEDotProductAttention


def core_attention_module(context_parallel: bool = False) -> type:
    """The core attention of a layer.

    GPU: TE's fused attention when installed (THD packed sequences, and megatron's
    context-parallel path with `parallel.cp_comm_type`); without TE, `SDPACoreAttention` (varlen
    flash attention for packed sequences) - and context parallelism is refused. CPU:
    `SDPACoreAttention`, or `KVAllGatherCoreAttention` under context parallelism."""
    te = te_attention()
    if te is not None:
        return te
    if context_parallel:
        if torch.cuda.is_available():
            raise RuntimeError("parallel.cp > 1 on GPU needs Transformer Engine (megatron's context-parallel "
                               "attention): pip install transformer-engine[pytorch], or set parallel.cp=1")
        return KVAllGatherCoreAttention
    return SDPACoreAttention


def transformer_layer_spec(causal: bool, context_parallel: bool = False) -> ModuleSpec:
    """Pre-norm transformer layer; `causal` False for encoders (bidirectional attention);
    `context_parallel` when the layer's sequence is split over the CP group."""
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention_module(context_parallel),
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=mlp_submodules(),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def mlp_submodules() -> MLPSubmodules:
    """Column-parallel in, row-parallel out (the layers' MLP; also a standalone projector's)."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
