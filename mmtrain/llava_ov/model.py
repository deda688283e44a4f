"""`LlavaOVModel`: SigLIP (megatron TransformerBlock) + mlp2x_gelu projector + the LLaVA-OV
feature layout + the shared Qwen2 decoder (`mmtrain.models.language_model`: a megatron-core
`GPTModel` on the local spec: RMSNorm, SwiGLU, GQA with qkv bias, RoPE theta 1e6, tied
embeddings).

Why not megatron's `LLaVAModel`: it assumes every tile yields the same number of LLM positions,
while LLaVA-OV unpads, shrinks and inserts newline features per image. We compose megatron's
pieces instead and put the layout (`layout.py`) between the projector and the decoder.

Packed sequences run in megatron's THD layout (`language_model.packed_seq_params`).

Pipeline parallelism: the vision tower, projector, layout and embedding live on the first stage
(`pre_process`), the output layer / loss on the last (`post_process`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.layout import pack_media_features
from mmtrain.llava_ov.projector import build_projector, projector_transformer_config
from mmtrain.llava_ov.vision import SiglipVisionModel, vision_transformer_config
from mmtrain.models.language_model import (
    build_language_model,
    decoder_output,
    embed_packed,
    restore_tp_attributes,
    sequence_parallel_input,
)
from mmtrain.models.megatron_config import ParallelOptions, base_config_kwargs, language_transformer_config


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
        options: Optional[ParallelOptions] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        if cfg.image_token_id is None or cfg.video_token_id is None:
            raise ValueError("model.image_token_id / video_token_id are null: they are read from the tokenizer "
                             "before a run starts (or pin them in the recipe)")
        opts = options or ParallelOptions()
        lm_config = language_transformer_config(cfg.llm, cfg.params_dtype, opts)
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
            # the vision tower and projector run whole on the first stage: no SP, no PP split
            base = base_config_kwargs(cfg.params_dtype, opts, sequence_parallel=False) | {"pipeline_model_parallel_size": 1}
            self.vision_model = SiglipVisionModel(cfg.vision, vision_transformer_config(cfg.vision, base))
            self.vision_projection = build_projector(cfg, projector_transformer_config(cfg, base))
            self.image_newline = torch.nn.Parameter(
                torch.randn(cfg.llm.hidden_size, dtype=lm_config.params_dtype) / cfg.llm.hidden_size**0.5
            )

        self.language_model = build_language_model(
            cfg.llm, lm_config, vocab_size=self.padded_vocab_size, pre_process=pre_process,
            post_process=post_process, vp_stage=vp_stage,
        )
        if not opts.perform_initialization:
            restore_tp_attributes(self)

    # ------------------------------------------------------------------ megatron plumbing
    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

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
        emb = embed_packed(self.language_model, ids)  # [B*S, 1, h]
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
        return sequence_parallel_input(emb, self.config)

    # ------------------------------------------------------------------ forward
    def forward(self, batch: LlavaOVBatch, return_logits: bool = False) -> torch.Tensor:
        decoder_input = self._decoder_input(batch) if self.pre_process else None
        return decoder_output(self.language_model, decoder_input, batch.labels, batch.cu_seqlens, batch.max_seqlen,
                              true_vocab=self.cfg.llm.vocab_size, return_logits=return_logits)
