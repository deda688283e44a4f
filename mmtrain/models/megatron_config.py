"""megatron `TransformerConfig`s for the local (CPU-capable, no TE/apex fusions) layer specs.

`ParallelOptions` carries what a model builder needs to know about the run's parallelism and
memory settings (sizes come from megatron's `parallel_state`); `base_config_kwargs` is the part
of every TransformerConfig that follows from it; `language_transformer_config` the decoder's
config from HF-style sizes (`LLMConfig`). A family's own towers (e.g. a vision encoder) build
their configs on `base_config_kwargs` as well: they run whole sequences (context_parallel_size 1)
even when the decoder is context-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.models.lm_config import LLMConfig

#: the model configs' `params_dtype` spellings
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParallelOptions:
    """The parallelism / memory knobs the model needs (sizes come from megatron parallel_state)."""

    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = "uniform"
    recompute_num_layers: Optional[int] = 1
    params_dtype: Optional[str] = None  # overrides the model config's params_dtype
    # False when every weight is loaded right after building (conversion, inference): skips the
    # random init and its transient master-weight copies
    perform_initialization: bool = True
    # the LM loss: "chunked" (blocked output projection + CE, lm_loss.py), "fused" (a GPU kernel),
    # "plain" (megatron's full-logits output layer); the runtime resolves the recipe's "auto"
    lm_loss: str = "chunked"
    lm_loss_block_mb: int = 256
    # megatron/TE context-parallel communication (GPU): p2p | all_gather | a2a | a2a+p2p
    cp_comm_type: str = "p2p"
    hierarchical_cp_sizes: Optional[list[int]] = None  # a2a+p2p: [a2a size, p2p size]


def base_config_kwargs(params_dtype: str, opts: ParallelOptions, *, sequence_parallel: bool) -> dict:
    """TransformerConfig arguments every tower of a model shares (`params_dtype`: the model
    config's, unless `opts` overrides it)."""
    dtype = DTYPES[opts.params_dtype or params_dtype]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        init_method_std=0.02,
        perform_initialization=opts.perform_initialization,
    )


def language_transformer_config(llm: LLMConfig, params_dtype: str, opts: ParallelOptions) -> TransformerConfig:
    """The decoder: RMSNorm, SwiGLU, GQA, no linear biases except the optional qkv bias. It is
    the tower that runs context-parallel (the CP size comes from megatron's parallel_state)."""
    kw = base_config_kwargs(params_dtype, opts, sequence_parallel=opts.sequence_parallel)
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        kw.update(context_parallel_size=cp, cp_comm_type=opts.cp_comm_type)
        if opts.hierarchical_cp_sizes:
            kw.update(hierarchical_context_parallel_sizes=list(opts.hierarchical_cp_sizes))
    if opts.recompute_granularity:
        kw.update(recompute_granularity=opts.recompute_granularity)
        if opts.recompute_granularity == "full":
            kw.update(recompute_method=opts.recompute_method, recompute_num_layers=opts.recompute_num_layers)
    return TransformerConfig(
        num_layers=llm.num_layers,
        hidden_size=llm.hidden_size,
        ffn_hidden_size=llm.ffn_hidden_size,
        num_attention_heads=llm.num_attention_heads,
        num_query_groups=llm.num_query_groups,
        kv_channels=llm.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=llm.rms_norm_eps,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=llm.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **kw,
    )
