"""LLaVA-OV's training loader from a recipe (`FamilySpec.build_loader`): the energon loader with
the model's own vision geometry, its media token ids checked against the model's."""

from __future__ import annotations

from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.loader import SavableLoader
from mmtrain.config.loader_args import loader_kwargs
from mmtrain.config.schema import Recipe
from mmtrain.models.flops import tile_token_cost
from mmtrain.llava_ov.config import LlavaOVDataConfig, LlavaOVModelConfig
from mmtrain.llava_ov.spec import check_media_token_ids, model_shapes


def build_loader(recipe: Recipe, *, dp_rank: int = 0, dp_size: int = 1) -> SavableLoader:
    """The energon loader with the model's own vision geometry."""
    m: LlavaOVModelConfig = recipe.model
    d: LlavaOVDataConfig = recipe.data
    loader = build_llava_ov_loader(
        d.paths,
        recipe.tokenizer.path,
        max_tiles=m.max_tiles,
        image_size=m.vision.image_size,
        patch_size=m.vision.patch_size,
        grid_max=m.grid_max,
        max_video_frames=d.video_frames,
        **loader_kwargs(recipe, dp_rank, dp_size, tile_token_cost(model_shapes(recipe.model))),
    )
    check_media_token_ids(
        m, loader.task_encoder.chat.image_token_id, loader.task_encoder.chat.video_token_id, recipe.tokenizer.path
    )
    return loader
