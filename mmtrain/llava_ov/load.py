"""`load_llava_ov(ckpt_dir)`: a converted (or trained) checkpoint as an eval-mode model that is
called like `LlavaOnevisionForConditionalGeneration` and returns logits [batch, seq, vocab]."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch


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
    from mmtrain.llava_ov.conversion import build_stage, llava_source
    from mmtrain.llava_ov.model_io import load_canonical
    from mmtrain.llava_ov.parallel_init import ensure_model_parallel
    from mmtrain.weights_io import LATEST, load_model_config_dict, load_model_weights

    from mmtrain.llava_ov.model import ParallelOptions

    ensure_model_parallel(1, 1)
    no_init = ParallelOptions(perform_initialization=False)  # every weight is loaded below
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "config.json").is_file() and not (ckpt_dir / LATEST).exists():
        cfg, get = llava_source(ckpt_dir)
        model = build_stage(cfg, no_init)
        load_canonical(model, get)
    else:
        cfg = LlavaOVModelConfig.from_dict(load_model_config_dict(ckpt_dir, iteration))
        model = build_stage(cfg, no_init)
        load_model_weights([model], ckpt_dir, iteration)
    return LlavaOVForInference(model, cfg).eval()


def load_hf_into_model(model_chunks, hf_dir: str | os.PathLike, expect: Optional[LlavaOVModelConfig] = None) -> None:
    """Fill (possibly TP/PP-sharded) model chunks straight from an HF LLaVA-OV dir: lets a recipe
    name an HF directory as its initial checkpoint (conversion on the fly)."""
    from mmtrain.llava_ov.conversion import _tied_source, llava_source
    from mmtrain.llava_ov.model_io import load_canonical
    from mmtrain.llava_ov.state_dict_adapter import ConversionError

    cfg, get = llava_source(hf_dir)
    if expect is not None:
        for key in ("llm", "vision", "projector", "image_token_id", "video_token_id"):
            if getattr(expect, key) != getattr(cfg, key):
                raise ConversionError(
                    f"{hf_dir}: HF config does not match the recipe: model.{key} is {getattr(expect, key)} in the recipe, "
                    f"{getattr(cfg, key)} in the HF checkpoint"
                )
    for chunk in model_chunks:
        load_canonical(getattr(chunk, "module", chunk), get, tied_output_source=_tied_source(cfg))
