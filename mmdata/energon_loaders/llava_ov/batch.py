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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmdata.energon_loaders.batch import PackedBatch

if TYPE_CHECKING:
    import torch

# media_kind values
MEDIA_ANYRES = 0  # single image: base tile + anyres grid
MEDIA_BASE_ONLY = 1  # one tile per image (multi-image samples)
MEDIA_VIDEO = 2  # sampled frames, pooled per frame


@dataclass(kw_only=True)
class LlavaOVBatch(PackedBatch):
    pixel_values: torch.Tensor  # [total_tiles, 3, H, W] float32 (SigLIP-normalised)
    tiles_per_media: torch.Tensor  # [num_media] int64
    media_kind: torch.Tensor  # [num_media] int64 (MEDIA_*)
    image_sizes: torch.Tensor  # [num_media, 2] int64 original (height, width)
    grid_shapes: torch.Tensor  # [num_media, 2] int64 anyres grid (rows, cols); (0, 0) if none
    num_media_tokens: torch.Tensor  # [num_media] int64 LLM positions each media expands to
