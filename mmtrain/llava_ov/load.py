"""Loading LLaVA-OV weights outside training: `load_llava_ov(ckpt_dir)`, a converted (or
trained) checkpoint as an eval-mode model that is called like
`LlavaOnevisionForConditionalGeneration` and returns logits [batch, seq, vocab]; and
`load_hf_into_model`, which lets a recipe start from an HF directory (converted on the fly)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from mmtrain.llava_ov.config import ARCHITECTURE_KEYS, LlavaOVModelConfig
from mmtrain.llava_ov.conversion import build_stage, llava_source, tied_source
from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
from mmtrain.runtime.hf_conversion import load_for_inference, load_hf_into_chunks


class LlavaOVForInference(torch.nn.Module):
    """HF-call-compatible wrapper around an unsharded `LlavaOVModel` (TP=1, PP=1)."""

    def __init__(self, model: torch.nn.Module, cfg: LlavaOVModelConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *inputs: Optional[torch.Tensor], **kw: object) -> torch.Tensor:
        """`LlavaOnevisionForConditionalGeneration`'s call: `hf_inputs_to_batch`'s arguments after `cfg`."""
        return self.model(hf_inputs_to_batch(self.cfg, input_ids, *inputs, **kw), return_logits=True)


def load_llava_ov(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> LlavaOVForInference:
    """A megatron checkpoint dir (CKPT_DIR/latest + iter_*/model) or an HF LLaVA-OV dir."""
    cfg, model = load_for_inference(ckpt_dir, LlavaOVModelConfig, build_stage, llava_source, iteration)
    return LlavaOVForInference(model, cfg).eval()


def load_hf_into_model(
    model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, expect: Optional[LlavaOVModelConfig] = None
) -> None:
    """Fill (possibly TP/PP-sharded) model chunks straight from an HF LLaVA-OV dir, after
    checking its config against the recipe's model config (`expect`, when given)."""
    load_hf_into_chunks(model_chunks, hf_dir, llava_source, expect, ARCHITECTURE_KEYS, tied_source)
