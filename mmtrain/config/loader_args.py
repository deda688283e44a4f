"""The recipe's keys that every family's training loader takes, as keyword arguments of the
family's mmdata loader builder (`build_llava_ov_loader`, `build_emu3_loader`)."""

from __future__ import annotations

from typing import Any

from mmtrain.config.schema import Recipe

#: `data:` keys named as the loader's own arguments (mmdata.energon_loaders.loader.build_loader)
LOADER_DATA_KEYS = ("num_workers", "packing", "packing_plan", "packing_buffer_size", "shuffle_buffer_size")


def loader_kwargs(recipe: Recipe, dp_rank: int, dp_size: int, tile_tokens: float | None = None) -> dict[str, Any]:
    """This DP rank's stream: sequence length and micro-batch, seed, and the `data:` loader keys;
    with `data.sharding: global` also the global order's (`tile_tokens`: what one media tile costs
    in decoder tokens, which the planner's cost tiers and placement weigh rows with)."""
    t = recipe.train
    kwargs = {
        "seq_length": t.seq_length,
        "micro_batch_size": t.micro_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seed": recipe.seed,
        **{key: getattr(recipe.data, key) for key in LOADER_DATA_KEYS},
    }
    if recipe.data.sharding == "global":
        kwargs.update(global_order_kwargs(recipe, tile_tokens))
    return kwargs


def global_order_kwargs(recipe: Recipe, tile_tokens: float | None) -> dict[str, Any]:
    """build_loader's arguments of `sharding="global"`: nothing in them depends on the layout (the
    family's loader builder adds the geometry its length index is counted with)."""
    d = recipe.data
    return {
        "sharding": "global",
        "global_batch_size": recipe.train.global_batch_size,
        "blend": d.blend,
        "window_steps": d.order_window,
        "balance": d.balance,
        "tile_tokens": tile_tokens,
    }
