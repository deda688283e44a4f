"""LLaVA-OneVision anyres arithmetic: grid pinpoints, best-resolution selection, the unpad +
anyres_max shrink shape and the LLM token counts of images, multi-image and video.

Pure functions on sizes (stdlib only, no torch, numpy or PIL), so the preprocessing workers that
write the length index can count tokens without importing torch (tests/test_anyres.py checks
it), while the loader (`anyres`, which re-exports these) and the model lay out features with the
very same code, so the two can never disagree. HF's LLaVA-OneVision processor is the parity
oracle (tests/test_anyres*.py).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

DEFAULT_IMAGE_SIZE = 384
DEFAULT_PATCH_SIZE = 14
DEFAULT_GRID_MAX = 6  # pinpoints (1..6) x (1..6) x image_size
DEFAULT_MAX_TILES = 9  # anyres_max_9
#: shrink only when the unpadded map exceeds max_tiles tiles by more than this factor (HF/LLaVA)
SHRINK_THRESHOLD = 1.1


@lru_cache(maxsize=64)
def grid_pinpoints(
    image_size: int = DEFAULT_IMAGE_SIZE, grid_max: int = DEFAULT_GRID_MAX
) -> tuple[tuple[int, int], ...]:
    """Candidate (height, width) resolutions, in HF's order (height-major): ties keep the first."""
    return tuple((i * image_size, j * image_size) for i in range(1, grid_max + 1) for j in range(1, grid_max + 1))


def select_best_resolution(orig_h: int, orig_w: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) pinpoint that keeps the most original pixels, then wastes the least."""
    best: tuple[int, int] | None = None
    best_effective, best_wasted = 0, math.inf
    for height, width in pinpoints:
        scale = min(width / orig_w, height / orig_h)
        effective = min(int(orig_w * scale) * int(orig_h * scale), orig_w * orig_h)
        wasted = width * height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best_effective, best_wasted, best = effective, wasted, (int(height), int(width))
    if best is None:
        raise ValueError(f"no grid pinpoint fits an image of {orig_h}x{orig_w}")
    return best


def resize_for_patching(orig_h: int, orig_w: int, target_h: int, target_w: int) -> tuple[int, int]:
    """Aspect-preserving size that fills the limiting side of the target exactly."""
    scale_w, scale_h = target_w / orig_w, target_h / orig_h
    if scale_w < scale_h:
        return min(math.ceil(orig_h * scale_w), target_h), target_w
    return target_h, min(math.ceil(orig_w * scale_h), target_w)


def anyres_grid_shape(
    orig_h: int, orig_w: int, image_size: int = DEFAULT_IMAGE_SIZE, grid_max: int = DEFAULT_GRID_MAX
) -> tuple[int, int]:
    """(rows, cols) of grid tiles chosen for an image of orig_h x orig_w.

    An image that fits the largest pinpoint (both sides <= grid_max * image_size) keeps all its
    pixels exactly in the pinpoints that cover it and loses some in every other one, so
    `select_best_resolution` picks the smallest covering pinpoint: ceil(side / image_size) tiles
    per side, computed here directly (its loop over 36 pinpoints cost the preprocessing scan
    tens of microseconds per image). tests/test_anyres.py checks the two agree on every size."""
    side = grid_max * image_size
    if 0 < orig_h <= side and 0 < orig_w <= side:
        return int(-(-orig_h // image_size)), int(-(-orig_w // image_size))
    best_h, best_w = select_best_resolution(orig_h, orig_w, grid_pinpoints(image_size, grid_max))
    return best_h // image_size, best_w // image_size


def unpadded_feature_shape(
    orig_h: int,
    orig_w: int,
    grid_rows: int,
    grid_cols: int,
    patches_per_side: int = DEFAULT_IMAGE_SIZE // DEFAULT_PATCH_SIZE,
    max_tiles: int = DEFAULT_MAX_TILES,
) -> tuple[int, int]:
    """(rows, cols) of the grid feature map after removing padding and the anyres_max shrink.

    The model reproduces this with: crop `(cur - new) // 2` rows/cols on both sides, then
    bilinear-interpolate to `(int(rows // ratio), int(cols // ratio))` when ratio > 1.1.
    """
    cur_h, cur_w = patches_per_side * grid_rows, patches_per_side * grid_cols
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        cur_h -= ((cur_h - new_h) // 2) * 2
    else:
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        cur_w -= ((cur_w - new_w) // 2) * 2
    ratio = shrink_ratio(cur_h, cur_w, patches_per_side, max_tiles)
    if ratio > SHRINK_THRESHOLD:
        return int(cur_h // ratio), int(cur_w // ratio)
    return cur_h, cur_w


def shrink_ratio(rows: int, cols: int, patches_per_side: int, max_tiles: int = DEFAULT_MAX_TILES) -> float:
    """sqrt(features / (max_tiles tiles' worth of features)); the map is shrunk when > 1.1."""
    return math.sqrt(rows * cols / (max_tiles * patches_per_side**2))


def num_image_tokens(
    orig_h: int,
    orig_w: int,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    max_tiles: int = DEFAULT_MAX_TILES,
    grid_max: int = DEFAULT_GRID_MAX,
) -> int:
    """LLM positions of a single anyres image: base P*P + rows * (cols + newline)."""
    grid = anyres_grid_shape(orig_h, orig_w, image_size, grid_max)
    return _anyres_tokens(orig_h, orig_w, grid, image_size // patch_size, max_tiles)


def _anyres_tokens(orig_h: int, orig_w: int, grid: tuple[int, int], pps: int, max_tiles: int) -> int:
    rows, cols = unpadded_feature_shape(orig_h, orig_w, grid[0], grid[1], pps, max_tiles)
    return pps * pps + rows * (cols + 1)


@lru_cache(maxsize=1 << 16)  # the length index asks for every image; sizes repeat a lot
def image_layout(
    orig_h: int,
    orig_w: int,
    single: bool,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    max_tiles: int = DEFAULT_MAX_TILES,
    grid_max: int = DEFAULT_GRID_MAX,
) -> tuple[tuple[int, int], int]:
    """(anyres grid, LLM tokens) of an image as the loader lays it out: the only image of a
    sample -> anyres (base tile + grid); one of several -> one base tile, grid (0, 0)."""
    if not single:
        return (0, 0), num_base_only_tokens(image_size, patch_size)
    grid = anyres_grid_shape(orig_h, orig_w, image_size, grid_max)
    return grid, _anyres_tokens(orig_h, orig_w, grid, image_size // patch_size, max_tiles)


def num_base_only_tokens(image_size: int = DEFAULT_IMAGE_SIZE, patch_size: int = DEFAULT_PATCH_SIZE) -> int:
    """LLM positions of one image of a multi-image sample: one tile plus one newline."""
    pps = image_size // patch_size
    return pps * pps + 1


def pooled_frame_side(image_size: int = DEFAULT_IMAGE_SIZE, patch_size: int = DEFAULT_PATCH_SIZE) -> int:
    """Feature side after LLaVA-OV's 2x2 bilinear video pooling (27 -> 14)."""
    return math.ceil((image_size // patch_size) / 2)


def num_video_tokens(
    num_frames: int, image_size: int = DEFAULT_IMAGE_SIZE, patch_size: int = DEFAULT_PATCH_SIZE
) -> int:
    """LLM positions of a video: pooled features per frame plus one newline for the clip."""
    side = pooled_frame_side(image_size, patch_size)
    return num_frames * side * side + 1
