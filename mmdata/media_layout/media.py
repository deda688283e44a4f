"""A record's media as the LLaVA-OV loader lays it out, from the validator's header sizes (its
`meta.image_sizes` and `meta.video_size_frames`): the LLM positions of its images and video, and
the tiles and frames the vision tower encodes (the length index, pack planning and `mmdata
inspect` count with these)."""

from __future__ import annotations

from mmdata.media_layout import anyres_math as anyres

DEFAULT_MAX_FRAMES = 32  # LLaVA-OV frames_upbound


def media_tokens(record: dict) -> tuple[list[int], list[int]]:
    """(tokens per image, tokens per video) as the LLaVA-OV loader lays the media out."""
    meta = record.get("meta") or {}
    sizes = meta.get("image_sizes") or []
    images = [anyres.image_layout(h, w, len(sizes) == 1)[1] for w, h, _ in sizes]
    video = meta.get("video_size_frames")
    videos = [anyres.num_video_tokens(min(int(video[2]), DEFAULT_MAX_FRAMES))] if video else []
    return images, videos


def media_tiles(
    record: dict,
    *,
    image_size: int = anyres.DEFAULT_IMAGE_SIZE,
    grid_max: int = anyres.DEFAULT_GRID_MAX,
    video_frames: int = DEFAULT_MAX_FRAMES,
) -> int:
    """Tiles and frames the vision tower encodes for a record, as the LLaVA-OV loader lays its
    media out (from the validator's header sizes): a single image is its base tile plus its
    anyres grid, each image of several one tile, a video its sampled frames. (`max_tiles` only
    shrinks the features the grid becomes, not the tiles encoded.)"""
    meta = record.get("meta") or {}
    sizes = meta.get("image_sizes") or []
    if len(sizes) == 1:
        rows, cols = anyres.anyres_grid_shape(sizes[0][1], sizes[0][0], image_size, grid_max)
        tiles = 1 + rows * cols
    else:
        tiles = len(sizes)
    video = meta.get("video_size_frames")
    return tiles + (min(int(video[2]), video_frames) if video else 0)
