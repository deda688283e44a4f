"""megatron-core layer specs: the pre-norm transformer layer on local modules that every tower uses
(causal decoders, bidirectional encoders), the plain MLP, and the decoder's Transformer Engine spec
(`parallel.transformer_impl: transformer_engine`, docs/gpu.md "The decoder layer spec switch").

The parameter names these produce (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`,
`input_layernorm`, `pre_mlp_layernorm`) are the ones the state-dict adapters map.
"""

from __future__ import annotations

import logging

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmtrain.models import te_support
from mmtrain.models.attention import SDPACoreAttention
from mmtrain.models.cp_attention import KVAllGatherCoreAttention
from mmtrain.models.device import compute_device
from mmtrain.models.norm import TorchNorm
from mmtrain.models.packed_rope import PackedRoPESelfAttention


def _run_on_cuda() -> bool:
    """The run's device, as the runtime set it up (the process group's backend), not whether a
    GPU happens to be visible."""
    return compute_device().type == "cuda"


_logged_te_fallback = False


def te_attention(on_cuda: bool | None = None) -> type | None:
    """Transformer Engine's attention on a CUDA run with a real TE (te_support: megatron's own
    import binds a MagicMock without TE), else None. `on_cuda`: the run's device
    (default: read off the runtime's process group)."""
    global _logged_te_fallback
    if not (_run_on_cuda() if on_cuda is None else on_cuda):
        return None
    te = te_support.te_dot_product_attention()
    if te is None and not _logged_te_fallback:
        _logged_te_fallback = True
        logging.getLogger(__name__).warning(
            "Transformer Engine unusable (%s): SDPA / varlen-flash attention, no context parallelism",
            te_support.te_status().reason,
        )
    return te


def core_attention_module(context_parallel: bool = False, on_cuda: bool | None = None) -> type:
    """The core attention of a layer.

    GPU: TE's fused attention when installed (THD packed sequences, and megatron's
    context-parallel path with `parallel.cp_comm_type`); without TE, `SDPACoreAttention` (varlen
    flash attention for packed sequences) - and context parallelism is refused. CPU:
    `SDPACoreAttention`, or `KVAllGatherCoreAttention` under context parallelism."""
    on_cuda = _run_on_cuda() if on_cuda is None else on_cuda
    te = te_attention(on_cuda)
    if te is not None:
        return te
    if context_parallel:
        if on_cuda:
            raise RuntimeError(
                f"parallel.cp > 1 on GPU needs Transformer Engine (megatron's context-parallel "
                f"attention; {te_support.te_status().reason}): pip install transformer-engine[pytorch], "
                "or set parallel.cp=1"
            )
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
                module=PackedRoPESelfAttention,  # THD RoPE without host syncs (packed_rope.py)
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


def te_layer_classes() -> tuple[type, type, type]:
    """megatron's (TELayerNormColumnParallelLinear, TERowParallelLinear, TEDotProductAttention),
    refusing when TE is not really usable (megatron binds MagicMocks then, see te_support)."""
    st = te_support.te_status()
    if not st.available:
        raise RuntimeError(f"the Transformer Engine decoder spec needs Transformer Engine: {st.reason}")
    # optional dependency: megatron's TE extension imports TE (or binds mocks and warns) - only here
    from megatron.core.extensions import transformer_engine as mte

    return mte.TELayerNormColumnParallelLinear, mte.TERowParallelLinear, mte.TEDotProductAttention


def te_decoder_layer_spec() -> ModuleSpec:
    """The causal decoder layer on TE modules (`parallel.transformer_impl: transformer_engine`),
    the layout of megatron 0.16's `get_gpt_layer_with_transformer_engine_spec()` for a dense
    model: the pre-norms fold into the following linear (fused RMSNorm+GEMM; the layer norm
    follows `config.normalization`, "RMSNorm"), so `input_layernorm` / `pre_mlp_layernorm` are
    IdentityOp and their weights live at `linear_qkv.layer_norm_weight` /
    `linear_fc1.layer_norm_weight` (the state-dict adapters map those names). TE's attention
    handles THD and context parallelism itself."""
    norm_linear, row_linear, attention = te_layer_classes()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=norm_linear,
                    core_attention=attention,
                    linear_proj=row_linear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=norm_linear, linear_fc2=row_linear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_layer_spec(transformer_impl: str, context_parallel: bool = False) -> ModuleSpec:
    """The decoder's layer: the TE spec when `transformer_impl` is "transformer_engine" (already
    validated against the run by megatron_config.decoder_fusions), else the local one."""
    if transformer_impl == "transformer_engine":
        return te_decoder_layer_spec()
    return transformer_layer_spec(causal=True, context_parallel=context_parallel)


def mlp_submodules() -> MLPSubmodules:
    """Column-parallel in, row-parallel out (the layers' MLP; also a standalone projector's)."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
