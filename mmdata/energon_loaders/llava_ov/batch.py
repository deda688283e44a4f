"""`LlavaOVBatch`: what the LLaVA-OV task encoder yields and `mmtrain.llava_ov` consumes.

On top of `PackedBatch` (token stream, shifted labels, packing metadata):
- `input_ids` already has every image/video expanded: an image occupies exactly `num_tokens`
  consecutive positions holding `image_token_id` (same as what
  `transformers.LlavaOnevisionProcessor` produces), a video `num_tokens` positions of
  `video_token_id`.
- Media are flattened over the whole batch in the order they appear in the token stream.
  `pixel_values` stacks all tiles/frames; `tiles_per_media[i]` tiles belong to media i.
  MEDIA_ANYRES: tile 0 is the base image, then grid_shapes[i] = (rows, cols) tiles row-major;
  MEDIA_BASE_ONLY: 1 tile; MEDIA_VIDEO: one tile per sampled frame. `num_media_tokens[i]` equals
  `anyres` counts (num_image_tokens / num_base_only_tokens / num_video_tokens), the same numbers
  HF's LlavaOnevisionProcessor expands to.
- Loss: on assistant content and the assistant's closing `<|im_end|>` only (chat_template.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from mmdata.energon_loaders.batch import PackedBatch
from mmdata.energon_loaders.llava_ov.anyres import SIGLIP_MEAN, SIGLIP_STD, normalise_pixels

# media_kind values
MEDIA_ANYRES = 0  # single image: base tile + anyres grid
MEDIA_BASE_ONLY = 1  # one tile per image (multi-image samples)
MEDIA_VIDEO = 2  # sampled frames, pooled per frame


@dataclass(kw_only=True)
class LlavaOVBatch(PackedBatch):
    #: [total_tiles, 3, H, W]: uint8 resized/padded tiles from the loader (4x less to pin and copy
    #: than fp32), normalised on the device by `normalised_pixels()`; float = already normalised
    pixel_values: torch.Tensor
    tiles_per_media: torch.Tensor  # [num_media] int64
    media_kind: torch.Tensor  # [num_media] int64 (MEDIA_*)
    image_sizes: torch.Tensor  # [num_media, 2] int64 original (height, width)
    grid_shapes: torch.Tensor  # [num_media, 2] int64 anyres grid (rows, cols); (0, 0) if none
    num_media_tokens: torch.Tensor  # [num_media] int64 LLM positions each media expands to
    #: the normalisation `normalised_pixels()` applies to uint8 `pixel_values`
    pixel_mean: tuple[float, float, float] = SIGLIP_MEAN
    pixel_std: tuple[float, float, float] = SIGLIP_STD
    #: host copy of `input_ids` (where the media placeholders are); filled by `to()`
    input_ids_host: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: how many of the media each row holds (media never cross rows); the loader fills it, a batch
    #: built without it is taken as one row's (`row_items`)
    media_per_row: list[int] = field(default_factory=list)

    #: per-media fields, split and joined with their rows (`row_items`)
    MEDIA_FIELDS: ClassVar[tuple[str, ...]] = (
        "tiles_per_media",
        "media_kind",
        "image_sizes",
        "grid_shapes",
        "num_media_tokens",
    )
    # the layout and the CP media split read these with .tolist(): they never leave the host
    HOST_FIELDS: ClassVar[tuple[str, ...]] = PackedBatch.HOST_FIELDS + MEDIA_FIELDS + ("input_ids_host",)
    FIRST_STAGE_FIELDS: ClassVar[tuple[str, ...]] = ("pixel_values",)
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = PackedBatch.DERIVED_FIELDS + ("input_ids_host",)

    def to(self, device: Any, first_stage: bool = True) -> LlavaOVBatch:
        moved = super().to(device, first_stage)
        if moved.input_ids_host is None and self.input_ids.device.type == "cpu":
            moved.input_ids_host = self.input_ids
        return moved

    def row_items(self) -> list[dict[str, Any]]:
        """Per row, its media: their metadata, their tiles of `pixel_values`, their count."""
        rows = int(self.input_ids.shape[0])
        media = len(self.tiles_per_media)
        counts = list(self.media_per_row) or ([media] if rows == 1 else [])
        if len(counts) != rows or sum(counts) != media:
            raise ValueError(
                f"media_per_row {self.media_per_row} does not place the batch's {media} media in its {rows} rows"
            )
        tiles = [int(t) for t in self.tiles_per_media.tolist()]
        out, m, t = [], 0, 0
        for n in counts:
            k = sum(tiles[m : m + n])
            out.append(
                {
                    **{name: getattr(self, name)[m : m + n] for name in self.MEDIA_FIELDS},
                    "pixel_values": self.pixel_values[t : t + k],
                    "media_per_row": [n],
                }
            )
            m, t = m + n, t + k
        return out

    @classmethod
    def join_items(cls, rows: Sequence[LlavaOVBatch]) -> dict[str, Any]:
        items = [r.row_items() for r in rows]  # checks each row's media
        return {
            **{name: torch.cat([getattr(r, name) for r in rows]) for name in cls.MEDIA_FIELDS + ("pixel_values",)},
            "media_per_row": [n for per_row in items for it in per_row for n in it["media_per_row"]],
        }

    def host_input_ids(self) -> torch.Tensor:
        """`input_ids` on the CPU without a device-to-host read when the batch came through `to()`."""
        return self.input_ids_host if self.input_ids_host is not None else self.input_ids.cpu()

    def normalised_pixels(self) -> torch.Tensor:
        """float32 SigLIP-normalised tiles on `pixel_values`' device (bit-equal to the loader's
        former fp32 normalisation: `anyres.normalise_pixels`)."""
        if self.pixel_values.dtype != torch.uint8:
            return self.pixel_values
        return normalise_pixels(self.pixel_values, self.pixel_mean, self.pixel_std)
