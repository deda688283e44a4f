"""HF processor tensors (what `LlavaOnevisionForConditionalGeneration.forward` takes) -> our
`LlavaOVBatch`, so a converted model can be called exactly like the HF one."""

from __future__ import annotations

from typing import Optional

import torch

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, MEDIA_BASE_ONLY, MEDIA_VIDEO, LlavaOVBatch
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.models.language_model import hf_text_fields


def hf_inputs_to_batch(
    cfg: LlavaOVModelConfig,
    input_ids: torch.Tensor,
    pixel_values: Optional[torch.Tensor] = None,
    image_sizes: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    batch_num_images: Optional[torch.Tensor] = None,
    pixel_values_videos: Optional[torch.Tensor] = None,
    **_: object,
) -> LlavaOVBatch:
    """The model's batch for an HF-style call (keyword arguments HF's forward takes besides these,
    such as `use_cache`, are ignored)."""
    b, s = input_ids.shape
    text = hf_text_fields(input_ids, attention_mask)  # checks the mask first
    v = cfg.vision
    items = []  # (kind, tiles [n, 3, H, W], (h, w), grid, tokens, placeholder id)
    if pixel_values is not None:
        if image_sizes is None:
            raise ValueError("pixel_values given without image_sizes")
        sizes = image_sizes.tolist()
        if batch_num_images is None:
            anyres_flags = [True] * len(sizes)
        else:
            anyres_flags = [int(n) == 1 for n in batch_num_images.tolist() for _ in range(int(n))]
        if pixel_values.dim() not in (4, 5):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: expected 4 or 5 dimensions")
        flat, offset = pixel_values, 0  # 4-D: tiles already flattened
        for i, ((h, w), is_anyres) in enumerate(zip(sizes, anyres_flags)):
            if is_anyres:
                grid = anyres.anyres_grid_shape(h, w, v.image_size, cfg.grid_max)
                n_tiles = 1 + grid[0] * grid[1]
                tokens = anyres.num_image_tokens(
                    h,
                    w,
                    image_size=v.image_size,
                    patch_size=v.patch_size,
                    max_tiles=cfg.max_tiles,
                    grid_max=cfg.grid_max,
                )
                kind = MEDIA_ANYRES
            else:
                grid, n_tiles, kind = (0, 0), 1, MEDIA_BASE_ONLY
                tokens = anyres.num_base_only_tokens(v.image_size, v.patch_size)
            if pixel_values.dim() == 5:
                tiles = pixel_values[i, :n_tiles]
            else:
                tiles = flat[offset : offset + n_tiles]
                offset += n_tiles
            if tiles.shape[0] != n_tiles:
                raise ValueError(f"image {i} ({h}x{w}) needs {n_tiles} tiles, pixel_values has {tiles.shape[0]}")
            items.append((kind, tiles, (h, w), grid, tokens, cfg.image_token_id))
    if pixel_values_videos is not None:
        for vid in pixel_values_videos:
            f = vid.shape[0]
            items.append(
                (
                    MEDIA_VIDEO,
                    vid,
                    (v.image_size, v.image_size),
                    (0, 0),
                    anyres.num_video_tokens(f, v.image_size, v.patch_size),
                    cfg.video_token_id,
                )
            )
    # media go in token-stream order: HF fills images and videos separately, each in order
    flat_ids = input_ids.reshape(-1)
    starts = []
    for tok in (cfg.image_token_id, cfg.video_token_id):
        where = (flat_ids == tok).nonzero(as_tuple=True)[0]
        cursor = 0
        for it in items:
            if it[5] != tok:
                continue
            if cursor >= where.numel():
                raise ValueError(f"input_ids hold fewer placeholder tokens (id {tok}) than the media need")
            starts.append((int(where[cursor]), it))
            cursor += it[4]
        if cursor != where.numel():
            raise ValueError(f"input_ids hold {where.numel()} placeholder tokens (id {tok}), the media need {cursor}")
    ordered = [it for _, it in sorted(starts, key=lambda x: x[0])]
    if ordered:
        px = torch.cat([it[1] for it in ordered], dim=0).float()
    else:
        px = torch.zeros((0, 3, v.image_size, v.image_size))
    return LlavaOVBatch(
        **text,
        pixel_values=px,
        tiles_per_media=torch.tensor([it[1].shape[0] for it in ordered], dtype=torch.long),
        media_kind=torch.tensor([it[0] for it in ordered], dtype=torch.long),
        image_sizes=torch.tensor([list(it[2]) for it in ordered], dtype=torch.long).reshape(-1, 2),
        grid_shapes=torch.tensor([list(it[3]) for it in ordered], dtype=torch.long).reshape(-1, 2),
        num_media_tokens=torch.tensor([it[4] for it in ordered], dtype=torch.long),
    )
