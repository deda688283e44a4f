"""The LLaVA-OneVision feature layout: how projected tile features become LLM positions.

- single image (anyres): base tile (P*P) + the grid map re-assembled from the tiles, padding
  cropped off, bilinearly shrunk above max_tiles, with `image_newline` ending every row;
- one image of a multi-image sample: its single tile + one newline;
- video: every frame 2x2-bilinear pooled to ceil(P/2)^2, all frames, + one newline.

All shape arithmetic comes from `mmdata.energon_loaders.llava_ov.anyres` (the loader's own functions),
so the number of features produced here always equals the number of placeholder tokens the
loader wrote. Only the tensor operations live here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, MEDIA_BASE_ONLY, MEDIA_VIDEO
from mmtrain.llava_ov.config import LlavaOVModelConfig

_NO_SHRINK = 10**12  # max_tiles so large that unpadded_feature_shape only crops


def anyres_features(
    tiles: torch.Tensor,
    orig_h: int,
    orig_w: int,
    newline: torch.Tensor,
    cfg: LlavaOVModelConfig,
    grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """tiles [1 + rows*cols, P*P, D] -> [P*P + rows' * (cols' + 1), D]."""
    pps = cfg.vision.patches_per_side
    base = tiles[0]
    if tiles.shape[0] == 1:
        return torch.cat([base, newline[None].to(base.dtype)], dim=0)
    if grid is None:
        grid = anyres.anyres_grid_shape(orig_h, orig_w, cfg.vision.image_size, cfg.grid_max)
    rows, cols = grid
    if tiles.shape[0] != 1 + rows * cols:
        raise ValueError(
            f"image of {orig_h}x{orig_w}: {tiles.shape[0]} tiles but the {rows}x{cols} grid needs {1 + rows * cols}"
        )
    dim = tiles.shape[-1]
    fmap = tiles[1:].view(rows, cols, pps, pps, dim).permute(4, 0, 2, 1, 3).reshape(dim, rows * pps, cols * pps)
    crop_h, crop_w = anyres.unpadded_feature_shape(orig_h, orig_w, rows, cols, pps, _NO_SHRINK)
    top, left = (rows * pps - crop_h) // 2, (cols * pps - crop_w) // 2
    fmap = fmap[:, top : top + crop_h, left : left + crop_w]
    out_h, out_w = anyres.unpadded_feature_shape(orig_h, orig_w, rows, cols, pps, cfg.max_tiles)
    if (out_h, out_w) != (crop_h, crop_w):
        fmap = F.interpolate(fmap[None], [out_h, out_w], mode="bilinear")[0]
    fmap = torch.cat([fmap, newline[:, None, None].expand(dim, out_h, 1).to(fmap.dtype)], dim=-1)
    return torch.cat([base, fmap.flatten(1, 2).transpose(0, 1)], dim=0)


def base_only_features(tile: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    """tile [1, P*P, D] -> [P*P + 1, D]."""
    return torch.cat([tile[0], newline[None].to(tile.dtype)], dim=0)


def video_features(frames: torch.Tensor, newline: torch.Tensor, cfg: LlavaOVModelConfig) -> torch.Tensor:
    """frames [T, P*P, D] -> [T * ceil(P/2)^2 + 1, D]."""
    pps = cfg.vision.patches_per_side
    side = anyres.pooled_frame_side(cfg.vision.image_size, cfg.vision.patch_size)
    t, _, dim = frames.shape
    x = frames.view(t, pps, pps, dim).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=[side, side], mode="bilinear")
    x = x.permute(0, 2, 3, 1).reshape(t * side * side, dim)
    return torch.cat([x, newline[None].to(x.dtype)], dim=0)


def pack_media_features(
    features: torch.Tensor,
    tiles_per_media: torch.Tensor,
    media_kind: torch.Tensor,
    image_sizes: torch.Tensor,
    grid_shapes: torch.Tensor | None,
    newline: torch.Tensor,
    cfg: LlavaOVModelConfig,
    num_media_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """All media of a batch: features [total_tiles, P*P, D] -> [sum(tokens), D] in media order."""
    counts = tiles_per_media.tolist()
    if sum(counts) != features.shape[0]:
        raise ValueError(f"tiles_per_media sums to {sum(counts)} but there are {features.shape[0]} tiles")
    chunks = torch.split(features, counts, dim=0)
    kinds = media_kind.tolist()
    sizes = image_sizes.tolist()
    grids = grid_shapes.tolist() if grid_shapes is not None else [None] * len(counts)
    out = []
    for i, (chunk, kind, (h, w), grid) in enumerate(zip(chunks, kinds, sizes, grids)):
        if kind == MEDIA_ANYRES:
            g = tuple(grid) if grid is not None and grid[0] > 0 else None
            feats = anyres_features(chunk, h, w, newline, cfg, g)
        elif kind == MEDIA_BASE_ONLY:
            if chunk.shape[0] != 1:
                raise ValueError(f"media {i}: a base-only image must have 1 tile, got {chunk.shape[0]}")
            feats = base_only_features(chunk, newline)
        elif kind == MEDIA_VIDEO:
            feats = video_features(chunk, newline, cfg)
        else:
            raise ValueError(f"media {i}: unknown media_kind {kind}")
        if num_media_tokens is not None and feats.shape[0] != int(num_media_tokens[i]):
            raise ValueError(
                f"media {i} (kind {kind}, size {h}x{w}): layout gives {feats.shape[0]} features, "
                f"the loader counted {int(num_media_tokens[i])} tokens"
            )
        out.append(feats)
    return torch.cat(out, dim=0) if out else features.new_zeros((0, features.shape[-1]))
