"""Registers the "llava-ov" ModelSpec for the shared runtime."""

from __future__ import annotations

from typing import Any

from mmtrain.cost_model import training_flops_per_token
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.forward_step import forward_step
from mmtrain.llava_ov.state_dict_adapter import LlavaOVStateDictAdapter
from mmtrain.model_spec import ModelSpec, register


def build_model(model_config: LlavaOVModelConfig, *, pre_process: bool = True, post_process: bool = True,
                parallel_ctx: Any = None, vp_stage: int | None = None):
    from mmtrain.llava_ov.model import LlavaOVModel

    return LlavaOVModel(model_config, pre_process=pre_process, post_process=post_process,
                        parallel_ctx=parallel_ctx, vp_stage=vp_stage)


def build_loader(recipe: Any, *, dp_rank: int = 0, dp_size: int = 1):
    """Delegates to the energon loader factory with the model's own vision geometry."""
    from mmdata.energon_loaders.loader import build_llava_ov_loader

    m: LlavaOVModelConfig = recipe.model
    d = recipe.data
    loader = build_llava_ov_loader(
        d.paths, recipe.tokenizer.path, seq_length=recipe.train.seq_length,
        micro_batch_size=recipe.train.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
        num_workers=d.num_workers, seed=recipe.seed, max_tiles=m.max_tiles, packing=d.packing,
        packing_buffer_size=d.packing_buffer_size, shuffle_buffer_size=d.shuffle_buffer_size,
        image_size=m.vision.image_size, patch_size=m.vision.patch_size, grid_max=m.grid_max,
        max_video_frames=d.video_frames,
    )
    check_media_token_ids(m, loader.task_encoder.chat.image_token_id, loader.task_encoder.chat.video_token_id,
                          recipe.tokenizer.path)
    return loader


def check_media_token_ids(m: LlavaOVModelConfig, image_id: int, video_id: int, tokenizer_path: str) -> None:
    """The model finds media positions by token id: a tokenizer whose `<image>`/`<video>` ids
    differ from the model config would silently misplace image features, so refuse early."""
    wrong = [
        f"model.{key}={want} but the tokenizer at {tokenizer_path} maps {tok} to {got}"
        for key, want, tok, got in (
            ("image_token_id", m.image_token_id, "<image>", image_id),
            ("video_token_id", m.video_token_id, "<video>", video_id),
        )
        if want != got
    ]
    if wrong:
        raise ValueError("media token ids disagree: " + "; ".join(wrong))


SPEC = register(
    ModelSpec(
        name="llava-ov",
        model_config_cls=LlavaOVModelConfig,
        build_model=build_model,
        build_loader=build_loader,
        forward_step=forward_step,
        flops_per_token=training_flops_per_token,
        state_dict_adapter=LlavaOVStateDictAdapter,
    )
)
