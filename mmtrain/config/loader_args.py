"""The recipe's keys that every family's training loader takes, as keyword arguments of the
family's mmdata loader builder (`build_llava_ov_loader`, `build_emu3_loader`)."""

from __future__ import annotations

from typing import Any

from mmtrain.config.schema import Recipe


def loader_kwargs(recipe: Recipe, dp_rank: int, dp_size: int) -> dict[str, Any]:
    """This DP rank's stream: sequence length and micro-batch, workers, seed, packing and buffers."""
    d = recipe.data
    return dict(
        seq_length=recipe.train.seq_length,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=d.num_workers,
        seed=recipe.seed,
        packing=d.packing,
        packing_plan=d.packing_plan,
        packing_buffer_size=d.packing_buffer_size,
        shuffle_buffer_size=d.shuffle_buffer_size,
    )
