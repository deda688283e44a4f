"""Loading Emu3 weights outside training: `load_emu3(ckpt_dir)`, a converted (or trained)
checkpoint as an eval-mode model called like the HF text model (`input_ids` -> logits); and
`load_hf_into_model`, which lets a recipe start from an HF Emu3 directory (converted on the fly).
Generation (`emu3/generation.py`) starts from `load_emu3`."""

from __future__ import annotations

import os
from typing import Optional

import torch

from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.emu3.config import ARCHITECTURE_KEYS, Emu3ModelConfig
from mmtrain.emu3.conversion import build_stage, emu3_source
from mmtrain.models.language_model import hf_text_fields
from mmtrain.runtime.hf_conversion import load_for_inference, load_hf_into_chunks


def hf_inputs_to_batch(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> PackedBatch:
    """HF-style `input_ids` [B, S] (+ right-padded `attention_mask`) -> a packed batch: each row
    one sample, its padding a segment of its own."""
    return PackedBatch(**hf_text_fields(input_ids, attention_mask))


class Emu3ForInference(torch.nn.Module):
    """HF-call-compatible wrapper around an unsharded `Emu3Model` (TP=1, PP=1): text and
    visual-token ids in, logits [batch, seq, vocab] out (the VQ model is not part of it: images
    enter as the visual tokens `mmdata tokenize-images` / `serialize` produce)."""

    def __init__(self, model: torch.nn.Module, cfg: Emu3ModelConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **_: object
    ) -> torch.Tensor:
        batch = hf_inputs_to_batch(input_ids.to(self.device), None if attention_mask is None else attention_mask.cpu())
        return self.model(batch.to(self.device), return_logits=True)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_emu3(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> Emu3ForInference:
    """A megatron checkpoint dir (CKPT_DIR/latest + iter_*/model, e.g. a training run's
    `checkpoints/` or a converted dir) or an HF `Emu3ForConditionalGeneration` dir."""
    cfg, model = load_for_inference(ckpt_dir, Emu3ModelConfig, build_stage, emu3_source, iteration)
    return Emu3ForInference(model, cfg).eval()


def load_hf_into_model(
    model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, expect: Optional[Emu3ModelConfig] = None
) -> None:
    """Fill (possibly TP/PP-sharded) model chunks straight from an HF Emu3 dir, after checking
    its config against the recipe's model config (`expect`, when given)."""
    load_hf_into_chunks(model_chunks, hf_dir, emu3_source, expect, ARCHITECTURE_KEYS)
