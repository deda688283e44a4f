"""`build_llava_ov_loader`: the shared loader factory with the LLaVA-OV task encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder
from mmdata.energon_loaders.loader import SavableLoader, build_loader
from mmdata.energon_loaders.llava_ov.chat_template import DEFAULT_SYSTEM_PROMPT
from mmdata.media_layout.media import DEFAULT_MAX_FRAMES
from mmdata.packing.geometry import PlanGeometry


def build_llava_ov_loader(
    data: str | Path | Sequence[str | Path],
    tokenizer_path: str | Path,
    *,
    seq_length: int,
    micro_batch_size: int,
    max_tiles: int = 9,
    image_size: int = 384,
    patch_size: int = 14,
    grid_max: int = 6,
    max_video_frames: int = DEFAULT_MAX_FRAMES,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    **loader_kwargs: Any,
) -> SavableLoader:
    """This DP rank's savable loader of `LlavaOVBatch` (infinite: energon repeats epochs).

    `data`: a shard dir, a metadataset YAML (blend weights), or several shard dirs (equal
    weights). With `packing`, each row holds several samples up to `seq_length` tokens;
    `packing="plan"` packs them as `mmdata pack-plan` planned (`packing_plan`, see `build_loader`).
    `loader_kwargs`: `loader.build_loader`'s (dp_rank, dp_size, num_workers, seed, packing, buffers,
    checkpointing, watchdog; `sharding="global"` with global_batch_size, blend, window_steps, balance,
    tile_tokens: the global order plans from lengths counted with this loader's image geometry).
    """
    config = LlavaOVEncoderConfig(
        seq_length=seq_length,
        max_tiles=max_tiles,
        image_size=image_size,
        patch_size=patch_size,
        grid_max=grid_max,
        max_video_frames=max_video_frames,
        system_prompt=system_prompt,
    )
    if loader_kwargs.get("sharding") == "global":
        loader_kwargs.setdefault(
            "geometry", PlanGeometry(image_size, patch_size, max_tiles, grid_max, max_video_frames)
        )
    return build_loader(
        data, LlavaOVTaskEncoder(str(tokenizer_path), config), micro_batch_size=micro_batch_size, **loader_kwargs
    )
