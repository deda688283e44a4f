"""The recipe's keys that every family's training loader takes, as keyword arguments of the
family's mmdata loader builder (`build_llava_ov_loader`, `build_emu3_loader`)."""

from __future__ import annotations

from typing import Any

from mmtrain.config.schema import Recipe

#: `data:` keys named as the loader's own arguments (mmdata.energon_loaders.loader.build_loader)
LOADER_DATA_KEYS = ("num_workers", "packing", "packing_plan", "packing_buffer_size", "shuffle_buffer_size")


def loader_kwargs(recipe: Recipe, dp_rank: int, dp_size: int) -> dict[str, Any]:
    """This DP rank's stream: sequence length and micro-batch, seed, and the `data:` loader keys."""
    t = recipe.train
    return {
        "seq_length": t.seq_length,
        "micro_batch_size": t.micro_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seed": recipe.seed,
        **{key: getattr(recipe.data, key) for key in LOADER_DATA_KEYS},
    }
