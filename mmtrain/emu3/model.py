"""`Emu3Model`: Emu3's decoder, one pipeline stage of a megatron-core `GPTModel` built by the
shared `mmtrain.models.language_model` (local spec: RMSNorm, SwiGLU, GQA without qkv bias, RoPE,
untied output layer). Emu3 has no encoder: images reach it as VQ visual tokens already in
`input_ids` (mmdata.energon_loaders.emu3), so a stage embeds tokens on the first stage and runs
the decoder through the shared `packed_decoder_forward` (context parallelism, sequence
parallelism and the memory-lean loss over the true, unpadded vocabulary, as every family).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.emu3.config import Emu3ModelConfig
from mmtrain.models.context_parallel import current_layout
from mmtrain.models.language_model import build_language_model, packed_decoder_forward, restore_tp_attributes
from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config


class Emu3Model(MegatronModule):
    """One pipeline stage of Emu3.

    `forward(batch)` returns, on the last stage, the per-token loss `[B, S]` (0 where the label
    is IGNORE_INDEX and at positions other CP ranks hold) or, with `return_logits=True`, logits
    `[B, S, vocab]` gathered over TP and cut to the true vocabulary; on other stages the hidden
    states for the next stage.
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
            post_process=post_process, vp_stage=vp_stage, loss_impl=opts.lm_loss, loss_block_mb=opts.lm_loss_block_mb,
        )
        if not opts.perform_initialization:
            restore_tp_attributes(self)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def forward(self, batch: PackedBatch, return_logits: bool = False) -> torch.Tensor:
        # this CP rank's share of the stream (the identity without CP); the shared decoder
        # forward embeds it, scatters it for SP and computes the lean loss
        return packed_decoder_forward(self.language_model, batch, current_layout(batch.cu_seqlens),
                                      return_logits=return_logits)
