"""megatron-core layer specs on local modules (no TE/apex): the pre-norm transformer layer
every tower uses (causal decoders, bidirectional encoders) and the plain MLP.

The parameter names these produce (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`,
`input_layernorm`, `pre_mlp_layernorm`) are the ones the state-dict adapters map.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmtrain.models.attention import SDPACoreAttention
from mmtrain.models.norm import TorchNorm


def core_attention_module() -> type:
    """SDPA everywhere unless Transformer Engine is importable (GPU): then TE's fused attention."""
    try:
        import torch

        if torch.cuda.is_available():
            from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: F401

            return TEDotProductAttention
    except Exception:  # TE not installed: SDPA (flash kernels on GPU via PyTorch)
        pass
    return SDPACoreAttention


def transformer_layer_spec(causal: bool) -> ModuleSpec:
    """Pre-norm transformer layer; `causal` False for encoders (bidirectional attention)."""
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
                    core_attention=core_attention_module(),
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
