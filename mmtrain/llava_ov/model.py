"""`LlavaOVModel`: SigLIP (megatron TransformerBlock) + mlp2x_gelu projector + the LLaVA-OV
feature layout + a Qwen2 decoder built as a megatron-core `GPTModel` (local spec: RMSNorm,
SwiGLU, GQA with qkv bias, RoPE theta 1e6, tied embeddings).

Why not megatron's `LLaVAModel`: it assumes every tile yields the same number of LLM positions,
while LLaVA-OV unpads, shrinks and inserts newline features per image. We compose megatron's
pieces instead and put the layout (`layout.py`) between the projector and the decoder.

Packed sequences run in megatron's THD layout: the [B, S] batch is flattened to one [B*S] stream
and `cu_seqlens` (one segment per packed sample / padding run) drives both RoPE (positions
restart per segment) and attention (no attention across segments), exactly as TE/flash-attn do
on GPU.

Pipeline parallelism: the vision tower, projector, layout and embedding live on the first stage
(`pre_process`), the output layer / loss on the last (`post_process`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from mmdata.energon_loaders.batch import IGNORE_INDEX, LlavaOVBatch
from mmtrain.device import enable_cpu_compat
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.layer_specs import transformer_layer_spec
from mmtrain.llava_ov.layout import pack_media_features
from mmtrain.llava_ov.norm import TorchNorm
from mmtrain.llava_ov.projector import build_projector, projector_transformer_config
from mmtrain.llava_ov.vision import SiglipVisionModel, vision_transformer_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParallelOptions:
    """The parallelism / memory knobs the model needs (sizes come from megatron parallel_state)."""

    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = "uniform"
    recompute_num_layers: Optional[int] = 1
    params_dtype: Optional[str] = None  # overrides model.params_dtype
    # False when every weight is loaded right after building (conversion, inference): skips the
    # random init and its transient master-weight copies
    perform_initialization: bool = True


def _options(parallel_ctx: Any) -> ParallelOptions:
    if parallel_ctx is None:
        return ParallelOptions()
    if isinstance(parallel_ctx, ParallelOptions):
        return parallel_ctx
    src = parallel_ctx if isinstance(parallel_ctx, dict) else vars(parallel_ctx)
    fields = ParallelOptions.__dataclass_fields__
    return ParallelOptions(**{k: v for k, v in src.items() if k in fields})


def base_config_kwargs(cfg: LlavaOVModelConfig, opts: ParallelOptions, *, sequence_parallel: bool) -> dict:
    dtype = _DTYPES[opts.params_dtype or cfg.params_dtype]
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


def language_transformer_config(cfg: LlavaOVModelConfig, opts: ParallelOptions) -> TransformerConfig:
    llm = cfg.llm
    kw = base_config_kwargs(cfg, opts, sequence_parallel=opts.sequence_parallel)
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


def build_language_model(
    cfg: LlavaOVModelConfig,
    lm_config: TransformerConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    vocab_size: Optional[int] = None,
    parallel_output: bool = True,
) -> GPTModel:
    """The Qwen2 decoder as a megatron `GPTModel` (also used alone for Qwen2 parity/conversion)."""
    block = TransformerBlockSubmodules(
        layer_specs=[transformer_layer_spec(causal=True)] * get_num_layers_to_build(lm_config, vp_stage=vp_stage),
        layer_norm=TorchNorm,
    )
    theta = cfg.llm.rope_theta
    return GPTModel(
        config=lm_config,
        transformer_layer_spec=block,
        vocab_size=vocab_size or cfg.padded_vocab_size(parallel_state.get_tensor_model_parallel_world_size()),
        max_sequence_length=cfg.llm.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=cfg.llm.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        scatter_embedding_sequence_parallel=False,
        vp_stage=vp_stage,
    )


def restore_tp_attributes(module: torch.nn.Module) -> None:
    """megatron tags TP-sharded weights (`tensor_model_parallel`, `partition_dim`) only while
    initialising them on CPU; with `perform_initialization=False` tag them here, so grad clipping,
    DDP and our converters see the same metadata either way."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tensor_model_parallel_attributes,
    )

    for m in module.modules():
        dim = {ColumnParallelLinear: 0, RowParallelLinear: 1, VocabParallelEmbedding: 0}.get(type(m))
        w = getattr(m, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter) and not hasattr(w, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(w, True, dim, 1)


class LlavaOVModel(MegatronModule):
    """One pipeline stage of LLaVA-OV.

    `forward(batch)` returns, on the last stage, the per-token loss `[B, S]` (0 where the label is
    IGNORE_INDEX) or, with `return_logits=True`, logits `[B, S, vocab]` gathered over TP and cut
    to the true vocabulary; on other stages the hidden states for the next stage.
    """

    def __init__(
        self,
        cfg: LlavaOVModelConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        parallel_ctx: Any = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        enable_cpu_compat()
        opts = _options(parallel_ctx)
        lm_config = language_transformer_config(cfg, opts)
        super().__init__(config=lm_config)
        self.cfg = cfg
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = cfg.llm.tie_word_embeddings
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.padded_vocab_size = cfg.padded_vocab_size(self.tp_size)

        self.vision_model: Optional[SiglipVisionModel] = None
        self.vision_projection = None
        if pre_process:
            vcfg = vision_transformer_config(cfg.vision, base_config_kwargs(cfg, opts, sequence_parallel=False) | {"pipeline_model_parallel_size": 1})
            self.vision_model = SiglipVisionModel(cfg.vision, vcfg)
            pcfg = projector_transformer_config(cfg, base_config_kwargs(cfg, opts, sequence_parallel=False) | {"pipeline_model_parallel_size": 1})
            self.vision_projection = build_projector(cfg, pcfg)
            self.image_newline = torch.nn.Parameter(
                torch.randn(cfg.llm.hidden_size, dtype=lm_config.params_dtype) / cfg.llm.hidden_size**0.5
            )

        self.language_model = build_language_model(
            cfg, lm_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
            vocab_size=self.padded_vocab_size,
        )
        if not opts.perform_initialization:
            restore_tp_attributes(self)

    # ------------------------------------------------------------------ megatron plumbing
    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def freeze(self, *, vision: bool = False, projector: bool = False, language: bool = False) -> None:
        """Stage freezing (LLaVA-OV stage 1: everything but the projector)."""
        for module, flag in ((self.vision_model, vision), (self.vision_projection, projector),
                             (self.language_model, language)):
            if module is not None and flag:
                for p in module.parameters():
                    p.requires_grad_(False)
        if language and self.pre_process:
            self.image_newline.requires_grad_(False)

    # ------------------------------------------------------------------ pieces
    def media_embeddings(self, batch: LlavaOVBatch) -> torch.Tensor:
        """Projected + laid-out features of every media of the batch, [positions, hidden]."""
        assert self.vision_model is not None and self.vision_projection is not None
        feats = self.vision_model(batch.pixel_values)
        feats = self.vision_projection(feats)
        return pack_media_features(
            feats, batch.tiles_per_media, batch.media_kind, batch.image_sizes,
            batch.grid_shapes, self.image_newline, self.cfg, batch.num_media_tokens,
        )

    def _decoder_input(self, batch: LlavaOVBatch) -> torch.Tensor:
        ids = batch.input_ids.reshape(1, -1)  # THD: one stream
        emb = self.language_model.embedding(input_ids=ids, position_ids=None)  # [B*S, 1, h]
        media_mask = (ids[0] == self.cfg.image_token_id) | (ids[0] == self.cfg.video_token_id)
        n_pos = int(media_mask.sum())
        if batch.pixel_values is not None and batch.pixel_values.numel() > 0:
            media = self.media_embeddings(batch).to(emb.dtype)
            if media.shape[0] != n_pos:
                raise ValueError(
                    f"input_ids hold {n_pos} image/video placeholder tokens but the media give {media.shape[0]} features"
                )
            emb = emb.clone()
            emb[media_mask.nonzero(as_tuple=True)[0], 0] = media
        elif n_pos:
            raise ValueError(f"input_ids hold {n_pos} image/video placeholder tokens but the batch has no pixel_values")
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    @staticmethod
    def packed_seq_params(batch: LlavaOVBatch) -> PackedSeqParams:
        cu = batch.cu_seqlens.to(torch.int32)
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            max_seqlen_q=int(batch.max_seqlen), max_seqlen_kv=int(batch.max_seqlen),
        )

    # ------------------------------------------------------------------ forward
    def forward(self, batch: LlavaOVBatch, return_logits: bool = False) -> torch.Tensor:
        b, s = batch.input_ids.shape
        decoder_input = self._decoder_input(batch) if self.pre_process else None
        labels = None
        # padded vocab rows would enter the softmax with logit 0: mask them (only when padded)
        mask_pad = self.padded_vocab_size > self.cfg.llm.vocab_size
        if self.post_process and not return_logits and not mask_pad:
            labels = batch.labels.reshape(1, -1).clamp(min=0)  # IGNORE_INDEX masked below
        out = self.language_model(
            input_ids=None,
            position_ids=None,
            attention_mask=None,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=self.packed_seq_params(batch),
            runtime_gather_output=True if return_logits else None,
        )
        if not self.post_process:
            return out
        if return_logits:
            return out.reshape(b, s, -1)[..., : self.cfg.llm.vocab_size]
        if mask_pad:
            out = self._vocab_parallel_loss(out, batch.labels.reshape(1, -1).clamp(min=0))
        loss = out.reshape(b, s)
        return loss * (batch.labels != IGNORE_INDEX).to(loss.dtype)

    def _vocab_parallel_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy over the TRUE vocabulary: logits [1, T, V/tp] (this rank's slice)."""
        part = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * part
        cols = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(cols >= self.cfg.llm.vocab_size, float("-inf"))
        return tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.transpose(0, 1)).transpose(0, 1)
