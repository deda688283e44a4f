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
from mmtrain.models.pipeline_split import PipelineSplit
from mmtrain.models.te_support import apex_wgrad_fusion_available, te_status

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
    # the decoder's layer spec (megatron's `transformer_impl` wording): "local" (torch/megatron
    # modules, runs anywhere) or "transformer_engine" (TE fused norm+linear, fused THD RoPE,
    # wgrad fusion; CUDA + TE only). The towers always use the local spec.
    transformer_impl: str = "local"
    # the run's device (the runtime's, never torch.cuda.is_available()); decides the TE spec
    on_cuda: bool = False
    # train.deterministic: TransformerConfig.deterministic_mode (the runtime also sets
    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, which megatron requires with it)
    deterministic: bool = False
    # parallel.vision.tp: a media encoder's own TP (1 or the decoder's), its tiles split over the
    # ranks that share a micro-batch (models/encoder_parallel.py); None: the decoder's layout
    encoder_tp: Optional[int] = None
    # the decoder's layers per pipeline stage and virtual stage (parallel.pp_layers / vpp,
    # models/pipeline_split.py); None: megatron's even split, one chunk per stage
    pipeline_split: Optional[PipelineSplit] = None


TRANSFORMER_IMPLS = ("local", "transformer_engine")


class TransformerImplUnavailable(RuntimeError):
    """`parallel.transformer_impl: transformer_engine` asked for where TE cannot run."""


@dataclass(frozen=True)
class DecoderFusions:
    """Which megatron fusions the decoder's TransformerConfig turns on (one decision, CPU-testable)."""

    use_te_spec: bool = False
    apply_rope_fusion: bool = False  # TE's fused THD RoPE (megatron's unfused path syncs ~112x/forward)
    # SwiGLU only: the towers' tanh/erf GELU must stay unfused. megatron's `jit_fuser` is
    # torch.compile: rows are padded to seq_length, so without CP the THD length
    # never changes (one compile); under CP a rank's share does, and dynamo compiles the first
    # length, then one shape-generic graph, and never again. Kept on (test_te_spec.py)
    bias_activation_fusion: bool = False
    # wgrad accumulated straight into main_grad. TE's linears do it with TE's own kernels, but
    # megatron's output layer is always the local ColumnParallelLinear, which needs apex's
    # extension for it and raises at build without it: on only where apex imports
    gradient_accumulation_fusion: bool = False

    def config_kwargs(self) -> dict:
        return dict(
            apply_rope_fusion=self.apply_rope_fusion,
            bias_activation_fusion=self.bias_activation_fusion,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        )


def decoder_fusions(
    on_cuda: bool, te_available: bool, transformer_impl: str, te_reason: str = "", apex_wgrad: Optional[bool] = None
) -> DecoderFusions:
    """The decoder's fusions from (the run is on CUDA?, TE usable?, the recipe's switch, apex's
    wgrad extension importable? - None: ask `te_support.apex_wgrad_fusion_available`).
    "local" keeps everything off (today's behaviour, the default until the gpu tier has passed
    with the switch on); "transformer_engine" refuses loudly where it cannot run.

    `gradient_accumulation_fusion` is one field of the one config that GPTModel hands to its
    layers and to its local output layer alike, so it goes on only where that output layer can
    build (apex present). Without apex TE's linears write wgrad to `.grad` and megatron's DDP
    hook adds it to `main_grad`: megatron's unfused path, one extra add per weight."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"parallel.transformer_impl={transformer_impl!r}: expected one of {list(TRANSFORMER_IMPLS)}")
    if transformer_impl == "local":
        return DecoderFusions()
    if not on_cuda:
        raise TransformerImplUnavailable(
            "parallel.transformer_impl=transformer_engine needs a CUDA run (this run is on "
            "CPU); set parallel.transformer_impl=local"
        )
    if not te_available:
        raise TransformerImplUnavailable(
            "parallel.transformer_impl=transformer_engine needs Transformer Engine: "
            f"{te_reason or 'not available'}; set parallel.transformer_impl=local"
        )
    wgrad = apex_wgrad_fusion_available() if apex_wgrad is None else apex_wgrad
    return DecoderFusions(
        use_te_spec=True, apply_rope_fusion=True, bias_activation_fusion=True, gradient_accumulation_fusion=wgrad
    )


def resolve_decoder_fusions(opts: "ParallelOptions") -> DecoderFusions:
    """`decoder_fusions` for these options, asking te_support only when the switch is on."""
    if opts.transformer_impl == "local":
        return decoder_fusions(opts.on_cuda, False, "local")
    st = te_status()
    return decoder_fusions(opts.on_cuda, st.available, opts.transformer_impl, st.reason)


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
        use_cpu_initialization=not opts.on_cuda,  # the run's device, not torch.cuda.is_available()
        deterministic_mode=opts.deterministic,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        transformer_impl="local",  # megatron defaults to "transformer_engine"; only the decoder may switch
        init_method_std=0.02,
        perform_initialization=opts.perform_initialization,
    )


def pipeline_split_kwargs(split: Optional[PipelineSplit]) -> dict:
    """The decoder's TransformerConfig fields for an uneven split and virtual stages: megatron's
    `pipeline_model_parallel_layout` (global layer numbers follow it) and
    `virtual_pipeline_model_parallel_size`. Only the decoder is split: the towers on the first
    stage keep `pipeline_model_parallel_size` 1.

    The interleaved schedule gets megatron-LM's p2p settings for it (`--overlap-p2p-communication`,
    its default): unbatched sends and receives. With pp = 2 both neighbours of a rank are the same
    rank, and a batched call that sends to it in both directions at once is matched in issue
    order, handing activations to the gradient buffer; the unbatched path sends the two directions
    on two process groups (p2p_communication._p2p_ops)."""
    if split is None:
        return {}
    kw: dict = {}
    if split.vpp > 1:
        kw.update(virtual_pipeline_model_parallel_size=split.vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    if split.explicit:
        kw["pipeline_model_parallel_layout"] = split.megatron_layout()
    return kw


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
    kw.update(resolve_decoder_fusions(opts).config_kwargs())  # decoder only: SwiGLU (the towers keep GELU unfused)
    kw.update(pipeline_split_kwargs(opts.pipeline_split))
    # megatron's own field; build_language_model reads it to pick the decoder's layer spec
    kw.update(transformer_impl=opts.transformer_impl)
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
