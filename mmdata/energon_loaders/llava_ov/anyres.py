"""LLaVA-OneVision dynamic resolution ("anyres_max_N") for images, multi-image and video.

Two halves, shared by the loader and the model:
- pixel side (`process_image`, `process_base_only`, `process_frames`): PIL decode/resize with
  the same resampling as `transformers.LlavaOnevisionImageProcessor` (bicubic), pad, cut into
  square tiles, SigLIP-normalise, all in one pass over uint8 memory (no float64 copies).
- arithmetic side (`mmdata.media_layout.anyres_math`, torch-free, re-exported here): grid pinpoints, best-resolution
  selection, the unpad + anyres_max shrink shape and the LLM token counts. The model imports
  these to lay out features exactly as the loader counted them, so the two can never disagree.

Conventions follow HF's LLaVA-OneVision (the parity oracle, tested in tests/test_anyres*.py):
- single image: base tile (original resized to SxS, no pad) + grid tiles of the padded best
  resolution, row-major; tokens = base (P*P) + rows' * (cols' + 1) where (rows', cols') is the
  unpadded, possibly shrunk feature map of P*grid_rows x P*grid_cols features (P = S // patch).
- multi-image ("base only"): each image padded to a square with the mean colour, one tile,
  P*P + 1 tokens (HF appends one newline feature per image).
- video: frames resized to SxS, features 2x2-bilinear pooled to ceil(P/2)^2 per frame, plus one
  newline for the whole video.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from mmdata.media_layout.anyres_math import (  # noqa: F401  (re-exported: the loader's and model's API)
    DEFAULT_GRID_MAX,
    DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_TILES,
    DEFAULT_PATCH_SIZE,
    SHRINK_THRESHOLD,
    anyres_grid_shape,
    grid_pinpoints,
    image_layout,
    num_base_only_tokens,
    num_image_tokens,
    num_video_tokens,
    pooled_frame_side,
    resize_for_patching,
    select_best_resolution,
    shrink_ratio,
    unpadded_feature_shape,
)

SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)


# ----------------------------------------------------------------------------- pixels


@dataclass
class AnyResImage:
    """One processed image (or video) ready for the vision tower."""

    pixel_values: torch.Tensor  # [tiles, 3, S, S] float32, normalised
    image_size: tuple[int, int]  # original (height, width)
    num_tokens: int  # LLM positions this media expands to
    grid_shape: tuple[int, int]  # anyres grid (rows, cols); (0, 0) when there is no grid

    @property
    def num_tiles(self) -> int:
        return int(self.pixel_values.shape[0])


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB conversion as HF does it: transparency is composited onto white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _normalise_(out: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> None:
    """In place: out = (out/255 - mean) / std as one multiply-add (scalars when channels agree).
    Two separate IEEE fp32 ops (a multiply, then an add), so the result is the same bits on
    any device."""
    if len(set(mean)) == 1 and len(set(std)) == 1:
        out.mul_(1.0 / (255.0 * std[0])).add_(-mean[0] / std[0])
        return
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, 3, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, 3, 1, 1)
    out.mul_(scale.to(out.device)).add_(shift.to(out.device))


def normalise_pixels(
    pixels: torch.Tensor, mean: Sequence[float] = SIGLIP_MEAN, std: Sequence[float] = SIGLIP_STD
) -> torch.Tensor:
    """uint8 tiles [N, 3, S, S] (0..255) -> float32 normalised, on `pixels`' device. The loader
    ships uint8 (4x less to pin and copy than fp32); the model calls this on the device."""
    out = pixels.to(torch.float32)
    _normalise_(out, mean, std)
    return out


def _consume_torchs_read_only_warning() -> None:
    """torch warns once per process ("The given NumPy array is not writable") the first time it
    wraps a read-only array; `_hwc` only reads, so that warning is spent here, once, instead of
    a `catch_warnings()` around every image (which also saves and restores the process's whole
    filter list each time, undoing filters that other threads add meanwhile)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.asarray(Image.new("RGB", (1, 1))))


_consume_torchs_read_only_warning()


def _hwc(image: Image.Image) -> torch.Tensor:
    """[H, W, 3] uint8 view of a PIL image's pixels (we only read it, so skip a second copy)."""
    return torch.from_numpy(np.asarray(image))


@dataclass
class TileCanvas:
    """HWC uint8 pixels whose rows x cols square cells are tiles (row-major)."""

    pixels: torch.Tensor  # [rows * S, cols * S, 3] uint8
    rows: int
    cols: int


@dataclass
class PreparedMedia:
    """Resized/padded uint8 pixels of one media, not yet cut into float tiles.

    Kept compact (uint8, HWC) until the batch is assembled: the loader then cuts every media
    of a batch straight into one uint8 CHW tensor; the model normalises it on the device.
    """

    canvases: list[TileCanvas]
    image_size: tuple[int, int]  # original (height, width)
    num_tokens: int
    grid_shape: tuple[int, int]

    @property
    def num_tiles(self) -> int:
        return sum(c.rows * c.cols for c in self.canvases)

    def write_tiles(self, out: torch.Tensor) -> None:
        """Copy this media's tiles (0..255, CHW) into out[:num_tiles] with one strided copy per
        canvas (no intermediate permuted copies)."""
        i = 0
        for c in self.canvases:
            size = c.pixels.shape[0] // c.rows
            n = c.rows * c.cols
            out[i : i + n].view(c.rows, c.cols, 3, size, size).copy_(
                c.pixels.view(c.rows, size, c.cols, size, 3).permute(0, 2, 4, 1, 3)
            )
            i += n


def tiles_to_uint8(media: Sequence[PreparedMedia], image_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """All tiles of `media`, in order, as one [tiles, 3, S, S] uint8 tensor (not normalised)."""
    total = sum(m.num_tiles for m in media)
    if out is None:
        out = torch.empty((total, 3, image_size, image_size), dtype=torch.uint8)
    i = 0
    for m in media:
        m.write_tiles(out[i : i + m.num_tiles])
        i += m.num_tiles
    return out


def tiles_to_pixel_values(
    media: Sequence[PreparedMedia],
    image_size: int,
    mean: Sequence[float] = SIGLIP_MEAN,
    std: Sequence[float] = SIGLIP_STD,
) -> torch.Tensor:
    """All tiles of `media`, in order, as one normalised [tiles, 3, S, S] float32 tensor: the
    same `normalise_pixels` the model applies on the device to the loader's uint8 tiles."""
    return normalise_pixels(tiles_to_uint8(media, image_size), mean, std)


def prepare_image(
    image: Image.Image,
    max_tiles: int = DEFAULT_MAX_TILES,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    grid_max: int = DEFAULT_GRID_MAX,
) -> PreparedMedia:
    """Single-image anyres pixels: the base canvas (1x1), then the padded rows x cols grid."""
    image = to_rgb(image)
    orig_w, orig_h = image.size
    if orig_w < 1 or orig_h < 1:
        raise ValueError(f"image has an empty size {orig_w}x{orig_h}")
    best_h, best_w = select_best_resolution(orig_h, orig_w, grid_pinpoints(image_size, grid_max))
    new_h, new_w = resize_for_patching(orig_h, orig_w, best_h, best_w)
    rows, cols = best_h // image_size, best_w // image_size

    resized = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    canvas = torch.zeros((best_h, best_w, 3), dtype=torch.uint8)  # black pad, as HF
    top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = _hwc(resized)
    base = image.resize((image_size, image_size), Image.Resampling.BICUBIC)

    pps = image_size // patch_size
    feat_rows, feat_cols = unpadded_feature_shape(orig_h, orig_w, rows, cols, pps, max_tiles)
    return PreparedMedia(
        canvases=[TileCanvas(_hwc(base), 1, 1), TileCanvas(canvas, rows, cols)],
        image_size=(orig_h, orig_w),
        num_tokens=pps * pps + feat_rows * (feat_cols + 1),
        grid_shape=(rows, cols),
    )


def prepare_base_only(
    image: Image.Image,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    mean: Sequence[float] = SIGLIP_MEAN,
) -> PreparedMedia:
    """One tile per image (multi-image samples): pad to square with the mean colour, resize."""
    image = to_rgb(image)
    w, h = image.size
    if w != h:
        side = max(w, h)
        square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
        square.paste(image, ((side - w) // 2, (side - h) // 2))
        image = square
    tile = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return PreparedMedia([TileCanvas(_hwc(tile), 1, 1)], (h, w), num_base_only_tokens(image_size, patch_size), (0, 0))


def prepare_frames(
    frames: np.ndarray, *, image_size: int = DEFAULT_IMAGE_SIZE, patch_size: int = DEFAULT_PATCH_SIZE
) -> PreparedMedia:
    """Video frames [T, H, W, 3] uint8, each resized to S x S (bicubic, no pad), as a T x 1 canvas."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"expected frames [T, H, W, 3], got shape {tuple(frames.shape)}")
    num_frames, h, w = int(frames.shape[0]), int(frames.shape[1]), int(frames.shape[2])
    canvas = torch.empty((num_frames * image_size, image_size, 3), dtype=torch.uint8)
    for i in range(num_frames):
        frame = Image.fromarray(np.ascontiguousarray(frames[i]))
        resized = frame.resize((image_size, image_size), Image.Resampling.BICUBIC)
        canvas[i * image_size : (i + 1) * image_size] = _hwc(resized)
    return PreparedMedia(
        [TileCanvas(canvas, num_frames, 1)], (h, w), num_video_tokens(num_frames, image_size, patch_size), (0, 0)
    )


def _finish(prepared: PreparedMedia, image_size: int, mean: Sequence[float], std: Sequence[float]) -> AnyResImage:
    pixel_values = tiles_to_pixel_values([prepared], image_size, mean, std)
    return AnyResImage(pixel_values, prepared.image_size, prepared.num_tokens, prepared.grid_shape)


def process_image(
    image: Image.Image,
    max_tiles: int = DEFAULT_MAX_TILES,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    grid_max: int = DEFAULT_GRID_MAX,
    mean: Sequence[float] = SIGLIP_MEAN,
    std: Sequence[float] = SIGLIP_STD,
) -> AnyResImage:
    """Single-image anyres: base tile first, then the row-major grid tiles."""
    prepared = prepare_image(image, max_tiles, image_size=image_size, patch_size=patch_size, grid_max=grid_max)
    return _finish(prepared, image_size, mean, std)


def process_base_only(
    image: Image.Image,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    mean: Sequence[float] = SIGLIP_MEAN,
    std: Sequence[float] = SIGLIP_STD,
) -> AnyResImage:
    """One tile per image (multi-image samples): pad to square with the mean colour, resize."""
    prepared = prepare_base_only(image, image_size=image_size, patch_size=patch_size, mean=mean)
    return _finish(prepared, image_size, mean, std)


def process_frames(
    frames: np.ndarray,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    patch_size: int = DEFAULT_PATCH_SIZE,
    mean: Sequence[float] = SIGLIP_MEAN,
    std: Sequence[float] = SIGLIP_STD,
) -> AnyResImage:
    """Video frames [T, H, W, 3] uint8 -> [T, 3, S, S], each frame resized (bicubic, no pad)."""
    return _finish(prepare_frames(frames, image_size=image_size, patch_size=patch_size), image_size, mean, std)
