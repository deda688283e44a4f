"""`Emu3Model`: Emu3's decoder, one pipeline stage of a megatron-core `GPTModel` built by the
shared `mmtrain.models.language_model` (local spec: RMSNorm, SwiGLU, GQA without qkv bias, RoPE,
untied output layer). Emu3 has no encoder: images reach it as VQ visual tokens already in
`input_ids` (mmdata.energon_loaders.emu3), so a stage embeds tokens on the first stage and runs
the decoder through the shared `packed_decoder_forward` (context parallelism, sequence
parallelism and the memory-lean loss over the true, unpadded vocabulary, as every family).
"""

from __future__ import annotations

import torch

from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.models.context_parallel import current_layout
from mmtrain.models.language_model import packed_decoder_forward
from mmtrain.models.stage_model import DecoderStageModel


class Emu3Model(DecoderStageModel):
    """One pipeline stage of Emu3.

    `forward(batch)` returns, on the last stage, the per-token loss `[B, S]` (0 where the label
    is IGNORE_INDEX and at positions other CP ranks hold) or, with `return_logits=True`, logits
    `[B, S, vocab]` gathered over TP and cut to the true vocabulary; on other stages the hidden
    states for the next stage. Built by `DecoderStageModel` from an `Emu3ModelConfig`: Emu3 has
    nothing but the decoder.
    """

    def forward(self, batch: PackedBatch, return_logits: bool = False) -> torch.Tensor:
        # this CP rank's share of the stream (the identity without CP); the shared decoder
        # forward embeds it, scatters it for SP and computes the lean loss
        return packed_decoder_forward(
            self.language_model, batch, current_layout(batch.host_cu_seqlens()), return_logits=return_logits
        )
