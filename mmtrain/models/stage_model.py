"""`DecoderStageModel`: what one pipeline stage of every family's model shares. It builds
megatron's config from the LLM sizes, sets the stage flags and the padded vocabulary, builds
the shared decoder (`language_model.build_language_model`) and provides megatron's plumbing
(`set_input_tensor`, `shared_embedding_or_output_weight`).

A family subclasses it, builds its other parts (vision tower, projector, ...) in
`build_encoders`, and writes `forward`. `build_encoders` runs before the decoder is built, so
parameters are created, and randomly initialised, in the same order as when each family built
everything itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from mmtrain.models.language_model import build_language_model, restore_tp_attributes
from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config


class DecoderStageModel(MegatronModule):
    """One pipeline stage of a family's model. `cfg` needs `llm` (an LLMConfig), `params_dtype`
    and `padded_vocab_size(tp_size)`."""

    def __init__(
        self,
        cfg: Any,
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
        self.vp_stage = vp_stage  # the virtual pipeline stage (model chunk) this is; None without
        self.share_embeddings_and_output_weights = cfg.llm.tie_word_embeddings
        self.padded_vocab_size = cfg.padded_vocab_size(parallel_state.get_tensor_model_parallel_world_size())
        self.build_encoders(opts)
        self.language_model = build_language_model(
            cfg.llm,
            lm_config,
            vocab_size=self.padded_vocab_size,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            loss_impl=opts.lm_loss,
            loss_block_mb=opts.lm_loss_block_mb,
        )
        if not opts.perform_initialization:
            restore_tp_attributes(self)

    def build_encoders(self, options: ParallelOptions) -> None:
        """The family's parts besides the decoder (none by default)."""

    # ------------------------------------------------------------------ megatron plumbing
    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()
