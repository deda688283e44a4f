"""Emu3's training loader from a recipe (`FamilySpec.build_loader`): the energon loader over
token shards with the recipe's task mix, and the tokenizer checked against the vocabulary."""

from __future__ import annotations

from mmdata.energon_loaders.emu3.loader import build_emu3_loader
from mmdata.energon_loaders.loader import SavableLoader
from mmtrain.config.loader_args import loader_kwargs
from mmtrain.config.schema import Recipe
from mmtrain.models.flops import tile_token_cost
from mmtrain.emu3.config import Emu3DataConfig, Emu3ModelConfig
from mmtrain.emu3.spec import model_shapes


def build_loader(recipe: Recipe, *, dp_rank: int = 0, dp_size: int = 1) -> SavableLoader:
    """The energon loader over token shards with the recipe's task mix."""
    d: Emu3DataConfig = recipe.data
    loader = build_emu3_loader(
        d.paths,
        recipe.tokenizer.path,
        encoder=dict(
            tasks=dict(d.tasks), p_uncond=d.p_uncond, uncond_prompt=d.uncond_prompt, system_prompt=d.system_prompt
        ),
        **loader_kwargs(recipe, dp_rank, dp_size, tile_token_cost(model_shapes(recipe.model))),
    )
    check_tokenizer_fits(recipe.model, len(loader.task_encoder.tasks.tokenizer), recipe.tokenizer.path)
    return loader


def check_tokenizer_fits(m: Emu3ModelConfig, tokenizer_size: int, tokenizer_path: str) -> None:
    """Every id the tokenizer can produce (text, specials, visual tokens) needs a row of the
    model's vocabulary: refuse a tokenizer larger than `model.llm.vocab_size` before training."""
    if tokenizer_size > m.llm.vocab_size:
        raise ValueError(
            f"the tokenizer at {tokenizer_path} has {tokenizer_size} tokens but model.llm.vocab_size is "
            f"{m.llm.vocab_size}; use the model's own tokenizer (or a larger vocab_size)"
        )
