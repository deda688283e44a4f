"""Loading LLaVA-OV weights outside training: `load_llava_ov(ckpt_dir)`, a converted (or
trained) checkpoint as an eval-mode model that is called like
`LlavaOnevisionForConditionalGeneration` and returns logits [batch, seq, vocab]; and
`load_hf_into_model`, which lets a recipe start from an HF directory (converted on the fly)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from mmtrain.llava_ov.config import ARCHITECTURE_KEYS, LlavaOVModelConfig
from mmtrain.llava_ov.conversion import build_stage, llava_source, saved_model_config, tied_source
from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.model_io import load_canonical
from mmtrain.models.state_dict_adapter import ConversionError
from mmtrain.runtime.checkpoint.layout import LATEST, unwrap
from mmtrain.runtime.checkpoint.weights import load_model_weights
from mmtrain.runtime.distributed import ensure_model_parallel


class LlavaOVForInference(torch.nn.Module):
    """HF-call-compatible wrapper around an unsharded `LlavaOVModel` (TP=1, PP=1)."""

    def __init__(self, model: torch.nn.Module, cfg: LlavaOVModelConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: Optional[torch.Tensor] = None,
        image_sizes: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        batch_num_images: Optional[torch.Tensor] = None,
        pixel_values_videos: Optional[torch.Tensor] = None,
        **_: object,
    ) -> torch.Tensor:
        batch = hf_inputs_to_batch(self.cfg, input_ids, pixel_values, image_sizes, attention_mask,
                                   batch_num_images, pixel_values_videos)
        return self.model(batch, return_logits=True)


def load_llava_ov(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> LlavaOVForInference:
    """A megatron checkpoint dir (CKPT_DIR/latest + iter_*/model) or an HF LLaVA-OV dir."""
    ensure_model_parallel(1, 1)
    no_init = ParallelOptions(perform_initialization=False)  # every weight is loaded below
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "config.json").is_file() and not (ckpt_dir / LATEST).exists():
        cfg, get = llava_source(ckpt_dir)
        model = build_stage(cfg, no_init)
        load_canonical(model, get)
    else:
        cfg = saved_model_config(ckpt_dir, iteration)
        model = build_stage(cfg, no_init)
        load_model_weights([model], ckpt_dir, iteration)
    return LlavaOVForInference(model, cfg).eval()


def load_hf_into_model(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike,
                       expect: Optional[LlavaOVModelConfig] = None) -> None:
    """Fill (possibly TP/PP-sharded) model chunks straight from an HF LLaVA-OV dir, after
    checking its config against the recipe's model config (`expect`, when given)."""
    cfg, get = llava_source(hf_dir)
    for key in ARCHITECTURE_KEYS if expect is not None else ():
        if getattr(expect, key) != getattr(cfg, key):
            raise ConversionError(
                f"{hf_dir}: HF config does not match the recipe: model.{key} is {getattr(expect, key)} in the recipe, "
                f"{getattr(cfg, key)} in the HF checkpoint"
            )
    for chunk in model_chunks:
        load_canonical(unwrap(chunk), get, tied_output_source=tied_source(cfg))
