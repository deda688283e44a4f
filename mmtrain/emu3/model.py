"""`Emu3Model`: Emu3's decoder, one pipeline stage of a megatron-core `GPTModel` built by the
shared `mmtrain.models.language_model` (local spec: RMSNorm, SwiGLU, GQA without qkv bias, RoPE,
untied output layer). Emu3 has no encoder: images reach it as VQ visual tokens already in
`input_ids` (mmdata.energon_loaders.emu3), so a stage embeds tokens on the first stage and runs
the decoder; the vocabulary is padded for TP and the loss is masked to the true vocabulary.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.emu3.config import Emu3ModelConfig
from mmtrain.models.language_model import (
    build_language_model,
    decoder_output,
    embed_packed,
    restore_tp_attributes,
    sequence_parallel_input,
)
from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config


class Emu3Model(MegatronModule):
    """One pipeline stage of Emu3.

    `forward(batch)` returns, on the last stage, the per-token loss `[B, S]` (0 where the label
    is IGNORE_INDEX) or, with `return_logits=True`, logits `[B, S, vocab]` gathered over TP and
    cut to the true vocabulary; on other stages the hidden states for the next stage.
    """

    def __init__(
        self,
        cfg: Emu3ModelConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        options: Optional[ParallelOptions] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        opts = options or ParallelOptions()
        lm_config = language_transformer_config(cfg.llm, cfg.params_dtype, opts)
        super().__init__(config=lm_config)
        self.cfg = cfg
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = cfg.llm.tie_word_embeddings
        self.padded_vocab_size = cfg.padded_vocab_size(parallel_state.get_tensor_model_parallel_world_size())
        self.language_model = build_language_model(
            cfg.llm, lm_config, vocab_size=self.padded_vocab_size, pre_process=pre_process,
            post_process=post_process, vp_stage=vp_stage,
        )
        if not opts.perform_initialization:
            restore_tp_attributes(self)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def forward(self, batch: PackedBatch, return_logits: bool = False) -> torch.Tensor:
        decoder_input = None
        if self.pre_process:
            decoder_input = sequence_parallel_input(embed_packed(self.language_model, batch.input_ids), self.config)
        return decoder_output(self.language_model, decoder_input, batch.labels, batch.cu_seqlens, batch.max_seqlen,
                              true_vocab=self.cfg.llm.vocab_size, return_logits=return_logits)
